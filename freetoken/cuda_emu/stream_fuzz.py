"""The stream-order fuzz: on with the schedule fuzz (FREETOKEN_CUDA_EMULATE_FUZZ=seed).

Without it the emulated device is the laziest GPU there is: queued work runs only when something
forces it (streams.py), so each stream's work runs as late as its waits allow and a result read
without the right wait is always stale. A real GPU also runs work as soon as it gets to it: an
event's query() is then True, a copy has already read the pinned buffer the host rewrites next,
memory freed to the pool has been used already. Under the fuzz the device does both: after each
operation is queued, with probability CATCH_UP it runs a random prefix of a random stream's queue
(the waits it meets run the work they wait for, as always), and a device-wide synchronisation
drains the streams in a random order. Work on one stream always runs in its order; correct code
computes the same bytes under every seed, and a seed replays its order.
"""
from __future__ import annotations

import random

CATCH_UP = 0.25
_state: dict = {}


def _rng() -> random.Random | None:
    if "rng" not in _state:
        from freetoken.cuda_emu.device_code import fuzz_seed
        set_seed(fuzz_seed())
    return _state["rng"]


def set_seed(seed: int) -> None:
    """Stream-order fuzz from now on with ``seed`` (0: off), whatever the environment said."""
    _state["rng"] = random.Random(seed) if seed else None


def active() -> bool:
    return _rng() is not None


def catch_up(streams) -> None:
    """Maybe run a random prefix of one of ``streams``' queues (called after an enqueue; not
    while some stream's work is running, which is what queued this)."""
    rng = _rng()
    if rng is None or rng.random() >= CATCH_UP or any(s._running for s in streams):
        return
    busy = [s for s in streams if s._queue]
    if busy:
        stream = rng.choice(busy)
        stream.run_until(stream._queue[rng.randrange(len(stream._queue))])


def drain_order(streams: list) -> list:
    """The order a device-wide synchronisation drains ``streams`` in."""
    rng = _rng()
    if rng is None:
        return streams
    return rng.sample(streams, len(streams))
