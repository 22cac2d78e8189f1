"""One module per op: ``ref`` (numpy spec), ``cpu`` (numba, where numpy is slow), ``gpu`` (CuPy).

Shape legend used in every op: T tokens, H hidden, E experts, k routed, I expert width, S slots,
L layers, V vocab, B sequences, Hq query heads, G kv heads, D head dim, N KV token slots.
Weights are bf16 stored as uint16, or float32; activations are float32.
"""
