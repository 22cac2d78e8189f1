"""ForwardBatch: the engine -> model contract, one forward step laid out by engine/runner.py
(docs/contracts.md). Every model class takes it; nothing in it knows sequences or HTTP.

Shape legend: T tokens in the step, B sequences, C positions per sequence row, R logit rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ForwardBatch:
    """One forward step over the new tokens of B sequences (built by engine/runner.py)."""

    ids: np.ndarray          # int32[T] token ids
    positions: np.ndarray    # int32[T] position of each token in its sequence
    tok_seq: np.ndarray      # int32[T] which sequence (row of slot_table) each token belongs to
    slots: np.ndarray        # int32[T] KV slot each new token is written to
    slot_table: np.ndarray   # int32[B, C] KV slot of every position of each sequence (padded)
    last_index: np.ndarray   # int32[R] index into T of each token whose logits are needed (>= 1 per sequence)
    prefill: bool            # True when any sequence computes more than one token
    seq_starts: np.ndarray | None = None   # int32[B+1] first token of each sequence in T (state models)
    state_slots: np.ndarray | None = None  # int32[B] state row of each sequence (GDN, sliding windows)
    state_cuts: tuple = ()                 # models/state_cuts.py Pieces: states wanted mid-step (state models' prefill)
