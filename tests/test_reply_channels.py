"""The terminal commands' view of a reply (freetoken/commands/channels.py): a harmony model's
analysis, tool calls and final message shown apart and kept apart in the chat history; any other
model's text as it is; the chat history keeps the final text. Then `generate --chat` on a gpt-oss
model through the CLI."""
import io
import subprocess
import sys
from types import SimpleNamespace

from freetoken.commands.channels import ReplyText
from freetoken.engine.request import SamplingParams

HARMONY = ["<|channel|>analysis<|message|>Two and", " two.<|end|><|start|>assistant", "<|channel|>final<|message|>4",
           "<|return|>"]


def llm(harmony: bool):
    return SimpleNamespace(tokenizer=SimpleNamespace(speaks_harmony=harmony))


def shown(harmony: bool, pieces: list[str], chat: bool = True) -> tuple[str, ReplyText]:
    out = io.StringIO()
    reply = ReplyText(llm(harmony), out, chat=chat)
    for piece in pieces:
        reply.write(piece)
    reply.finish()
    return out.getvalue(), reply


def test_harmony_channels_are_shown_and_kept_apart():
    text, reply = shown(True, HARMONY)
    assert text == "[analysis] Two and two.\n4"
    assert reply.message() == {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
    assert reply.params(SamplingParams()).skip_special_tokens is False


def test_a_harmony_tool_call_is_shown_on_its_own_line():
    text, reply = shown(True, ["<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>",
                               '{"path": "a.txt"}<|call|>'])
    assert text == '[call read_file {"path": "a.txt"}]' and reply.calls[0].name == "read_file"


def test_other_models_and_raw_prompts_pass_through():
    text, reply = shown(False, ["<think>x</think>", "hello"])
    assert text == "<think>x</think>hello" and reply.message()["content"] == text
    assert reply.params(SamplingParams()).skip_special_tokens is True
    assert shown(True, ["a", "b"], chat=False)[0] == "ab"


def test_generate_chat_on_the_builtin_gpt_oss_shows_no_markup():
    run = subprocess.run([sys.executable, "-m", "freetoken", "generate", "--model", "demo-oss", "--chat", "say hi",
                          "--max-tokens", "40", "--temperature", "0"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() and "<|" not in run.stdout and "final" not in run.stdout, run.stdout


class ScriptedLLM:
    """What ChatSession uses of an LLM: a harmony tokenizer, the prompts it was given, a scripted reply."""
    tokenizer = SimpleNamespace(speaks_harmony=True)
    last_output = SimpleNamespace(metrics={"generated_tokens": 4, "decode_tok_s": 1.0}, finish_reason="stop")

    def __init__(self):
        self.prompts = []

    def chat_prompt(self, messages, **kwargs):
        self.prompts.append([dict(m) for m in messages])
        return [1]

    def stream(self, prompt, params):
        assert params.skip_special_tokens is False
        yield from HARMONY


def test_the_chat_history_keeps_the_final_text_and_the_analysis_apart():
    from freetoken.commands.chat import ChatSession
    llm, out = ScriptedLLM(), io.StringIO()
    session = ChatSession(llm, SamplingParams(), None, {}, out=out)
    session.turn("what is 2 + 2?")
    session.turn("thanks")
    assert llm.prompts[1][1] == {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
    assert "[analysis] Two and two.\n4\n" in out.getvalue()
