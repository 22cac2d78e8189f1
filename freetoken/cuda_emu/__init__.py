"""The emulated CUDA device (FREETOKEN_CUDA_EMULATE=1): a host-memory stand-in for the slice of
CuPy the project uses (cupy_standin.py) and the real cuda/*.cu kernels built by the host C++
compiler against a small emulation header (device_code.py, emu/). docs/debugging.md says what it
checks and what only a real GPU shows."""
