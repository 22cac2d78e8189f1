"""Streams, events and graphs of the emulated device: nothing is in order for free.

Every device operation (kernel launch, copy, numpy-style array op) is a closure enqueued on the
current stream; it runs only when something forces it: a stream, event or device synchronize, a
blocking copy to the host, an event recorded after it that another stream waits on when that
stream's work runs. So code that reads a copy's destination without the right wait sees stale
bytes, as it would on a GPU under load (under the fuzz, stream_fuzz.py also runs work early, at
random). The legacy default stream (ptr 0) waits for earlier work of blocking streams and they for
it; ``Stream(non_blocking=True)`` streams are ordered with nothing.

Capture (``begin_capture``/``end_capture``) records the closures into a ``Graph`` instead; during a
capture a host synchronisation, a pageable host copy on the capturing stream, the legacy stream,
or an allocation outside a private graph pool is an error naming the call (what the driver reports
as cudaErrorStreamCaptureUnsupported / Invalidated / Implicit).
"""
from __future__ import annotations

import itertools
import threading
import time

from freetoken.cuda_emu import hazards, stream_fuzz
from freetoken.cuda_emu.memory import _CAPTURE_GUARD, CaptureError, owners

# A GPU runs queued work on its own; a host that never waits blocks once about this many launches
# are pending. Here the oldest half runs when a queue grows past it (and memory stays bounded).
QUEUE_DEPTH = 1024
_seq = itertools.count(1)
_lock = threading.RLock()
_local = threading.local()
_capturing: set = set()
_streams_by_ptr: dict = {}
_ptrs = itertools.count(0x5000)


class Op:
    """One enqueued device operation; `done` once it has run. It keeps the memory it touches
    alive until then (memory.owners)."""
    __slots__ = ("fn", "name", "seq", "done", "ranges", "keep")

    def __init__(self, fn, name: str, ranges=()):
        self.fn, self.name, self.seq, self.done, self.ranges = fn, name, 0, False, ranges
        self.keep = owners(ranges)


