"""A dependency-free progress bar that draws on stderr only when stderr is a terminal."""
from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
_WIDTH = 30


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """Yield the items of `iterable`, redrawing `desc [####    ] i/total` on a TTY stderr.

    Silent (a plain pass-through) when stderr is redirected, so logs and tests stay clean.
    """
    stream = sys.stderr
    if not _is_tty(stream):
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    start = time.monotonic()
    done = 0
    _draw(stream, desc, done, total, 0.0)
    try:
        for item in iterable:
            yield item
            done += 1
            _draw(stream, desc, done, total, time.monotonic() - start)
    finally:  # end the line even when the consumer fails midway, so tracebacks start clean
        stream.write("\n")
        stream.flush()


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def _draw(stream, desc: str, done: int, total: int | None, elapsed: float) -> None:
    if total:
        filled = min(_WIDTH, _WIDTH * done // total)
        bar = f"[{'#' * filled}{' ' * (_WIDTH - filled)}] {done}/{total}"
    else:
        bar = f"{done}"
    label = f"{desc} " if desc else ""
    stream.write(f"\r{label}{bar} {elapsed:.1f}s")
    stream.flush()
