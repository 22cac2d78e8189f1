"""System messages anywhere in a conversation, placed where the model's chat template allows.

Harnesses send system messages after the first turn (Claude Code puts its skill and agent lists
there). Chat templates differ: some render a later system message in place, some raise ("System
message must be at the beginning"), some drop it without a word. So each template is probed once,
and the conversation is shaped to what it does:

- leading system messages (the top-level ``system`` and any that open ``messages``) become one,
  joined by a blank line: every template reads ``messages[0]``;
- a later one stays where it is, as a system turn when the template renders those in place,
  otherwise as a user turn wrapped in ``<system-reminder>`` (the tag Claude Code itself uses for
  instructions inside user turns). It is never hoisted to the top: that would change the prompt's
  beginning each time a harness adds one, and with it every prefix-cache hit of the conversation.
"""
from __future__ import annotations

import weakref

_PROBE = "freetoken-probe-7f3a"        # a text no template writes by itself
_inline: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> renders in place


def place_system(tokenizer, messages: list[dict]) -> list[dict]:
    """`messages` (neutral form) with their system messages where `tokenizer`'s template takes them."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    head = [_join(messages[:lead])] if lead > 1 else messages[:lead]
    rest = messages[lead:]
    if not any(m["role"] == "system" for m in rest) or renders_inline(tokenizer):
        return head + rest
    return head + [_as_reminder(m) if m["role"] == "system" else m for m in rest]


def renders_inline(tokenizer) -> bool:
    """Whether the template renders a system message after the first user turn, in place."""
    known = _inline.get(tokenizer)
    if known is None:
        known = _inline[tokenizer] = _probe(tokenizer)
    return known


def _probe(tokenizer) -> bool:
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "first question"},
             {"role": "assistant", "content": "answer"}, {"role": "system", "content": _PROBE},
             {"role": "user", "content": "second question"}]
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    except ValueError:                  # ChatTemplateError: the template refuses them
        return False
    return "answer" in text and text.find("answer") < text.find(_PROBE) < text.find("second question")


def _join(system: list[dict]) -> dict:
    return {"role": "system", "content": "\n\n".join(m["content"] for m in system if m["content"])}


def _as_reminder(message: dict) -> dict:
    return {"role": "user", "content": f"<system-reminder>\n{message['content']}\n</system-reminder>"}
