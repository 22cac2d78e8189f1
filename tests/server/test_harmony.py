"""The harmony parser (freetoken/server/harmony.py) on gpt-oss's output shapes, whole and streamed
a character at a time (the same result however the text is cut)."""
import json

import pytest

from freetoken.server.harmony import HarmonyParser
from freetoken.server.toolcalls import ParsedCall


def parse(text: str, pieces: int = 0) -> list:
    """feed + finish, merged by kind; pieces=1: one character a feed."""
    p, out = HarmonyParser(), []
    for chunk in ([text] if not pieces else list(text)):
        out += p.feed(chunk)
    out += p.finish()
    merged: list = []
    for kind, value in out:
        if merged and merged[-1][0] == kind and isinstance(value, str):
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


CASES = {
    "thinking then an answer": (
        "<|channel|>analysis<|message|>The user asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4",
        [("reasoning", "The user asks 2+2."), ("content", "4")]),
    "a tool call after thinking, the call's marker cut by the stop token": (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Tokyo\"}",
        [("reasoning", "Need the weather."), ("call", ParsedCall("get_weather", json.dumps({"city": "Tokyo"})))]),
    "the recipient in the role header, and <|call|> kept": (
        "<|start|>assistant to=functions.ls<|channel|>commentary json<|message|>{}<|call|>",
        [("call", ParsedCall("ls", "{}"))]),
    "a preamble (commentary without a recipient) is content": (
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.f<|message|>{\"a\": [1, 2]}<|call|>",
        [("content", "Let me check."), ("call", ParsedCall("f", json.dumps({"a": [1, 2]})))]),
    "no markup at all": ("just text, <b>not</b> harmony <| almost", [("content", "just text, <b>not</b> harmony <| almost")]),
    "final with <|return|>": ("<|channel|>final<|message|>done<|return|>", [("content", "done")]),
    "two calls in a row": (
        "<|channel|>commentary to=functions.a<|message|>{\"x\":1}<|call|><|start|>assistant<|channel|>commentary "
        "to=functions.b<|message|>{\"y\":\"z\"}<|call|>",
        [("call", ParsedCall("a", '{"x":1}')), ("call", ParsedCall("b", '{"y":"z"}'))]),   # as written
    "a call that is no JSON object is dropped": (
        "<|channel|>commentary to=functions.f<|message|>[1, 2<|call|>", []),
    "a built-in tool's message is dropped": (
        "<|channel|>analysis<|message|>search<|end|><|start|>assistant<|channel|>commentary to=browser.search"
        "<|message|>{\"query\": \"x\"}<|call|>", [("reasoning", "search")]),
    "a truncated thought stays reasoning": ("<|channel|>analysis<|message|>half a tho", [("reasoning", "half a tho")]),
    "an empty channel name is content": ("<|channel|><|message|>hi", [("content", "hi")]),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("pieces", [0, 1])
def test_harmony_output(name, pieces):
    text, want = CASES[name]
    assert parse(text, pieces) == want


def test_a_partial_marker_is_held_back_until_it_is_one():
    p = HarmonyParser()
    assert p.feed("<|channel|>final<|message|>4 <|e") == [("content", "4 ")]
    assert p.feed("nd|>") == []
    assert p.finish() == []
