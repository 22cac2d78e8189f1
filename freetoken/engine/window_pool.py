"""A sliding-window model's sliding layers' KV, kept as per-request state (gpt-oss: every other
layer attends over its last W = 128 positions only). Each running request owns one row: a ring
of R = W + P positions per sliding layer, position p at ring index p mod R, so a request's
sliding layers cost R positions whatever its context (20b in bf16: 12 layers x 640 positions,
15 MiB a request, where 128k of context held 3 GiB of sliding KV in the token pool). The full
layers keep their KV in the token pool (engine/kv_pool.py) and the radix tree, as before.

Why W + P: a prefill step writes a chunk's keys before its queries read them, and the chunk's
first query reads W - 1 positions back; the model (models/gpt_oss.py) runs a sliding layer's
KV write and attention in pieces of at most P step tokens, so a ring of W + P never overwrites
a position a query of the piece still reads. P is PIECE, or less when the prefill chunk is.

Like a GDN model's state rows (engine/state_pool.py) the ring joins the state checkpoints
(engine/checkpoints.py) at agent edit points: a checkpoint at position p keeps the W positions
before p of every sliding layer, and a request that reuses a cached prefix resumes from one.
The attention op needs no change: the model hands it ring slots (``slots``) and a slot table
(``table``) whose row s reads position p at its ring index, right for every position inside
a token's window, the only ones the op reads.

Shape legend: Ls sliding layers, N rows, R ring positions a row, W window, G kv heads, D head
dim, T tokens in the step, B sequences, C context columns.
"""
from __future__ import annotations

import numpy as np

PIECE = 512   # step tokens of one sliding-layer piece: the ring's room past the window


class WindowPool:
    def __init__(self, num_layers: int, rows: int, window: int, piece: int, kv_heads: int, head_dim: int,
                 dtype, context: int, xp=np):
        self.rows, self.window, self.ring = rows, window, window + piece
        self.piece, self.dtype, self._xp = piece, np.dtype(dtype), xp
        shape = (num_layers, rows * self.ring, kv_heads, head_dim)
        self.k = xp.zeros(shape, dtype=dtype)            # [Ls, N*R, G, D]
        self.v = xp.zeros(shape, dtype=dtype)
        # ring index of every context position, made once: a step's table is one add on it
        self.columns = xp.asarray(np.arange(context, dtype=np.int32) % self.ring)   # int32[C]
        self._free = list(range(rows - 1, -1, -1))
        self._captured = (None, None)    # (position, device ring index) of the last capture

    @classmethod
    def for_model(cls, cfg, rows: int, chunk: int, dtype, context: int, xp=np) -> "WindowPool":
        return cls(len(cfg.sliding_layers), rows, cfg.sliding_window, piece_size(chunk), cfg.num_kv_heads,
                   cfg.head_dim, dtype, context, xp)

    @staticmethod
    def bytes_per_row(cfg, chunk: int, itemsize: int) -> int:
        return _kv_bytes(cfg, cfg.sliding_window + piece_size(chunk), itemsize)

    @staticmethod
    def checkpoint_bytes(cfg, itemsize: int) -> int:
        return _kv_bytes(cfg, cfg.sliding_window, itemsize)

    @property
    def bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def layer(self, j: int):
        """(keys, values) [N*R, G, D] of sliding layer j: the cache arrays the attention op reads."""
        return self.k[j], self.v[j]

    def slots(self, state_slots, tok_seq, positions):
        """int32[T] ring slot of each step token: its row's ring at its position."""
        return state_slots[tok_seq] * np.int32(self.ring) + positions % np.int32(self.ring)

    def table(self, state_slots, width: int):
        """int32[B, width] slot table of the step's sequences (rows state_slots[b])."""
        return state_slots[:, None] * np.int32(self.ring) + self.columns[None, :width]

    def checkpoint_parts(self) -> dict:
        """What a state checkpoint holds: name -> (shape, dtype), the W positions before it."""
        shape = (self.k.shape[0], self.window) + self.k.shape[2:]
        return {"k": (shape, self.dtype), "v": (shape, self.dtype)}

    def read(self, row: int, position: int) -> dict:
        """Row `row`'s keys and values of the W positions before `position`, every sliding layer."""
        at = self._window_slots(row, position)
        return {"k": self.k[:, at], "v": self.v[:, at]}

    def capture(self, kind: str, j: int, ring, position: int):
        """What a checkpoint keeps of one sliding layer's ring [R, G, D] of a row handed to its sink
        (called for k and v of every sliding layer at one position: the index is made once)."""
        if self._captured[0] != position:
            self._captured = (position, self._xp.asarray(self._window_index(position)))
        return ring[self._captured[1]]

    def write(self, row: int, position: int, parts: dict) -> None:
        """Row `row` resumes at `position` from a checkpoint's parts (device arrays)."""
        at = self._window_slots(row, position)
        self.k[:, at] = parts["k"]
        self.v[:, at] = parts["v"]

    def _window_index(self, position: int) -> np.ndarray:
        """Ring index of positions position-W .. position-1. Before position W some are negative:
        their ring index belongs to positions not yet written, written again before any read."""
        return (np.arange(position - self.window, position) % self.ring).astype(np.int64)

    def _window_slots(self, row: int, position: int):
        return self._xp.asarray(row * self.ring + self._window_index(position))

    def alloc(self) -> int:
        """A free row; not zeroed: no position is read before its request writes it."""
        if not self._free:
            raise RuntimeError(f"all {self.rows} sliding-window rows are in use")
        return self._free.pop()

    def free(self, row: int) -> None:
        assert row not in self._free, "window row freed twice"
        self._free.append(row)


def _kv_bytes(cfg, positions: int, itemsize: int) -> int:
    """Keys and values of `positions` positions of every sliding layer."""
    return 2 * len(cfg.sliding_layers) * positions * cfg.num_kv_heads * cfg.head_dim * itemsize


def piece_size(chunk: int) -> int:
    """Step tokens a sliding-layer piece holds: PIECE, or the prefill chunk when it is shorter."""
    return max(1, min(PIECE, chunk))
