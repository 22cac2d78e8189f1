"""The project's logger: one INFO/WARN line for every automatic decision and fallback."""
import contextlib
import logging
import sys
import time

logger = logging.getLogger("freetoken")


def stamp(created: float | None = None) -> str:
    """ISO 8601 UTC time with milliseconds, the first word of every line the server writes, so its
    lines order against a client's or another replica's (journalctl and docker logs add theirs)."""
    created = time.time() if created is None else created
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created * 1000) % 1000:03d}Z"


class _Stamped(logging.Formatter):
    def formatTime(self, record, datefmt=None):
        return stamp(record.created)


class _Holding(logging.StreamHandler):
    """stderr, except that lines logged while a reply streams to the terminal wait for its end
    (``held``): on a terminal both streams share one screen, and a line landed mid-reply."""

    def __init__(self, stream):
        super().__init__(stream)
        self.holding, self.waiting = 0, []

    def emit(self, record):
        (self.waiting.append if self.holding else super().emit)(record)

    def resume(self):          # not release(): logging.Handler's lock uses that name
        self.holding -= 1
        while not self.holding and self.waiting:
            super().emit(self.waiting.pop(0))


@contextlib.contextmanager
def held():
    """Log lines wait until the block ends (a reply streaming to stdout)."""
    handlers = [h for h in logger.handlers if isinstance(h, _Holding)]
    for h in handlers:
        h.holding += 1
    try:
        yield
    finally:
        list(map(_Holding.resume, handlers))


def setup(level: str = "INFO") -> None:
    """Log to stderr, each line stamped (``stamp``); called by the CLI, never at import."""
    if any(getattr(h, "_freetoken", False) for h in logger.handlers):
        logger.setLevel(level)
        return
    handler = _Holding(sys.stderr)
    handler.setFormatter(_Stamped("%(asctime)s [freetoken] %(levelname)s %(message)s"))
    handler._freetoken = True
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class Log:
    """Adapts a logging.Logger (info/warning) or a plain callable(msg) to info()/warn()."""

    def __init__(self, sink=None):
        if isinstance(sink, Log):
            sink = sink._sink
        self._sink = sink if sink is not None else logging.getLogger("freetoken")

    def info(self, msg: str) -> None:
        if hasattr(self._sink, "info"):
            self._sink.info(msg)
        else:
            self._sink(msg)

    def warn(self, msg: str) -> None:
        if hasattr(self._sink, "warning"):
            self._sink.warning(msg)
        else:
            self._sink(f"WARN {msg}")
