"""The Gated DeltaNet hybrid through the engine on synth:tiny-hybrid (Qwen3.5-MoE geometry, random
weights): every MoE backend gives the same greedy tokens, batching and chunked prefill change
nothing, recurrent-state rows are held while running and freed after, state checkpoints are on
by default (off with --state-checkpoint-mb 0, one log line), and the registry's errors name what
is supported."""
import logging

import pytest

from freetoken import LLM, SamplingParams
from freetoken.config import ConfigError
from freetoken.models.hf_config import model_config_from_dict

SYNTH = "synth:tiny-hybrid"
PROMPTS = ["def fibonacci(n):\n    return", "import os\nimport sys\n"]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
MOE = {"fused": dict(moe_backend="fused"), "cpu": dict(moe_backend="cpu"),
       "offload": dict(moe_backend="offload", moe_cache_rate=0.5),
       "hybrid": dict(moe_backend="hybrid", moe_cache_rate=0.5, moe_fetch_fraction=0.3)}


def run(**options):
    llm = LLM(SYNTH, backend=options.pop("backend", "cpu"), **options)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        states = llm.core.states
        assert states.num_free == states.rows               # every row back after the requests
        return [o.token_ids for o in outs], llm.stats()["moe"]["total"]
    finally:
        llm.core.close()


@pytest.fixture(scope="module")
def expected():
    return run(moe_backend="cpu")


@pytest.mark.parametrize("moe", [m for m in MOE if m != "cpu"])
def test_every_moe_backend_gives_the_same_tokens(moe, expected):
    ids, total = run(**MOE[moe])
    assert ids == expected[0]
    if moe == "hybrid":
        assert total["fills"] > 0 and total["cpu_execs"] > 0


def test_ref_backend_agrees(expected):
    assert run(backend="ref", moe_backend="fused")[0] == expected[0]


def test_batching_and_chunked_prefill_change_nothing(expected):
    assert run(moe_backend="cpu", max_running_requests=1)[0] == expected[0]     # one at a time
    assert run(moe_backend="cpu", chunked_prefill_size=3)[0] == expected[0]


def test_checkpoints_are_on_by_default_and_off_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="freetoken"):
        llm = LLM(SYNTH, backend="cpu", moe_backend="fused")
    assert llm.core.prefix_cache is not None and llm.core.checkpoints is not None
    assert any("checkpoints (host)" in r.getMessage() for r in caplog.records)       # the plan summary
    assert any("recurrent-state pool" in r.getMessage() for r in caplog.records)
    llm.core.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="freetoken"):
        llm = LLM(SYNTH, backend="cpu", moe_backend="fused", state_checkpoint_mb=0)
    assert llm.core.prefix_cache is None
    assert sum("prefix cache        off" in r.getMessage() and "--state-checkpoint-mb is 0" in r.getMessage()
               for r in caplog.records) == 1
    llm.core.close()


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ConfigError, match="Qwen3NextForCausalLM") as e:
        model_config_from_dict({"architectures": ["LlamaForCausalLM"]})
    assert "LlamaForCausalLM" in str(e.value) and "Qwen3_5MoeForConditionalGeneration" in str(e.value)
