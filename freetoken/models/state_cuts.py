"""Recurrent states captured in the middle of a forward: a hybrid's prefill chunk may span several
anchors, and the state after each of them is wanted (engine/resume.py checkpoints it). Rather
than ending the chunk at every anchor, which costs a whole forward each (every MoE layer sweeps
its experts' weights once per forward), the GDN layers alone run their conv and delta rule in
pieces split at those positions and hand the state after each piece to its sink. Attention and
the MLPs still run the whole chunk at once. The recurrent rule is token by token, so a piecewise
run computes exactly what one run does.

Shape legend: T tokens in the step, B sequences, b those with tokens in a piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

# sink(kind, j, state): store GDN layer j's state row (kind "conv" f32[K-1, C] or "rule"
# f32[Hv, Dk, Dv]), a device array read before the next piece overwrites it
Sink = Callable[[str, int, object], None]


@dataclass(frozen=True)
class Piece:
    lo: int                       # the piece is tokens [lo, hi) of the step
    hi: int
    seq_starts: np.ndarray        # int32[b+1] the piece's sequences, from 0 to hi - lo
    state_slots: np.ndarray       # int32[b] their state rows
    sinks: tuple                  # ((state row, Sink), ...) of the cuts at hi


def split(seq_starts: np.ndarray, state_slots: np.ndarray, cuts) -> tuple[Piece, ...]:
    """Pieces of the step [0, T) ending at every cut. seq_starts int32[B+1], state_slots int32[B];
    cuts: (t, b, sink), the state of sequence b after step tokens [.., t), seq_starts[b] < t <=
    seq_starts[b+1]."""
    at: dict[int, list] = {}
    for t, b, sink in cuts:
        assert seq_starts[b] < t <= seq_starts[b + 1], (t, b, seq_starts)
        at.setdefault(int(t), []).append((int(state_slots[b]), sink))
    T = int(seq_starts[-1])
    ends = sorted(set(at) | {T})
    pieces, lo = [], 0
    for hi in ends:
        lengths = np.clip(np.minimum(seq_starts[1:], hi) - np.maximum(seq_starts[:-1], lo), 0, None)
        inside = np.flatnonzero(lengths)                     # sequences with tokens in [lo, hi)
        starts = np.concatenate([[0], np.cumsum(lengths[inside])]).astype(np.int32)
        pieces.append(Piece(lo, hi, starts, np.asarray(state_slots)[inside].astype(np.int32),
                            tuple(at.get(hi, ()))))
        lo = hi
    return tuple(pieces)
