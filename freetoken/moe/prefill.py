"""Prefill through whole-layer buffers (docs/design.md, Prefill through whole-layer buffers):
prefill routes nearly every expert, so it skips the residency step and streams each MoE layer's
full expert set to the device.

Overlap (S >= 2E, the default): two buffers of E slots are borrowed from the slot pool, buffer b =
slots [bE, (b+1)E); layer l computes from buffer l % 2 while the copy stream loads layer l+1 into
the other. Per prefill forward (at its first MoE layer): the borrowed slots are invalidated in the
residency state (owners unlinked, usage 0: they become the decode cache's first victims), then a
`begin` event recorded on the compute stream fences the copy stream against a decode still
reading those slots (docs/design.md, Hazards: a buffer is not refilled while a layer still reads
it). A load waits for its buffer's `release` (recorded after the layer that last read it) and
records `ready`; compute waits for `ready`. An expert the decode
cache holds in a slot >= 2E is copied device to device instead of over the link. Routed ids are
used unmapped: buffer position = expert id.

Without overlap (--no-moe-prefill-overlap, or S < 2E with a WARN line): per-layer
materialisation on the compute stream, in groups of min(S, E) experts through slots [0, group):
each group is loaded (resident copies device to device), the ids outside it masked to -1, and the
partial sums added. Slots the prefill borrowed are invalidated, never registered; slots >= the
borrowed range are left alone, so the durable decode cache is S - 2E slots (S - E without overlap).

Shape legend: T tokens, H hidden, k routed, E experts, L MoE layers, S slots.
"""
from __future__ import annotations

import numpy as np

from freetoken.log import Log


def overlap_ok(num_slots: int, num_experts: int, disabled: bool, log=None) -> bool:
    """Whether prefill double-buffers; every fallback is one WARN line that says why."""
    if disabled:
        Log(log).info("moe prefill: overlap disabled (--no-moe-prefill-overlap); each layer is "
                      "materialised in turn")
        return False
    if num_slots < 2 * num_experts:
        Log(log).warn(f"moe prefill: overlap needs >= 2E = {2 * num_experts} expert slots but the "
                      f"cache has {num_slots}; each layer is materialised in turn, in groups of "
                      f"{min(num_slots, num_experts)} experts, without overlap")
        return False
    return True


class PrefillStreamer:
    """Runs prefill MoE layers from the slot pool. dev: moe/device.py; res: its residency state;
    slots(j): the pool as layer j reads it, (gate_up [S,2I,H], down [S,H,I]) device arrays
    (MoERuntime.slots); host: HostPool."""

    def __init__(self, dev, res, slots, host, overlap: bool):
        self.dev, self.res, self.slots, self.host = dev, res, slots, host
        self.E, self.L, self.S = res.E, host.num_layers, slots(0)[0].shape[0]
        self.overlap = overlap and self.S >= 2 * self.E
        self.group = min(self.S, self.E)
        self._begin_ev = dev.event()
        self._ready = [dev.event(), dev.event()]
        self._release = [dev.event(), dev.event()]
        self._loaded = [-1, -1]          # layer held by each buffer in this forward, -1 none
        self._next = 0                   # the MoE layer the current forward expects next
        self.loads = 0                   # whole-layer loads issued (stats)

    def reset(self) -> None:
        """Forget which layers the buffers hold (after the residency state was reset)."""
        self._loaded, self._next = [-1, -1], 0

    def run(self, j: int, x, ids, weights, experts_op, extras=None):
        """Prefill MoE layer j: x f32[T,H], ids int32[T,k] (unmapped), weights f32[T,k] -> f32[T,H].
        extras: the op's keywords for the layer (bias rows by expert id: each call gets the rows of
        the experts it holds, in slot order)."""
        extras = extras or {}
        if not self.overlap:
            return self._materialised(j, x, ids, weights, experts_op, extras)
        if j == 0 or j != self._next:    # a new forward (or an unexpected order): start over
            self._begin()
        b = j % 2
        self._prefetch(j)                # a no-op when the previous layer already loaded it
        if j + 1 < self.L:
            self._prefetch(j + 1)        # overlaps this layer's compute
        self.dev.wait(self._ready[b])
        lo, (gate_up, down) = b * self.E, self.slots(j)
        out = experts_op(x, ids, weights, gate_up[lo:lo + self.E], down[lo:lo + self.E], **extras)
        self.dev.record(self._release[b])
        self._next = j + 1
        return out

    def _begin(self) -> None:
        self.res.invalidate(0, 2 * self.E)           # compute stream, after any decode still in flight
        self.dev.record(self._begin_ev)
        self.dev.wait(self._begin_ev, on_copy=True)
        self._loaded = [-1, -1]

    def _prefetch(self, layer: int) -> None:
        b = layer % 2
        if self._loaded[b] == layer:
            return
        self.dev.wait(self._release[b], on_copy=True)   # the layer that read this buffer is done
        with self.dev.copy_stream():
            self.res.load_layer(layer, 0, self.E, self.dev.host_views(self.host, layer), self.slots(layer),
                                dst0=b * self.E, keep_lo=2 * self.E)
        self.dev.record(self._ready[b], on_copy=True)
        self._loaded[b] = layer
        self.loads += 1

    def _materialised(self, j: int, x, ids, weights, experts_op, extras):
        xp, G, out = self.dev.xp, self.group, None
        host, (gate_up, down) = self.dev.host_views(self.host, j), self.slots(j)
        for first in range(0, self.E, G):
            n = min(G, self.E - first)
            self.res.invalidate(0, n)
            self.res.load_layer(j, first, n, host, (gate_up, down), dst0=0, keep_lo=n)
            self.loads += 1
            local = ids if n == self.E else xp.where((ids >= first) & (ids < first + n),
                                                     ids - first, -1).astype(np.int32)
            part = experts_op(x, local, weights, gate_up[:n], down[:n], **_expert_rows(extras, first, n))
            out = part if out is None else out + part
        self._next = j + 1
        return out


def _expert_rows(extras: dict, first: int, n: int) -> dict:
    """extras with its bias rows cut to experts [first, first+n), the ones a group's call holds."""
    if "bias" not in extras:
        return extras
    return {**extras, "bias": tuple(b[first:first + n] for b in extras["bias"])}


def prefill_as_decode(ids, xp, max_tokens: int, num_slots: int) -> bool:
    """A short prefill chunk (fewer than max_tokens tokens, e.g. after a prefix hit) runs through
    the expert cache like decode when its distinct experts fit the slots; longer chunks touch
    nearly every expert and stream whole layers instead (threshold: docs/performance.md)."""
    if ids.shape[0] >= max_tokens or num_slots <= 0:
        return False
    return int(xp.unique(ids).size) <= num_slots
