"""CUDA-graph decode replay equals the eager forward on the packaged demo model, batch sizes 1..4,
over several decode steps with real prefilled contexts; anything without a graph runs eagerly.

The engine does not wire the cuda backend yet, so the model object is built here: device
weights, a device KV pool, the `fused` MoE as one experts call per layer. Two stand-ins until
the model and moe/runtime.py are capture-safe (see engine/graphs.py): ops called without `out`
get one allocated (from the graph pool during capture), and the MoE skips the runtime's host-side
hit counting, which synchronises.
"""
import dataclasses
from types import SimpleNamespace

import numpy as np

from freetoken.engine.request import SamplingParams
import pytest

from tests.helpers import assert_close
from freetoken.cupy_loader import cupy as load_cupy

pytestmark = pytest.mark.gpu
MAX_BATCH, MAX_CONTEXT = 4, 512
OUT_SHAPES = {  # op -> out for the args it was called with
    "embedding": lambda xp, ids, table: xp.empty((ids.shape[0], table.shape[1]), np.float32),
    "rms_norm": lambda xp, x, *_: xp.empty(x.shape, np.float32),
    "rope": lambda xp, x, *_: xp.empty(x.shape, np.float32),
    "linear": lambda xp, x, w: xp.empty((x.shape[0], w.shape[0]), np.float32),
    "attention": lambda xp, q, *_: xp.empty(q.shape, np.float32),
    "experts": lambda xp, x, *_: xp.empty(x.shape, np.float32),
    "router": lambda xp, logits, k, _: (xp.empty((logits.shape[0], k), np.int32),
                                        xp.empty((logits.shape[0], k), np.float32)),
}


def _with_out(ops):
    def wrap(fn, shape):
        return lambda *a, out=None: fn(*a, shape(ops.xp, *a) if out is None else out)
    return dataclasses.replace(ops, **{op: wrap(getattr(ops, op), shape)
                                       for op, shape in OUT_SHAPES.items()})


def _to_device(obj, cp):
    if isinstance(obj, np.ndarray):
        return cp.asarray(obj)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, cp) for o in obj)
    if dataclasses.is_dataclass(obj):
        return type(obj)(**{f.name: _to_device(getattr(obj, f.name), cp)
                            for f in dataclasses.fields(obj)})
    return obj


class FusedMoE:
    """moe.forward(j, x, ids, weights, prefill) with every expert resident: one experts call."""

    def __init__(self, ops, weights, cfg):
        self.ops, self.banks = ops, [(weights.layers[i].gate_up, weights.layers[i].down)
                                     for i in cfg.moe_layers]

    def forward(self, j, x, ids, weights, prefill=False):
        return self.ops.experts(x, ids, weights, *self.banks[j])


@pytest.fixture(scope="module")
def demo():
    cp = load_cupy()

    from freetoken.backend import get_ops
    from freetoken.models.hf_config import read_model_config
    from freetoken.models.demo import packaged_demo_dir
    from freetoken.engine.graphs import DecodeGraphs
    from freetoken.engine.kv_pool import KVPool
    from freetoken.models.qwen3_moe import Qwen3Moe
    from freetoken.models.weights import load_weights
    cfg = read_model_config(packaged_demo_dir())
    ops = _with_out(get_ops("cuda"))
    weights = _to_device(load_weights(packaged_demo_dir(), cfg), cp)
    kv = KVPool(cfg.num_layers, 4096, cfg.num_kv_heads, cfg.head_dim, np.uint16, cp)
    model = Qwen3Moe(cfg, weights, ops, FusedMoE(ops, weights, cfg), kv)
    graphs = DecodeGraphs(model, ops, MAX_BATCH, MAX_CONTEXT)
    kv.alloc(MAX_BATCH)          # slots 0..B-1 take the capture warm-up's dummy rows
    graphs.capture_all()
    return SimpleNamespace(cfg=cfg, ops=ops, model=model, kv=kv, graphs=graphs)


def _requests(B, rng, vocab):
    from freetoken.engine.request import Request
    return [Request(prompt_ids=rng.integers(0, vocab, 20 + 37 * b).tolist(), params=SamplingParams())
            for b in range(B)]


def _step(demo, reqs, counts):
    """A host batch (engine/runner.build_batch) of counts[i] new tokens of request i."""
    from freetoken.engine.runner import build_batch
    batch = build_batch(list(zip(reqs, counts)), demo.kv.alloc)
    for r, n in zip(reqs, counts):
        r.num_computed += n
    return batch


def _eager(demo, batch):
    return demo.model.forward(dataclasses.replace(
        batch, **{k: demo.ops.to_device(v) for k, v in batch.__dict__.items()
                  if isinstance(v, np.ndarray)}))


@pytest.mark.parametrize("B", range(1, MAX_BATCH + 1))
def test_replay_equals_eager(demo, B):
    rng = np.random.default_rng(B)
    reqs = _requests(B, rng, demo.cfg.vocab_size)
    logits = _eager(demo, _step(demo, reqs, [len(r.all_ids) for r in reqs]))   # prefill
    for _ in range(4):
        tokens = logits.get().argmax(axis=1)
        for r, t in zip(reqs, tokens):
            r.output_ids.append(int(t))
        batch = _step(demo, reqs, [1] * B)
        eager = _eager(demo, batch).get()       # both write the new tokens' K/V: same values
        replay = demo.graphs.forward(batch)
        assert replay is demo.graphs.graphs[B].logits
        assert_close(f"graph vs eager B{B}", eager, replay.get(), 1e-4, 1e-4)
        np.testing.assert_array_equal(eager.argmax(axis=1), replay.get().argmax(axis=1))
        logits = replay
    for r in reqs:
        demo.kv.free(r.slots)


def test_sizes_without_a_graph_run_eagerly(demo):
    rng = np.random.default_rng(9)
    reqs = _requests(MAX_BATCH + 1, rng, demo.cfg.vocab_size)
    _eager(demo, _step(demo, reqs, [len(r.all_ids) for r in reqs]))
    for r in reqs:
        r.output_ids.append(1)
    batch = _step(demo, reqs, [1] * len(reqs))
    out = demo.graphs.forward(batch)
    assert all(out is not g.logits for g in demo.graphs.graphs.values())
    assert_close("eager fallback", _eager(demo, batch).get(), out.get(), 1e-5, 1e-5)
    for r in reqs:
        demo.kv.free(r.slots)


def test_disabled_graphs_capture_nothing(demo):
    from freetoken.engine.graphs import DecodeGraphs
    off = DecodeGraphs(demo.model, demo.ops, MAX_BATCH, MAX_CONTEXT, enabled=False)
    off.capture_all()
    assert off.graphs == {}
