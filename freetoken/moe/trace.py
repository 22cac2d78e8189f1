"""Routing traces: every MoE layer's routed expert ids at every step, recorded or synthetic.

File format (one .npz, written with np.savez_compressed, readable with allow_pickle=False):
  ids    int16[R, k]  one row per (step, layer, token), in call order
  layer  int16[R]     MoE layer index j of the row (0..L-1, MoE layers only)
  step   int32[R]     that layer's call count when the row was recorded (0, 1, ...)
  meta   str (0-d)    JSON: {"version": 1, "num_layers": L, "num_experts": E, "top_k": k,
                            "model": name, "source": "recorded" | "synthetic", ...}
Rows with the same (step, layer) are one layer-step's tokens (a batch), consecutive in the file.

Shape legend: R rows, L layers, E experts, k routed, T tokens, B batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

VERSION = 1


@dataclass(frozen=True)
class RoutingTrace:
    """A trace in memory; see the module docstring for the arrays and meta keys."""

    ids: np.ndarray
    layer: np.ndarray
    step: np.ndarray
    meta: dict

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    def layer_steps(self):
        """Yield (layer, ids int32[T,k]) per layer-step, in call order (fresh arrays: safe to rewrite)."""
        key = self.step.astype(np.int64) * self.num_layers + self.layer
        cuts = np.flatnonzero(np.diff(key)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(key)]):
            yield int(self.layer[lo]), self.ids[lo:hi].astype(np.int32)

    def num_layer_steps(self) -> int:
        key = self.step.astype(np.int64) * self.num_layers + self.layer
        return int(np.count_nonzero(np.diff(key))) + (1 if len(key) else 0)

    def save(self, path) -> None:
        np.savez_compressed(path, ids=self.ids.astype(np.int16), layer=self.layer.astype(np.int16),
                            step=self.step.astype(np.int32), meta=np.array(json.dumps(self.meta)))


def load_trace(path) -> RoutingTrace:
    """Read a trace written by RoutingTrace.save / RoutingRecorder.save."""
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["meta"]))
        if meta.get("version") != VERSION:
            raise ValueError(f"{path}: routing trace version {meta.get('version')}, expected {VERSION}")
        return RoutingTrace(f["ids"], f["layer"], f["step"], meta)


class RoutingRecorder:
    """Collects routed ids; call record(j, ids) from every MoE layer's decode call."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, model: str = ""):
        if num_experts > np.iinfo(np.int16).max:
            raise ValueError(f"trace format stores ids as int16; {num_experts} experts do not fit")
        self.meta = {"version": VERSION, "num_layers": num_layers, "num_experts": num_experts,
                     "top_k": top_k, "model": model, "source": "recorded"}
        self._calls = np.zeros(num_layers, np.int64)
        self._rows: list[tuple[int, int, np.ndarray]] = []

    def record(self, j: int, ids: np.ndarray) -> None:
        """Store a copy of layer j's routed ids int32[T,k] (before any rewrite to slots)."""
        self._rows.append((j, int(self._calls[j]), np.array(ids, dtype=np.int16)))
        self._calls[j] += 1

    def trace(self) -> RoutingTrace:
        k = self.meta["top_k"]
        ids = np.concatenate([r[2] for r in self._rows]) if self._rows else np.zeros((0, k), np.int16)
        layer = np.concatenate([np.full(len(r[2]), r[0], np.int16) for r in self._rows] or [[]])
        step = np.concatenate([np.full(len(r[2]), r[1], np.int32) for r in self._rows] or [[]])
        return RoutingTrace(ids, layer.astype(np.int16), step.astype(np.int32), dict(self.meta))

    def save(self, path) -> None:
        self.trace().save(path)


