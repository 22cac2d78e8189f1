"""Routed experts: slot cache and residency step, q* split, CPU executor, runtime backends, traces.

  split.py         q* rule (Q16 integers) and FetchPolicy (fraction | cap | all, min-fill)
  residency.py     SlotCache: one LRU of S slots for all MoE layers; the residency step (the spec)
  residency_gpu.py the residency state on a device: CUDA kernel, or the spec over host arrays
  pool.py          Bank (a layer's host experts) and the bank shape check
  host_pool.py     the host expert pool, pinned when a GPU reads it
  device.py        HostDevice (numpy) / CudaDevice (CuPy): arrays, copies, streams, events
  executor.py      CpuExecutor: one worker thread running the `experts` op on host banks
  cpu_branch.py    the -1 experts of a layer call on the CPU: staged (GPU) or in place (host)
  prefill.py       whole-layer prefill streaming through the slot pool
  runtime.py       MoEPlan; build_moe(cfg, banks, plan, ...) -> MoERuntime.forward(j, x, ids, weights, prefill)
                   (the backend, slots and fetch policy come decided: engine/plan.py)
  profile.py       bandwidth profile, phi, backend recommendation
  trace.py         routing traces: recorder, reader, synthetic generator
See docs/moe.md. Nothing is imported here, so `import freetoken.moe` stays cheap.
"""
