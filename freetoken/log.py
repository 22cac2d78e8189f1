"""The project's logger: one INFO/WARN line for every automatic decision and fallback."""
import logging
import sys

logger = logging.getLogger("freetoken")


def setup(level: str = "INFO") -> None:
    """Log to stderr with a short prefix; called by the CLI, never at import."""
    if any(getattr(h, "_freetoken", False) for h in logger.handlers):
        logger.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[freetoken] %(levelname)s %(message)s"))
    handler._freetoken = True
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
