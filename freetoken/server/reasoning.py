"""Splits streamed output into reasoning (inside ``<think>...</think>``) and content.

A think block is recognised only at the start of the output (or is already open when the prompt
opened it). Text that could still become a tag is held back, so splitting never depends on how
the output was cut into deltas.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def partial_tag(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag (may still become it)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """feed(text) -> [(kind, text)] with kind "reasoning" or "content"; finish() flushes."""

    def __init__(self, inside: bool = False):
        # start: a think block may still open | inside | after: skipping blank lines | content
        self.state = "inside" if inside else "start"
        self.buf = ""
        self.started = False        # some reasoning text was emitted (leading blanks are dropped)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out, final=False)
            if (self.state, len(self.buf)) == before:
                return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.state == "inside":
            self._emit(out, "reasoning", self.buf.rstrip())
        elif self.state in ("start", "content"):
            self._emit(out, "content", self.buf)
        self.buf = ""
        return out

    def _start(self, out, final):
        s = self.buf.lstrip()
        if not s or (len(s) < len(OPEN) and OPEN.startswith(s)):
            return                                  # blank so far, or maybe "<thi"
        if s.startswith(OPEN):
            self.state, self.buf = "inside", s[len(OPEN):]
        else:
            self.state = "content"

    def _inside(self, out, final):
        if not self.started:
            self.buf = self.buf.lstrip()
        at = self.buf.find(CLOSE)
        if at >= 0:
            self._emit(out, "reasoning", self.buf[:at].rstrip())
            self.state, self.buf = "after", self.buf[at + len(CLOSE):]
            return
        # hold back a possible "</thi" and trailing blanks (they are dropped before </think>)
        hold = partial_tag(self.buf, CLOSE)
        body = self.buf[:len(self.buf) - hold]
        keep = len(body) - len(body.rstrip())
        cut = len(body) - keep
        if cut > 0:
            self._emit(out, "reasoning", self.buf[:cut])
            self.buf = self.buf[cut:]

    def _after(self, out, final):
        self.buf = self.buf.lstrip()
        if self.buf:
            self.state = "content"

    def _content(self, out, final):
        if self.buf:
            self._emit(out, "content", self.buf)
            self.buf = ""

    def _emit(self, out, kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.started = True
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
