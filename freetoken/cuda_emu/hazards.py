"""Cross-stream happens-before checking for the emulated device: every device operation's reads
and writes against the order that streams, events and host synchronisations establish (vector
clocks, one component per stream). An access that is not ordered after the last conflicting
access of another stream (write after write, read after write, write after read) is a
HazardError naming both operations and the line of user code that queued each; the lazy
streams (streams.py) would otherwise run them in whatever order something forced.

What orders op B after op A: the same stream (in order); an event recorded after A that B's
stream waited on before queuing B; a host synchronisation that covered A (stream, event or
device synchronize, a blocking copy or read) before B was queued; the legacy default stream's
implicit ordering with blocking streams. The ranges: a kernel's array (or raw pointer, to the
end of its allocation) arguments, written unless the parameter is `const`; an array op's
operands and result; a copy's source and destination. Host code touching device memory
directly and graph-internal order are not checked (a graph replay counts as one operation
with every access of its nodes).

Shape legend: a range is (lo, hi, write) in device addresses, hi exclusive.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

_lock = threading.RLock()
_clocks: dict[int, dict[int, int]] = {}        # stream ptr -> its vector clock
_host: dict[int, int] = {}                     # what the host has seen complete
_records: dict[int, list["Access"]] = {}       # allocation start -> accesses still to check against
_HERE = __file__.rsplit("/", 1)[0]


class HazardError(RuntimeError):
    """Two device operations on one range, one a write, with nothing ordering them."""


@dataclass
class Access:
    lo: int
    hi: int
    write: bool
    stream: int
    clock: int
    name: str
    site: str


def _join(into: dict, other: dict) -> None:
    for s, c in other.items():
        if into.get(s, 0) < c:
            into[s] = c


def clock_of(stream_ptr: int) -> dict[int, int]:
    return _clocks.setdefault(stream_ptr, {})


def site() -> str:
    """The first frame outside the emulator (and the kernel wrappers' launch helper): where the
    operation was queued."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_HERE) or
                             f.f_code.co_filename.endswith("kernels/_cuda.py")):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})" if f else "?"


def queued(stream_ptr: int, after: list[int], name: str, ranges) -> None:
    """An operation queued on ``stream_ptr`` (also ordered after the streams ``after``: the
    legacy stream's rule), touching ``ranges``: checked against the other streams, recorded."""
    with _lock:
        vc = clock_of(stream_ptr)
        _join(vc, _host)
        for other in after:
            _join(vc, clock_of(other))
        vc[stream_ptr] = vc.get(stream_ptr, 0) + 1
        if ranges:
            where = site()
            for lo, hi, write in ranges:
                if hi > lo:
                    _access(Access(lo, hi, write, stream_ptr, vc[stream_ptr], name, where), vc)


def _ordered(a: Access, vc: dict) -> bool:
    return vc.get(a.stream, 0) >= a.clock


def _access(new: Access, vc: dict) -> None:
    from freetoken.cuda_emu import memory
    hit = memory.DEVICE.find(new.lo)
    if hit is None:
        return                                   # host memory: not the device's to order
    records = _records.setdefault(hit[0], [])
    for old in records:
        if old.lo < new.hi and new.lo < old.hi and (old.write or new.write) and not _ordered(old, vc):
            kind = ("write after write" if old.write and new.write else
                    "read after write" if old.write else "write after read")
            raise HazardError(
                f"cross-stream hazard ({kind}) on bytes [{max(old.lo, new.lo) - hit[0]}, "
                f"{min(old.hi, new.hi) - hit[0]}) of a {hit[1] - hit[0]}-byte allocation: "
                f"{new.name} on stream {new.stream:#x}, queued at {new.site}, is not ordered after "
                f"{old.name} on stream {old.stream:#x}, queued at {old.site} (record an event after "
                "the first and wait on it from the second stream, or synchronize)")
    # what the new access covers and follows, no later access can conflict with without
    # conflicting with it too (a read cannot stand in for a write)
    records[:] = [old for old in records if not (new.lo <= old.lo and old.hi <= new.hi and
                  _ordered(old, vc) and (new.write or not old.write))]
    records.append(new)


def recorded(stream_ptr: int) -> dict:
    """An event recorded on the stream now: the vector clock a wait on it joins."""
    with _lock:
        return dict(clock_of(stream_ptr))


def waited(stream_ptr: int, event_clock: dict | None) -> None:
    """The stream waits on an event: what it queues from now on follows the event's work."""
    if event_clock:
        with _lock:
            _join(clock_of(stream_ptr), event_clock)


def host_waited(clock: dict | None) -> None:
    """The host waited for a stream (its clock) or an event: later work follows it."""
    if clock:
        with _lock:
            _join(_host, clock)


def freed(start: int) -> None:
    """An allocation went away: its records too (its addresses may be handed out again)."""
    with _lock:
        _records.pop(start, None)


def array_range(a, write: bool):
    """(lo, hi, write) of an emulated ndarray's bytes, or None for anything else."""
    from freetoken.cuda_emu.ndarray import ndarray
    if not isinstance(a, ndarray) or a._a.size == 0:
        return None
    v = a._a
    base = v.__array_interface__["data"][0]
    steps = [(n - 1) * st for n, st in zip(v.shape, v.strides)]
    return (base + sum(x for x in steps if x < 0), base + sum(x for x in steps if x > 0) + v.itemsize, write)


def arrays_ranges(reads=(), writes=()) -> list:
    """The ranges of the arrays among ``reads`` and ``writes`` (other values are skipped;
    tuples and lists looked into)."""
    out = []
    for group, write in ((reads, False), (writes, True)):
        stack = list(group)
        while stack:
            a = stack.pop()
            if isinstance(a, (tuple, list)):
                stack.extend(a)
            elif (r := array_range(a, write)) is not None:
                out.append(r)
    return out


_declared = threading.local()


class declared:
    """While a launch is queued: (array, written) pairs narrowing its wider pointer arguments
    (a kernel handed a whole pool that writes some slots); kernels/_cuda.launch's ``touches``."""

    def __init__(self, touches):
        self.ranges = [r for a, w in touches if (r := array_range(a, bool(w))) is not None]

    def __enter__(self):
        self._old, _declared.ranges = getattr(_declared, "ranges", None), self.ranges

    def __exit__(self, *exc):
        _declared.ranges = self._old


def narrowed(r):
    """A kernel argument's range, or the declared ranges inside it (never writing through a
    const parameter)."""
    inside = [(lo, hi, w and r[2]) for lo, hi, w in getattr(_declared, "ranges", None) or ()
              if r[0] <= lo and hi <= r[1]]
    return inside or [r]


def pointer_range(ptr: int, write: bool):
    """A raw device pointer's range: to the end of its allocation (a kernel may read that far)."""
    from freetoken.cuda_emu import memory
    hit = memory.DEVICE.find(int(ptr))
    return (int(ptr), hit[1], write) if hit is not None else None
