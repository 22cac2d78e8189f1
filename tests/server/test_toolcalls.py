"""Tool-call parsing (Qwen JSON and XML forms) on strings, whole and streamed in any cut."""
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.server.toolcalls import ParsedCall, ToolCallParser, parse_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "tags": {"type": "array"},
                                     "zip": {"type": "string"}}}}}]


def run(text: str, cuts=None, tools=TOOLS) -> list:
    """Feed text cut at the given offsets; merge adjacent content strings."""
    parser, out, at = ToolCallParser(tools), [], 0
    for cut in sorted(cuts or []) + [len(text)]:
        out += parser.feed(text[at:cut])
        at = cut
    out += parser.finish()
    merged = []
    for item in out:
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    return merged


def args(call: ParsedCall) -> dict:
    return json.loads(call.arguments)


def test_json_form():
    out = run('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    assert out == [ParsedCall("get_weather", '{"city": "Paris", "days": 3}')]


def test_json_form_with_string_arguments_and_parameters_key():
    out = run('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
              '<tool_call>{"name": "g", "parameters": {"b": null}}</tool_call>')
    assert [(c.name, args(c)) for c in out] == [("f", {"a": [1, 2]}), ("g", {"b": None})]


def test_xml_form_types_values_by_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n5\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
            "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n"
            "<parameter=extra>\n{\"x\": 1}\n</parameter>\n</function>\n</tool_call>")
    (call,) = run(text)
    assert call.name == "get_weather"
    assert args(call) == {"city": "New York", "days": 5, "metric": True, "tags": ["a", "b"], "zip": "01234",
                          "extra": '{"x": 1}'}      # unknown parameters stay strings


def test_xml_multiline_string_keeps_inner_newlines():
    (call,) = run("<tool_call><function=write><parameter=text>\nline 1\n\nline 3\n</parameter></function>"
                  "</tool_call>", tools=None)
    assert args(call) == {"text": "line 1\n\nline 3"}


def test_text_around_calls_and_separating_whitespace():
    out = run('Let me check.\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
              '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n')
    assert out[0] == "Let me check."
    assert [c.name for c in out[1:]] == ["a", "b"]


def test_plain_text_is_untouched():
    text = "def f(x):\n    return x < 3  \n\n"
    assert run(text) == [text]
    assert run(text, cuts=[1, 2, 3, 10]) == [text]


def test_partial_tag_is_held_then_released():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("x <tool_") == ["x"]
    assert parser.feed("cal") == []
    assert parser.feed("endar") == [" <tool_calendar"]


def test_a_call_that_does_not_parse_is_dropped_with_a_warning(caplog):
    """Markup never reaches the client as text: the block goes, a WARN line says so."""
    with caplog.at_level("WARNING", logger="freetoken"):
        assert "".join(run("Sure. <tool_call>not json</tool_call>  after")) == "Sure. after"
        assert run('<tool_call>{"arguments": {}}</tool_call>') == []
    warned = [r.getMessage() for r in caplog.records if "does not parse" in r.getMessage()]
    assert warned == ["a tool call that does not parse was dropped: 'not json'",
                      "a tool call that does not parse was dropped: '{\"arguments\": {}}'"]


def test_truncated_call_at_end(caplog):
    assert [c.name for c in run('<tool_call>{"name": "f", "arguments": {"a": 1}}')] == ["f"]
    with caplog.at_level("WARNING", logger="freetoken"):
        assert "".join(run('Sure. <tool_call>{"name": "f", "argu')) == "Sure. "
    assert "dropped (the output ended inside it)" in caplog.text


def test_parse_calls_xml_without_closing_tags():
    (call,) = parse_calls("<function=f><parameter=a>1", {"f": {"properties": {"a": {"type": "number"}}}})
    assert args(call) == {"a": 1}


SAMPLES = [
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    "\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "no calls here, just < and <tool and </tool_call> text",
    'a <tool_call>{"name": "x", "arguments": {}}</tool_call> b <tool_call>broken</tool_call>',
]


@settings(max_examples=150, deadline=None)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streaming_matches_whole(sample, cuts):
    cuts = [c for c in cuts if c <= len(sample)]
    assert run(sample, cuts) == run(sample)
