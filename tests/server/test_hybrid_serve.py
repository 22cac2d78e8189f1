"""A Gated DeltaNet hybrid checkpoint as shipped on the hub, through the CLI and the server: the
Qwen3-Next fixture (tests/fixtures/hf/qwen3next) with `generate --model DIR` and `serve --model
DIR` answering the openai SDK with the tokens transformers' greedy decoding gives."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from server_helpers import ServerProcess

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen3next" / "fp32"


@pytest.fixture(scope="module")
def expected():
    return np.load(FIXTURE / "expected.npz")


def test_generate_cli_prints_transformers_greedy_text(expected, demo_tokenizer):
    want = demo_tokenizer.decode(expected["greedy_ids"][:12].tolist())
    r = subprocess.run([sys.executable, "-m", "freetoken", "generate", "--model", str(FIXTURE), "--backend", "cpu",
                        "--prompt", str(expected["prompt_text"]), "--max-tokens", "12", "--ignore-eos"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(want.rstrip()[:20]), (r.stdout, want)
    assert "checkpoints (host)" in r.stderr and "recurrent-state pool" in r.stderr


def test_serve_answers_through_the_sdk(expected, demo_tokenizer):
    proc = ServerProcess("--model", str(FIXTURE), "--backend", "cpu")
    try:
        oa = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        ids = expected["prompt_ids"].tolist()
        r = oa.completions.create(model="fp32", prompt=ids, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
        assert r.choices[0].text == demo_tokenizer.decode(expected["greedy_ids"][:8].tolist())
        card = oa.models.list().data[0]
        assert card.id == "fp32"
        chat = oa.chat.completions.create(model="fp32", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].finish_reason in ("stop", "length")
    finally:
        log = "".join(proc.stderr_lines)
        assert proc.stop() == 0, log[-3000:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_a_second_turn_reuses_a_checkpoint_and_the_counters_say_so(demo_tokenizer):
    """Two chat turns through the SDK: the second reports cached prompt tokens, and the cache
    status and /metrics show checkpoints taken and hit."""
    import httpx
    proc = ServerProcess("--model", str(FIXTURE), "--backend", "cpu", "--max-model-len", "1024")
    try:
        oa = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        turn = [{"role": "user", "content": "Write a function that adds two numbers."}]
        first = oa.chat.completions.create(model="fp32", messages=turn, max_tokens=6, temperature=0)
        turn += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Now make it subtract."}]
        second = oa.chat.completions.create(model="fp32", messages=turn, max_tokens=6, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        status = httpx.get(proc.url + "/v1/cache/status").json()
        ck = status["state_checkpoints"]
        assert ck["hits"] >= 1 and ck["taken"] >= ck["checkpoints"] > 0 and ck["tiers"]["device"]["budget_bytes"] == 0
        metrics = httpx.get(proc.url + "/metrics").text
        hits = [l for l in metrics.splitlines() if l.startswith("freetoken_state_checkpoints_hits_total ")]
        assert hits and float(hits[0].split()[1]) >= 1, metrics[-2000:]
        host = [l for l in metrics.splitlines() if l.startswith('freetoken_state_checkpoint_bytes{tier="host"} ')]
        assert host and float(host[0].split()[1]) == ck["tiers"]["host"]["bytes"] > 0, metrics[-2000:]
    finally:
        assert proc.stop() == 0
