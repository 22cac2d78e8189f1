"""Turns sampled tokens into text deltas and decides when a request stops.

Stop strings may span token boundaries, so text that could still be the start of a stop string
is held back until it cannot be.
"""
from __future__ import annotations


class TextStream:
    """Per-request detokenized text with stop-string handling."""

    def __init__(self, detokenizer, stop: tuple[str, ...]):
        self.detok = detokenizer
        self.stop = stop
        self.text = ""          # everything emitted so far (the stop string never included)
        self._pending = ""      # decoded but held back: may be the start of a stop string
        self.stopped_by: str | None = None

    def push(self, token_id: int) -> str:
        """Feed one token; returns the text that is now safe to emit."""
        return self._release(self.detok.add(token_id))

    def finish(self) -> str:
        """End of generation: flush the detokenizer and everything held back."""
        delta = self._release(self.detok.flush(), final=True)
        if self.stopped_by is None:
            delta += self._pending
            self.text += self._pending
            self._pending = ""
        return delta

    def _release(self, new_text: str, final: bool = False) -> str:
        if self.stopped_by is not None:
            return ""
        buf = self._pending + new_text
        for s in self.stop:
            at = buf.find(s)
            if at >= 0:
                self.stopped_by, self._pending = s, ""
                self.text += buf[:at]
                return buf[:at]
        hold = 0 if final else self._holdback(buf)
        out, self._pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        self.text += out
        return out

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