class RecordingMoE:
    """Wraps a MoE runtime: records each decode call's routed ids, then delegates everything.

    moe = RecordingMoE(build_moe(...), RoutingRecorder(L, E, k, model_name)); ...; moe.recorder.save(p)
    """

    def __init__(self, moe, recorder: RoutingRecorder):
        self.moe, self.recorder = moe, recorder

    def forward(self, j, x, ids, weights, prefill=False):
        if not prefill:                    # prefill routes every prompt token: not a decode trace
            self.recorder.record(j, ids)
        return self.moe.forward(j, x, ids, weights, prefill)

    def routed_inline(self, j, ids):
        """A decode route whose experts a kernel ran itself (the cpu backend's one-call layers)."""
        self.recorder.record(j, ids)
        return self.moe.routed_inline(j, ids)

    def __getattr__(self, name):
        return getattr(self.moe, name)


def zipf_popularity(num_experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """p[e] proportional to 1/(rank(e)+1)^s over a random ranking of the experts; f64[E]."""
    p = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** s
    p = p[rng.permutation(num_experts)]
    return p / p.sum()


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, steps: int, *, rho: float,
                    zipf_s: float = 0.8, batch: int = 1, seed: int = 0) -> RoutingTrace:
    """Routing with tunable temporal locality (docs/moe.md "Synthetic traces").

    Each layer has a Zipf(zipf_s) popularity over a random ranking of its experts. Each token of
    a batch is an independent stream: at every step each of its k positions keeps the previous
    step's expert with probability rho, else the free positions are drawn without replacement
    from the layer's popularity (Gumbel top-k), excluding the experts kept.
    """
    if num_experts < top_k or not 0.0 <= rho <= 1.0:
        raise ValueError(f"need E >= k and 0 <= rho <= 1; got E={num_experts} k={top_k} rho={rho}")
    rng = np.random.default_rng(seed)
    logp = np.log(np.stack([zipf_popularity(num_experts, zipf_s, rng) for _ in range(num_layers)]))
    logp = np.repeat(logp, batch, axis=0)                      # [L*B, E], row = layer * B + token
    prev = _fresh(logp, np.zeros((num_layers * batch, top_k), bool), None, rng)
    out = np.empty((steps, num_layers * batch, top_k), np.int16)
    for s in range(steps):
        keep = rng.random(prev.shape) < rho if s else np.zeros(prev.shape, bool)
        prev = _fresh(logp, keep, prev, rng)
        out[s] = prev
    layer = np.tile(np.repeat(np.arange(num_layers, dtype=np.int16), batch), steps)
    step = np.repeat(np.arange(steps, dtype=np.int32), num_layers * batch)
    meta = {"version": VERSION, "num_layers": num_layers, "num_experts": num_experts,
            "top_k": top_k, "model": "synthetic", "source": "synthetic", "rho": rho,
            "zipf_s": zipf_s, "batch": batch, "seed": seed}
    return RoutingTrace(out.reshape(-1, top_k), layer, step, meta)


def _fresh(logp, keep, prev, rng) -> np.ndarray:
    """New ids int16[R,k]: prev where keep, else distinct Gumbel-top-k draws excluding the kept ids."""
    keys = logp + rng.gumbel(size=logp.shape)
    new = np.empty(keep.shape, np.int16)
    for r in range(keep.shape[0]):
        kept = prev[r][keep[r]] if prev is not None else np.empty(0, np.int16)
        keys[r, kept] = -np.inf                       # a token's k experts are distinct
        new[r, keep[r]] = kept
        free = ~keep[r]
        new[r, free] = np.argsort(-keys[r], kind="stable")[: int(free.sum())]
    return new


def shared_consecutive(trace: RoutingTrace) -> np.ndarray:
    """Mean number of experts a token shares with the previous step, per layer (f64[L]; batch 1).

    The same statistic as the demo model's README ("shared, consecutive tokens"); uniform random
    routing gives k*k/E.
    """
    L = trace.num_layers
    shared, count = np.zeros(L), np.zeros(L)
    last: dict[int, np.ndarray] = {}
    for j, ids in trace.layer_steps():
        row = ids[0]
        if j in last:
            shared[j] += len(np.intersect1d(row, last[j]))
            count[j] += 1
        last[j] = row
    return shared / np.maximum(count, 1)
