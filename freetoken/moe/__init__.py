"""Routed experts: slot cache and residency step, q* split, CPU executor, runtime backends, traces.

  split.py      q* rule (Q16 integers) and FetchPolicy (fraction | cap | all, min-fill)
  residency.py  SlotCache: one LRU of S slots for all MoE layers; the residency step (the spec)
  pool.py       expert banks and the host stand-in for the device slot pool
  executor.py   CpuExecutor: one worker thread running the `experts` op on host banks
  options.py    start-up decisions: backend, cache size, fetch policy (logged)
  runtime.py    build_moe -> MoERuntime.forward(j, x, ids, weights, prefill)
  trace.py      routing traces: recorder, reader, synthetic generator
See docs/moe.md. Nothing is imported here, so `import freetoken.moe` stays cheap.
"""
