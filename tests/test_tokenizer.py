"""The packaged tokenizer (freetoken/data/synth-tokenizer: the built-in models' vocabulary with the
plain Qwen3-style template): round trips, streaming detokenizer, chat template, stop ids."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from freetoken.models.demo import packaged_demo_dir, synth_tokenizer_dir, write_random_model
from freetoken.models.hf_config import read_model_config
from freetoken.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer


TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "👋🏽",
    "你好，世界",
    "mixed: café 👋🏽 你好 <think>x</think> ∑ tab\there \u00a0end",
    "<|im_start|>user\nhi<|im_end|>\n",
]
READ_FILE_TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a text file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(synth_tokenizer_dir())


def stream(tok, ids, **kw):
    d = tok.detokenizer(**kw)
    return [d.add(i) for i in ids] + [d.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>a<|im_end|><think>")
    assert ids[0] == 1 and ids[-2:] == [2, 3]  # added tokens are single ids, not split into bytes
    assert tok.decode(ids) == "a<think>"       # <think> is not special: kept when skipping
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x")  # no BOS in this model


def test_multibyte_characters_span_tokens(tok):
    assert len(tok.encode("👋🏽")) > 2  # byte-level BPE: the detokenizer test below is not trivial


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_matches_full_decode(tok, text, skip):
    ids = tok.encode(text)
    parts = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(parts) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in parts)


def test_incremental_detokenizer_emits_characters_as_soon_as_complete(tok):
    ids = tok.encode("你好")
    d = IncrementalDetokenizer(tok)
    out = [d.add(i) for i in ids]
    assert [p for p in out if p] == ["你", "好"]
    assert out[-1] == "好" and d.flush() == ""


def test_incremental_detokenizer_window_stays_small(tok):
    ids = tok.encode(TEXTS[0] * 50)
    d = tok.detokenizer()
    text = "".join(d.add(i) for i in ids) + d.flush()
    assert text == TEXTS[0] * 50
    assert len(d._ids) < 8  # only the last emitted tokens are kept as context


def test_flush_returns_a_cut_character(tok):
    ids = tok.encode("a👋")
    d = tok.detokenizer()
    first = "".join(d.add(i) for i in ids[:-1])
    assert first == "a"
    assert d.flush() == "\ufffd"  # the stream ended inside a character: say so, once


def test_prompt_context(tok):
    prompt = tok.encode("x = 1\n")
    d = tok.detokenizer(prompt_ids=prompt)
    ids = tok.encode("print(x)")
    assert "".join(d.add(i) for i in ids) + d.flush() == "print(x)"


# What Qwen3's template renders for the conversation below: the tool preamble in the system turn,
# the call as a <tool_call> JSON line, the result as a user turn, the empty think block last.
RENDERED_TOOL_CHAT = (
    "<|im_start|>system\nYou are a coding assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(READ_FILE_TOOL) + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nShow setup.py<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.py"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nimport setuptools\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_tools_call_result_no_thinking(tok):
    messages = [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Show setup.py"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": {"path": "setup.py"}}}]},
        {"role": "tool", "content": "import setuptools"},
    ]
    text = tok.apply_chat_template(messages, tools=[READ_FILE_TOOL], enable_thinking=False)
    assert text == RENDERED_TOOL_CHAT
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_plain(tok):
    msgs = [{"role": "user", "content": "Write Python code."}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nWrite Python code.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_chat_template_tojson_keeps_non_ascii_and_key_order(tok):
    tool = {"type": "function", "function": {"name": "grüß", "description": "日本", "parameters": {"z": 1, "a": 2}}}
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[tool])
    assert json.dumps(tool, ensure_ascii=False) in text


def test_chat_template_errors_are_value_errors(tok):
    t = Tokenizer(tok._tok, {"chat_template": "{{ raise_exception('no system role') }}"}, [])
    with pytest.raises(ChatTemplateError, match="no system role"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_templates_and_helpers(tok):
    cfg = {"chat_template": [
        {"name": "default", "template": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                                        "{{ m.content }}{% endfor %}|{{ strftime_now('%Y')|length }}"},
        {"name": "tool_use", "template": "tools:{{ tools|length }}{% generation %}!{% endgeneration %}"}],
        "eos_token": {"content": "<|im_end|>"}}
    t = Tokenizer(tok._tok, cfg, [])
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert t.apply_chat_template(msgs) == "a|4"
    assert t.apply_chat_template(msgs, tools=[READ_FILE_TOOL]) == "tools:1!"
    assert t.stop_token_ids == {2}


def test_stop_token_ids(tok):
    assert tok.stop_token_ids == {2, 0}
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None


@pytest.mark.parametrize("model", ["packaged", "random"])
def test_vocab_fits_the_model(tok, tmp_path, model):
    """The models that use this vocabulary have an embedding row for every token."""
    d = packaged_demo_dir() if model == "packaged" else write_random_model(tmp_path / "rand")
    assert Tokenizer.from_dir(d).vocab_size == tok.vocab_size == 4000 <= read_model_config(d).vocab_size


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40))
def test_streaming_any_text(tok, text):
    ids = tok.encode(text)
    parts = stream(tok, ids)
    assert "".join(parts) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in parts) or "\ufffd" in text


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 3999), max_size=30))
def test_streaming_arbitrary_ids(tok, ids):
    # a random-weight model emits arbitrary ids, invalid UTF-8 included: the stream still adds up
    assert "".join(stream(tok, ids)) == tok.decode(ids)
