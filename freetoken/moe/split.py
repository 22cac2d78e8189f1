"""How many of a layer-step's m expert misses to fetch into the slot cache
(docs/design.md, The q* split).

The rest run on the CPU. Everything here is integer arithmetic so that the CUDA residency kernel
and this numpy/stdlib mirror choose the same q for every m, bit for bit.

phi = B_P / B_H (fill bandwidth over CPU expert bandwidth). Fetching f of m misses costs
f / B_P on the link and (m - f) / B_H on the CPU; the two run concurrently, so the step takes
max(f * B_H, (m - f) * B_P) / (B_P * B_H). Scaled to Q16 that is the `cost` below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

Q16 = 65536


def frac_q16(phi: float) -> int:
    """phi in [0, inf) -> min(65536, max(0, round(phi * 65536))), Python (banker's) round."""
    phi = float(phi)
    if math.isnan(phi):
        raise ValueError("fetch fraction phi is NaN")
    if phi >= 1.0:                      # also keeps round() away from inf
        return Q16
    return min(Q16, max(0, round(phi * Q16)))


def fetch_count(m: int, frac: int) -> int:
    """q for m misses at Q16 fraction frac: the integer argmin of the makespan, ties -> fewer."""
    if m < 0 or not 0 <= frac <= Q16:
        raise ValueError(f"fetch_count: need m >= 0 and 0 <= frac <= {Q16}, got m={m} frac={frac}")

    def cost(f: int) -> int:
        return max(f * (Q16 - frac), (m - f) * frac)

    lo = (m * frac) >> 16
    q = lo if cost(lo) <= cost(lo + 1) else lo + 1
    return min(q, m)


KINDS = ("fraction", "cap", "all")
ORDERS = ("recency", "lowest_id")


@dataclass(frozen=True)
class FetchPolicy:
    """Which q a residency step uses.

    kind "fraction": q = fetch_count(m, frac_q16) (the q* rule; frac 0 is phi = 0, pure CPU).
    kind "cap":      q = min(m, cap)              (--moe-hybrid-max-fetch N).
    kind "all":      q = m                        (classic offload).
    min_fill 1:      q = max(q, 1) whenever m > 0 (keeps a cold cache learning).
    order:           which q misses form the fill set: "recency" (recency descending, ties by
                     lower id; docs/moe.md, The residency step, part 3) or "lowest_id"
                     (ascending expert id).
    """

    kind: str
    frac_q16: int = 0
    cap: int = 0
    min_fill: int = 0
    order: str = "recency"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"FetchPolicy kind {self.kind!r}; expected one of {KINDS}")
        if not 0 <= self.frac_q16 <= Q16:
            raise ValueError(f"FetchPolicy frac_q16 {self.frac_q16} outside [0, {Q16}]")
        if self.cap < 0:
            raise ValueError(f"FetchPolicy cap {self.cap} < 0")
        if self.min_fill not in (0, 1):
            raise ValueError(f"FetchPolicy min_fill {self.min_fill}; expected 0 or 1")
        if self.order not in ORDERS:
            raise ValueError(f"FetchPolicy order {self.order!r}; expected one of {ORDERS}")

    @classmethod
    def fraction(cls, phi: float, min_fill: int = 0, order: str = "recency") -> "FetchPolicy":
        return cls("fraction", frac_q16=frac_q16(phi), min_fill=min_fill, order=order)

    @classmethod
    def fixed_cap(cls, cap: int, min_fill: int = 0, order: str = "recency") -> "FetchPolicy":
        return cls("cap", cap=int(cap), min_fill=min_fill, order=order)

    @classmethod
    def fetch_all(cls, order: str = "recency") -> "FetchPolicy":
        return cls("all", order=order)

    def miss_key(self, recency: int, expert: int) -> tuple[int, ...]:
        """Sort key of a miss: the fill set is the first q misses in ascending key order."""
        return (-recency, expert) if self.order == "recency" else (expert,)

    def count(self, m: int) -> int:
        """q for m misses, 0 <= q <= m."""
        if self.kind == "fraction":
            q = fetch_count(m, self.frac_q16)
        elif self.kind == "cap":
            q = min(m, self.cap)
        else:
            q = m
        if self.min_fill and m > 0:
            q = max(q, 1)
        return q

    def describe(self) -> str:
        """One phrase for log lines."""
        fill = ", at least one fill" if self.min_fill else ""
        if self.order != "recency":
            fill += f", fill order {self.order}"
        if self.kind == "fraction":
            return f"q* rule at phi={self.frac_q16 / Q16:.4f} (frac_q16={self.frac_q16}){fill}"
        if self.kind == "cap":
            return f"fixed cap of {self.cap} fetches per layer-step{fill}"
        return "fetch every miss"
