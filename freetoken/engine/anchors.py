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
# (a user message's opener, a tool result's opener) of each template family: Qwen's tool result
# sits inside a user message, harmony's is a message of its own (role functions.NAME); either way
# the prompt ends a query when its last user opener comes after its last tool-result opener
TURNS = (("<|im_start|>user", "<tool_response>"), ("<|start|>user", "<|start|>functions."))


class Anchors:
    def __init__(self, after: list[tuple[int, ...]], before: list[tuple[int, ...]], interval: int = 0,
                 user_turn: tuple[int, ...] = (), tool_result: tuple[int, ...] = ()):
        self.after, self.before, self.interval = after, before, interval
        self.user_turn, self.tool_result = user_turn, tool_result

    @classmethod
    def for_tokenizer(cls, tokenizer, semantic: bool = True, interval: int = 0) -> "Anchors":
        """The markers the chat template really contains (its source text), as token sequences."""
        template = tokenizer.chat_template or ""
        seq = lambda text: tuple(tokenizer.encode(text))
        pick = lambda markers: [seq(m) for m in markers if m in template and seq(m)] if semantic else []
        turns = next((found for found in map(pick, TURNS) if len(found) == 2), ((), ()))
        return cls(pick(AFTER), pick(BEFORE), interval, *turns)

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
        if not self.user_turn or not self.tool_result:
            return False
        user, tool = _last(ids, self.user_turn), _last(ids, self.tool_result)
        return user is not None and (tool is None or user > tool)


def _last(ids: list[int], marker: tuple[int, ...]) -> int | None:
    """Where marker last starts in ids, or None."""
    n = len(marker)
    return next((i for i in range(len(ids) - n, -1, -1) if tuple(ids[i:i + n]) == marker), None)