class Stream:
    """cupy.cuda.Stream: a deferred in-order queue of Ops."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.null, self.non_blocking = null, bool(non_blocking)
        self.ptr = 0 if null else next(_ptrs)
        self._queue: list[Op] = []
        self._capture: list | None = None
        self._running = False
        _streams_by_ptr[self.ptr] = self
        if not null:
            _ALL_STREAMS.append(self)

    # -- enqueue ---------------------------------------------------------------------------
    def enqueue(self, fn, name: str, ranges=()) -> Op:
        """Queue ``fn``; ``ranges`` ((lo, hi, write) device bytes it touches) are checked against
        the other streams' work first (hazards.py)."""
        op = Op(fn, name, ranges)
        with _lock:
            if self._capture is not None:
                self._capture.append(op)
                return op
            if self.null and _capturing:
                raise CaptureError(f"{name} on the legacy default stream while a graph capture is in "
                                   "progress (cudaErrorStreamCaptureImplicit)")
            hazards.queued(self.ptr, self._legacy_after(), name, ranges)
            self._legacy_order(name)
            op.seq = next(_seq)
            self._queue.append(op)
            if len(self._queue) > QUEUE_DEPTH and not self._running:
                self.run_until(self._queue[len(self._queue) // 2])   # the device catches up
            if stream_fuzz.active():
                stream_fuzz.catch_up([NULL] + _ALL_STREAMS)
        return op

    def _legacy_after(self) -> list[int]:
        """The streams this one's next op follows by the legacy default stream's rule."""
        if self.non_blocking:
            return []
        return [s.ptr for s in _ALL_STREAMS if not s.non_blocking] if self.null else [NULL.ptr]

    def _legacy_order(self, name: str) -> None:
        """Legacy default stream semantics: null-stream work waits for blocking streams' earlier
        work, and blocking streams' work waits for the null stream's."""
        if self.non_blocking:
            return
        others = [s for s in _ALL_STREAMS if not s.non_blocking and s is not self] if self.null \
            else [NULL]
        tails = [(s, s._queue[-1]) for s in others if s._queue]
        if tails:
            def wait_legacy():
                for s, last in tails:
                    s.run_until(last)
            op = Op(wait_legacy, f"legacy-stream order before {name}")
            op.seq = next(_seq)
            self._queue.append(op)

    # -- forcing ---------------------------------------------------------------------------
    def run_until(self, target: Op | None) -> None:
        """Run queued ops up to and including target (all when None)."""
        with _lock:
            if target is not None and target.done:
                return
            if self._running:
                raise RuntimeError(f"stream {self.ptr:#x}: circular wait between streams (a deadlock on a GPU)")
            self._running = True
            try:
                while self._queue:
                    op = self._queue.pop(0)
                    op.fn()
                    op.done, op.keep = True, None
                    if op is target:
                        break
            finally:
                self._running = False

    def synchronize(self) -> None:
        host_sync(f"Stream({self.ptr:#x}).synchronize()")
        self.drain_for_host()

    def drain_for_host(self) -> None:
        """The host waits for all queued work: it runs, and what the host queues later follows
        it (hazards.py)."""
        self.run_until(None)
        hazards.host_waited(hazards.recorded(self.ptr))

    def query(self) -> bool:
        return not self._queue

    def wait_event(self, event: "Event") -> None:
        marker = event._marker
        if marker is None:
            return                                   # never recorded: nothing to wait for
        stream, op = marker
        hazards.waited(self.ptr, event._clock)
        self.enqueue(lambda: stream.run_until(op), f"wait for event recorded on stream {stream.ptr:#x}")

    def record(self, event: "Event | None" = None) -> "Event":
        event = event if event is not None else Event()
        event.record(self)
        return event

    # -- capture ---------------------------------------------------------------------------
    def begin_capture(self, mode=None) -> None:
        if self.null:
            raise CaptureError("the legacy default stream cannot be captured (cudaErrorStreamCaptureUnsupported)")
        if self._capture is not None:
            raise CaptureError(f"stream {self.ptr:#x} is already capturing")
        self.run_until(None)
        self._capture = []
        _capturing.add(self)

    def is_capturing(self) -> bool:
        return self._capture is not None

    def end_capture(self) -> "Graph":
        if self._capture is None:
            raise CaptureError(f"end_capture on stream {self.ptr:#x}, which is not capturing")
        ops, self._capture = self._capture, None
        _capturing.discard(self)
        return Graph(ops)

    # -- current stream --------------------------------------------------------------------
    def __enter__(self) -> "Stream":
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()

    def use(self) -> "Stream":
        _stack()[:] = [self]
        return self


_ALL_STREAMS: list[Stream] = []
NULL = Stream(null=True)
Stream.null = NULL          # cupy.cuda.Stream.null


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def get_current_stream() -> Stream:
    st = _stack()
    return st[-1] if st else NULL


def stream_by_ptr(ptr: int) -> Stream:
    try:
        return _streams_by_ptr[int(ptr)]
    except KeyError:
        raise RuntimeError(f"cudaErrorInvalidResourceHandle: no stream with handle {int(ptr):#x}")


def host_sync(what: str) -> None:
    """Called by every host synchronisation: illegal while any stream is capturing."""
    if _capturing:
        raise CaptureError(f"{what}: host synchronisation during graph capture "
                           "(cudaErrorStreamCaptureUnsupported; the capture is invalidated)")


def synchronize_all(what: str = "Device().synchronize()") -> None:
    host_sync(what)
    for s in stream_fuzz.drain_order([NULL] + list(_ALL_STREAMS)):
        s.drain_for_host()


def _no_capture_allocation(what: str) -> None:
    if _capturing and not getattr(_local, "graph_pool", False):
        raise CaptureError(f"{what} during graph capture outside a private graph pool "
                           "(cudaMalloc is not permitted while capturing)")


_CAPTURE_GUARD.append(_no_capture_allocation)


class allow_capture_allocations:
    """Set by using_allocator(MemoryPool().malloc): allocations from a private pool are legal."""

    def __enter__(self):
        self._old = getattr(_local, "graph_pool", False)
        _local.graph_pool = True

    def __exit__(self, *exc):
        _local.graph_pool = self._old


class Event:
    """cupy.cuda.Event: a marker after the work enqueued on a stream before record()."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.disable_timing = disable_timing
        self._marker = None
        self._clock = None          # the recording stream's vector clock then (hazards.py)
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else get_current_stream()   # as CuPy 14
        self._time = None

        def mark():
            self._time = time.perf_counter()
        op = stream.enqueue(mark, "event record")
        if stream._capture is None:
            self._marker = (stream, op)
            self._clock = hazards.recorded(stream.ptr)

    @property
    def done(self) -> bool:
        return self._marker is None or self._marker[1].done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        host_sync("Event.synchronize()")
        if self._marker is not None:
            self._marker[0].run_until(self._marker[1])
            hazards.host_waited(self._clock)


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two completed events (host wall time of their execution)."""
    for e in (start, end):
        if e.disable_timing:
            raise RuntimeError("cudaErrorInvalidResourceHandle: event created with disable_timing")
        if e._time is None:
            raise RuntimeError("cudaErrorNotReady: get_elapsed_time of an event that has not completed")
    return (end._time - start._time) * 1e3


class Graph:
    """cupy.cuda.Graph: the captured ops, replayed in order on a stream."""

    def __init__(self, ops: list[Op]):
        self._ops = ops

    def launch(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else get_current_stream()
        ops = self._ops

        def replay():
            for op in ops:
                op.fn()
        stream.enqueue(replay, f"graph launch ({len(ops)} nodes)", [r for op in ops for r in op.ranges])

    def upload(self, stream=None) -> None:
        pass
