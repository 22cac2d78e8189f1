"""The built-in models' training corpus (tools/agent_corpus.py, tools/train_demo.py: dev-time code,
no torch needed here): the live launch tests' first words never appear in it, and the loss weights
put copy_weight on the answer's copied tokens only."""
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import agent_corpus  # noqa: E402
import train_demo  # noqa: E402


@pytest.fixture(scope="module")
def files():
    return agent_corpus.Files(random.Random(0), agent_corpus.stdlib_files())


def test_no_note_word_is_held_out(files):
    assert not set(agent_corpus.HELD_OUT_WORDS) & set(files.words)
    drawn = {files.word() for _ in range(20_000)}
    assert not set(agent_corpus.HELD_OUT_WORDS) & drawn
    rng = random.Random(1)
    pseudo = {agent_corpus.pseudo_word(rng) for _ in range(20_000)}
    assert len(pseudo) > 10_000 and not set(agent_corpus.HELD_OUT_WORDS) & pseudo
    assert "window" in files.pieces                     # one token: drawn alone, it would be the word
    joined = {agent_corpus.piece_word(rng, files.pieces) for _ in range(20_000)}
    assert len(joined) > 10_000 and not set(agent_corpus.HELD_OUT_WORDS) & joined


def test_copied_tokens_weigh_copy_weight_and_fences_do_not():
    tok = train_demo.tokenizer()
    messages = [{"role": "user", "content": "Read notes.txt"},
                {"role": "assistant", "content": "x.py\n```\nimport os\n```\nThe first word is `tunnel`."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    ids, weights = train_demo.masked(tok, text, copy_weight=4.0)
    assert ids == tok.encode(text)
    heavy = "".join(tok.decode([i]) for i, w in zip(ids, weights) if w == 4.0)
    assert heavy == "tunnel"
    light = tok.decode([i for i, w in zip(ids, weights) if w == 1.0])
    assert "import os" in light and "Read notes.txt" not in light
    assert set(weights) == {0.0, 1.0, 4.0}
