"""The llguidance tokenizer is built at engine start-up on a thread (it holds the GIL for about a
second on a 152k vocabulary, so building it at the first constrained request stalled every
stream), with one log line saying whether constrained decoding is on. The server-side check (the
line in `serve`'s log, a constrained request right after start-up) is in
tests/server/test_structured_output.py."""
import logging
import threading
from types import SimpleNamespace

import pytest

from freetoken import grammar
from freetoken.engine.core import EngineCore


@pytest.fixture(scope="module")
def demo_tokenizer():
    from freetoken.models.demo import packaged_demo_dir
    from freetoken.tokenizer import Tokenizer
    return Tokenizer.from_dir(packaged_demo_dir())


class Lines:
    """A logger stand-in that keeps (level, message)."""

    def __init__(self):
        self.lines = []

    def info(self, msg, *args):
        self.lines.append(("info", msg % args))

    def warning(self, msg, *args):
        self.lines.append(("warning", msg % args))


def test_without_the_extra_start_up_says_off(monkeypatch, caplog, demo_tokenizer):
    def missing():
        raise grammar.GrammarUnavailable("not installed")
    monkeypatch.setattr(grammar, "_llg", missing)
    core = SimpleNamespace(tokenizer=demo_tokenizer, model_config=SimpleNamespace(vocab_size=4096))
    with caplog.at_level(logging.INFO, logger="freetoken"):
        assert EngineCore._start_grammars(core) is None
    assert [r.getMessage() for r in caplog.records] == [
        "constrained decoding: off (llguidance is not installed; pip install 'freetoken[grammar]' enforces "
        "JSON output formats and forced tool choices)"]


def test_background_build_logs_once_and_the_thread_ends(demo_tokenizer):
    g, log = grammar.Grammars(demo_tokenizer.to_json(), 4096, demo_tokenizer.stop_token_ids), Lines()
    g.build_in_background(log)
    g.join()
    assert not any(t.name == "freetoken-grammar" for t in threading.enumerate())
    [(level, line)] = log.lines
    assert level == "info" and line.startswith(f"constrained decoding: on (llguidance {grammar.version()}, "
                                               "tokenizer of 4096 ids built in ") and line.endswith(" s)")
    m = g.matcher(grammar.json_grammar())
    assert m.consume(demo_tokenizer.encode("{")[0])
    g.join()                                                         # idempotent


def test_a_tokenizer_llguidance_cannot_read_is_off_once(demo_tokenizer):
    g, log = grammar.Grammars("{}", 4096, [0]), Lines()
    g.build_in_background(log)
    g.join()
    [(level, line)] = log.lines
    assert level == "warning" and line.startswith("constrained decoding is off: llguidance cannot read")
    for _ in range(2):                                               # remembered, not rebuilt
        with pytest.raises(grammar.GrammarUnavailable, match="cannot read this tokenizer"):
            g.matcher(grammar.json_grammar())


def test_the_tool_call_grammar_of_real_harness_tools_compiles(demo_tokenizer):
    """Claude Code's and Codex CLI's own tool lists (captured traffic) compile as a tool-call
    grammar (tool_choice "required" / "any"): keywords llguidance lacks (propertyNames) are
    ignored, not fatal."""
    import json
    from pathlib import Path
    grammars = grammar.Grammars(demo_tokenizer.to_json(), 4096, demo_tokenizer.stop_token_ids)
    grammars.build_in_background(Lines())
    grammars.join()
    for capture in ("claude-1", "codex-1"):
        path = Path(__file__).resolve().parents[1] / "server" / "fixtures" / "harnesses" / f"{capture}.json"
        tools = [{"type": "function", "function": {"name": t["name"], "parameters": t.get("input_schema") or
                                                   t.get("parameters")}}
                 for t in json.loads(path.read_text())["body"]["tools"] if t.get("name")]
        grammars.matcher(grammar.tool_call_grammar(tools))        # raises GrammarError if not
