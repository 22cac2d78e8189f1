"""A reply's text as the terminal commands (generate --chat, chat) show it. A harmony model
(gpt-oss) streams its markers (the request keeps special tokens) and the parser splits them: the
analysis channel prints as `[analysis] ...` on its own lines, a tool call as `[call NAME ARGS]`, the
final message as plain text; the chat history keeps the final text as the content and the analysis
as reasoning, as the server's APIs do. Any other model's text passes through as it is."""
from __future__ import annotations

from dataclasses import replace


class ReplyText:
    def __init__(self, llm, out, chat: bool = True):
        self.out = out
        self.content, self.reasoning, self.calls = [], [], []
        self._parser, self._kind = None, None          # _kind: what the last text shown was
        if chat and llm.tokenizer.speaks_harmony:      # a raw completion is shown as it is
            from freetoken.server.harmony import HarmonyParser
            self._parser = HarmonyParser()

    def params(self, params):
        """The sampling params with harmony's markers kept in the text (the parser needs them)."""
        return replace(params, skip_special_tokens=False) if self._parser else params

    def write(self, text: str) -> None:
        for kind, part in (self._parser.feed(text) if self._parser else [("content", text)]):
            self._show(kind, part)

    def finish(self) -> None:
        for kind, part in (self._parser.finish() if self._parser else []):
            self._show(kind, part)

    def message(self) -> dict:
        """The assistant message for the chat history."""
        msg = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.calls]
        return msg

    def _show(self, kind: str, part) -> None:
        if kind == "call":
            self.calls.append(part)
            text = f"[call {part.name} {part.arguments}]"
        else:
            (self.reasoning if kind == "reasoning" else self.content).append(part)
            text = part
        if kind != self._kind or kind == "call":         # each channel's text, each call, on lines of its own
            text = ("\n" if self._kind else "") + ("[analysis] " if kind == "reasoning" else "") + text
        self._kind = kind
        self.out.write(text)
        self.out.flush()
