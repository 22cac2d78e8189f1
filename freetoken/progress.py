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
    if not is_tty(stream):
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    start = time.monotonic()
    done = 0
    draw_line(stream, desc, done, total, 0.0)
    try:
        for item in iterable:
            yield item
            done += 1
            draw_line(stream, desc, done, total, time.monotonic() - start)
    finally:  # end the line even when the consumer fails midway, so tracebacks start clean
        end_line(stream)


def end_line(stream) -> None:
    stream.write("\n")
    stream.flush()


def is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def draw_line(stream, desc: str, done: int, total: int | None, elapsed: float, note: str = "") -> None:
    """Redraw `desc [####    ] done/total elapsed note` in place (the caller checked is_tty)."""
    if total:
        filled = min(_WIDTH, _WIDTH * done // total)
        bar = f"[{'#' * filled}{' ' * (_WIDTH - filled)}] {done}/{total}"
    else:
        bar = f"{done}"
    label = f"{desc} " if desc else ""
    tail = f" {note}" if note else ""
    stream.write(f"\r{label}{bar} {elapsed:.1f}s{tail}\033[K")     # clear what a longer note left
    stream.flush()
