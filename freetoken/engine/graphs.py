"""CUDA-graph decode: one captured forward per batch size, replayed over static input buffers.

A decode step's shapes depend only on its batch size B (T = B new tokens, slot_table padded to
[B, max_context]), so each B is captured once at start-up and every later decode step of that
size is one host->device copy of its inputs plus one graph launch: no Python, no launch overhead
per kernel. Graphs are captured largest batch first into one private CuPy memory pool that they
all share (they never run concurrently, so the smaller ones reuse the largest one's temporaries);
eager code never allocates from it, so a replay cannot overwrite an array that eager code holds.

Capture needs a capture-safe forward: no host synchronisation, no shapes that depend on device
data, no host->device copies (the gpu op wrappers are; their docstrings say so). Of the MoE
backends only `fused` can be: `offload`/`hybrid` decide residency on the host every layer, so
they run eagerly. Capture before serving any request: the warm-up forward writes dummy K/V rows into KV
slots 0..B-1, which are free at start-up.

Shape legend: B sequences (= T tokens in decode), C context cap (max_context), V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken.models.forward_batch import ForwardBatch
from freetoken.cupy_loader import cupy as load_cupy, cupyx as load_cupyx

# int32[B] each; then slot_table. state_slots: a sliding-window model's rows (engine/window_pool.py),
# from which the captured forward computes its ring slots; left at their capture values otherwise
INPUTS = ("ids", "positions", "tok_seq", "slots", "last_index", "state_slots")


class GraphCaptureError(RuntimeError):
    """The forward did something a CUDA graph cannot record (a host sync, a host copy, ...)."""


def _views(buf, B: int, C: int) -> dict:
    """Named views of one int32 buffer [6B + B*C]: the INPUTS, then slot_table [B, C]."""
    views = {name: buf[i * B:(i + 1) * B] for i, name in enumerate(INPUTS)}
    views["slot_table"] = buf[len(INPUTS) * B:].reshape(B, C)
    return views


def _static_inputs(B: int, C: int):
    """A pinned host mirror and its device copy, holding a harmless first step: token b is
    position 0 of sequence b, written to and read from KV slot b (and row b's ring)."""
    cupy = load_cupy()
    cupyx = load_cupyx()
    host = cupyx.zeros_pinned((len(INPUTS) * B + B * C,), np.int32)
    v, b = _views(host, B, C), np.arange(B, dtype=np.int32)
    for name in ("tok_seq", "slots", "last_index", "state_slots"):
        v[name][:] = b
    v["slot_table"][:, 0] = b
    return host, cupy.asarray(host)


def _record(model, batch: ForwardBatch, stream, pool):
    """Warm up eagerly (kernel modules load, op scratch grows), then capture one forward."""
    cupy = load_cupy()
    cupy.cuda.Device().synchronize()   # weights and KV uploaded on other streams are in place
    with stream:
        model.forward(batch)
        stream.synchronize()
        with cupy.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            try:
                logits = model.forward(batch)
            except Exception as e:
                try:                      # end the broken capture so the stream stays usable
                    stream.end_capture()
                except Exception:
                    pass
                raise GraphCaptureError(
                    f"decode forward is not capture-safe at batch size {len(batch.ids)}: "
                    f"{type(e).__name__}: {e}") from e
            graph = stream.end_capture()
        graph.upload(stream)
        stream.synchronize()
    return logits, graph


@dataclass
class DecodeGraph:
    """Static buffers of one batch size and the graph captured over them."""

    batch_size: int
    max_context: int
    host: np.ndarray       # pinned int32 mirror of `dev`, rewritten by every replay
    dev: object            # cupy int32[6B + B*C]: the inputs the graph reads
    batch: ForwardBatch    # views of `dev` (prefill=False): what the captured forward was given
    logits: object         # cupy f32[B, V]: what every replay writes
    graph: object          # cupy.cuda.Graph
    copied: object         # cupy Event after the last input copy: the mirror is reused after it

    @classmethod
    def capture(cls, model, batch_size: int, max_context: int, *, pool=None,
                stream=None) -> "DecodeGraph":
        """Capture model.forward for decode batches of `batch_size` sequences with contexts up
        to `max_context`. `pool`: the shared graph MemoryPool; `stream`: a non-default stream
        (the legacy default stream cannot be captured)."""
        cupy = load_cupy()
        pool = pool if pool is not None else cupy.cuda.MemoryPool()
        stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
        B, C = batch_size, max_context
        host, dev = _static_inputs(B, C)
        batch = ForwardBatch(**_views(dev, B, C), prefill=False)
        logits, graph = _record(model, batch, stream, pool)
        copied = cupy.cuda.Event(block=False, disable_timing=True)
        copied.record(stream)
        return cls(B, C, host, dev, batch, logits, graph, copied)

    def replay(self, batch: ForwardBatch):
        """Copy a host decode batch (engine/runner.build_batch) into the static buffers and
        launch on the current stream; returns logits f32[B, V], overwritten by the next replay.
        Columns of slot_table past the batch's width keep stale values: attention reads row s
        only up to the token's position, which is inside the batch's width."""
        cupy = load_cupy()
        B, C = self.batch_size, batch.slot_table.shape[1]
        assert not batch.prefill and batch.ids.shape == (B,), (batch.prefill, batch.ids.shape)
        assert batch.slot_table.shape[0] == B and C <= self.max_context, batch.slot_table.shape
        self.copied.synchronize()   # the previous replay's copy has left the pinned mirror
        v = _views(self.host, B, self.max_context)
        for name in INPUTS:
            if getattr(batch, name) is not None:      # state_slots of a model without rows
                v[name][:] = getattr(batch, name)
        v["slot_table"][:, :C] = batch.slot_table
        stream = cupy.cuda.get_current_stream()
        self.dev.set(self.host, stream=stream)   # asynchronous: the mirror is pinned
        self.copied.record(stream)
        self.graph.launch(stream)
        return self.logits


class DecodeGraphs:
    """Graphs for decode batch sizes 1..max_batch sharing one pool; anything else runs eagerly.
    `enabled=False` is --no-cuda-graph: every step runs the eager forward."""

    def __init__(self, model, ops, max_batch: int, max_context: int, *, enabled: bool = True):
        self.model, self.ops = model, ops
        self.max_batch, self.max_context, self.enabled = max_batch, max_context, enabled
        self.graphs: dict[int, DecodeGraph] = {}

    def capture_all(self, log=None) -> None:
        """Capture every batch size, largest first so the smaller graphs fit in its pool."""
        if not self.enabled:
            return
        cupy = load_cupy()
        pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
        for B in range(self.max_batch, 0, -1):
            self.graphs[B] = DecodeGraph.capture(self.model, B, self.max_context, pool=pool,
                                                 stream=stream)
        if log is not None:
            log.info("cuda graphs: decode batch sizes 1..%d captured (context cap %d, pool %.1f MiB)",
                     self.max_batch, self.max_context, pool.total_bytes() / 2**20)

    def forward(self, batch: ForwardBatch):
        """Logits f32[B, V] of a host batch: graph replay when one fits, else the eager forward."""
        graph = None if batch.prefill else self.graphs.get(len(batch.last_index))
        if graph is not None and batch.slot_table.shape[1] <= graph.max_context:
            return graph.replay(batch)
        device = {k: (self.ops.to_device(v) if isinstance(v, np.ndarray) else v)
                  for k, v in batch.__dict__.items()}
        return self.model.forward(ForwardBatch(**device))
