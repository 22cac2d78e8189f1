"""Engine TokenLogprobs in each API's shape: chat's `logprobs.content`, the legacy completions
arrays (with the prompt's for `echo`), and Responses' `output_text.logprobs`.

Token text is the token's own bytes decoded as UTF-8 (a piece of a multi-byte character shows as
U+FFFD; `bytes` holds the exact bytes), so entries can be concatenated back into the output.
"""
from __future__ import annotations


class TokenText:
    """Token id -> (text, bytes), remembered (the same ids recur in every step's top lists)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._seen.get(token_id)
        if found is None:
            raw = self.tokenizer.token_bytes(token_id)
            found = self._seen[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found


def chat_entries(text: TokenText, lps) -> list[dict]:
    """The chat `logprobs.content` list (also Responses' `logprobs`): one entry per token."""
    def one(token_id, logprob):
        t, raw = text(token_id)
        return {"token": t, "logprob": logprob, "bytes": raw}
    return [{**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]} for lp in lps]


def chat_logprobs(text: TokenText, lps) -> dict:
    return {"content": chat_entries(text, lps), "refusal": None}


def completion_logprobs(text: TokenText, lps, echo: tuple | None = None, offset: int = 0) -> dict:
    """The legacy completions object: tokens, token_logprobs, top_logprobs (token -> logprob per
    position) and text_offset (character offset in the choice's text, starting at `offset`).
    `echo` = (prompt ids, prompt logprobs with None first) puts the prompt tokens first."""
    ids = list(echo[0]) if echo else []
    entries = list(echo[1]) if echo else []
    ids += [lp.token for lp in lps]
    entries += list(lps)
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in zip(ids, entries):
        t, _ = text(token_id)
        out["tokens"].append(t)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else {text(k)[0]: v for k, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(t)
    return out
