"""<think> splitting: reasoning vs content, whole and streamed in any cut."""
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.server.generation import opens_think
from freetoken.server.reasoning import ReasoningSplitter


def split(text: str, cuts=(), inside=False) -> tuple[str, str]:
    s, out, at = ReasoningSplitter(inside), [], 0
    for cut in sorted(cuts) + [len(text)]:
        out += s.feed(text[at:cut])
        at = cut
    out += s.finish()
    return ("".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content"))


def test_think_block_then_answer():
    assert split("<think>\nstep 1\nstep 2\n</think>\n\nThe answer.") == ("step 1\nstep 2", "The answer.")


def test_no_think_block_is_all_content():
    assert split("def f():\n    pass\n") == ("", "def f():\n    pass\n")
    assert split("  text with <think> inside") == ("", "  text with <think> inside")


def test_prompt_opened_think():
    assert split("reasoning here</think>answer", inside=True) == ("reasoning here", "answer")


def test_unclosed_think_is_reasoning():
    assert split("<think>still thinking  ") == ("still thinking", "")


def test_empty_think_block():
    assert split("<think>\n\n</think>\n\nhi") == ("", "hi")


def test_opens_think():
    assert opens_think("<|im_start|>assistant\n<think>\n")
    assert not opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_think("<|im_start|>assistant\n")


SAMPLES = ["<think>\nA < B and </thin k\n</think>\n\nC", "  <think>x</think>y", "<thi", "<think>",
           "plain </think> text", "\n\n<think>a\n\nb\n</think>"]


@settings(max_examples=150, deadline=None)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 60), max_size=10), inside=st.booleans())
def test_streaming_matches_whole(sample, cuts, inside):
    cuts = [c for c in cuts if c <= len(sample)]
    assert split(sample, cuts, inside) == split(sample, (), inside)
