"""Semantic anchors: the token positions where agent harnesses edit their context, so a state
checkpoint taken there survives the edit. Found from the chat template's own markers, tokenized
by the model's tokenizer (no hard-coded ids): after each end of turn (or of a harmony message),
after each `</think>`, before each tool-call opener and after each tool result. A marker that
tokenizes to several tokens is matched as a sequence. Plus a fixed interval for prompts with no
anchors.
"""
from __future__ import annotations

# (marker text, where the anchor sits) for every marker a Qwen-style template may use
AFTER = ("<|im_end|>", "</think>", "</tool_response>",
         "<|end|>", "<|call|>")   # harmony's (gpt-oss): a message's end, a tool call's end
BEFORE = ("<tool_call>",)
# a user message opens with USER_TURN; a tool result is a user message that starts with TOOL_RESULT
# (Qwen), or a message of its own (harmony: HARMONY_USER, and HARMONY_TOOL with the tool's name)
USER_TURN, TOOL_RESULT = "<|im_start|>user", "<tool_response>"
HARMONY_USER, HARMONY_TOOL = "<|start|>user", "<|start|>functions."


class Anchors:
    def __init__(self, after: list[tuple[int, ...]], before: list[tuple[int, ...]], interval: int = 0,
                 user_turn: tuple[int, ...] = (), tool_result: tuple[int, ...] = (), harmony_turns=None):
        self.after, self.before, self.interval = after, before, interval
        self.user_turn, self.tool_result = user_turn, tool_result
        self.harmony_turns = harmony_turns    # (user turn, tool turn) markers of a harmony template, or None

    @classmethod
    def for_tokenizer(cls, tokenizer, semantic: bool = True, interval: int = 0) -> "Anchors":
        """The markers the chat template really contains (its source text), as token sequences."""
        template = tokenizer.chat_template or ""
        seq = lambda text: tuple(tokenizer.encode(text))
        pick = lambda markers: [seq(m) for m in markers if m in template and seq(m)] if semantic else []
        user, result = (pick((m,)) or [()] for m in (USER_TURN, TOOL_RESULT))
        harmony = [pick((m,)) for m in (HARMONY_USER, HARMONY_TOOL)]
        return cls(pick(AFTER), pick(BEFORE), interval, user[0], result[0],
                   tuple(m[0] for m in harmony) if all(harmony) else None)

    @property
    def openers(self) -> frozenset:
        """Token ids that open a tool call on their own (decode can see these as they are sampled)."""
        return frozenset(m[0] for m in self.before if len(m) == 1)

    @property
    def markers(self) -> int:
        return len(self.after) + len(self.before)

    def positions(self, ids: list[int]) -> list[int]:
        """Sorted token positions p in (0, len(ids)) where the state after ids[:p] is worth
        keeping."""
        found = set()
        for marker in self.after + self.before:
            n, first = len(marker), marker[0]
            for i, t in enumerate(ids):
                if t == first and tuple(ids[i:i + n]) == marker:
                    found.add(i + n if marker in self.after else i)
        if self.interval > 0:
            found.update(range(self.interval, len(ids), self.interval))
        return sorted(p for p in found if 0 < p < len(ids))

    def ends_a_query(self, ids: list[int]) -> bool:
        """The prompt's last user message is a real query, not a tool result. The template then
        renders everything after it differently once the next query arrives (Qwen3's drops every
        earlier thinking block), so the state at such a prompt's end is worth keeping long."""
        if self.harmony_turns is not None:          # the last user message after the last tool result
            user, tool = (_last(ids, marker) for marker in self.harmony_turns)
            return user is not None and (tool is None or user > tool)
        n = len(self.user_turn)
        if not n or not self.tool_result:
            return False
        last = _last(ids, self.user_turn)
        if last is None:
            return False
        body = ids[last + n:last + n + len(self.tool_result) + 2]      # after the role's newline
        m = len(self.tool_result)
        return not any(tuple(body[i:i + m]) == self.tool_result for i in range(len(body) - m + 1))


def _last(ids: list[int], marker: tuple[int, ...]) -> int | None:
    """Where marker last starts in ids, or None."""
    n = len(marker)
    return next((i for i in range(len(ids) - n, -1, -1) if tuple(ids[i:i + n]) == marker), None)
