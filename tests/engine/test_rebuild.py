"""Elastic cache rebuild on the CPU path: resize, validation, rollback, busy rejection."""
import logging

import pytest

from freetoken import LLM, SamplingParams
from freetoken.engine.rebuild import RebuildRejected
from freetoken.engine.request import EngineBusy

PROMPT = "def parse(self, text):\n    "


@pytest.fixture(scope="module")
def llm():
    return LLM(backend="cpu", moe_backend="hybrid", moe_cache_rate=0.5, moe_fetch_fraction=0.5)


def test_resize_keeps_output_and_resets_counters(llm):
    params = SamplingParams(max_tokens=12)
    before = llm.generate(PROMPT, params)[0].token_ids
    status = llm.core.rebuild_cache(moe_cache_size=20, num_kv_tokens=1000)
    assert status["moe"]["slots"] == 20 and status["kv"]["num_tokens"] == 1000
    assert llm.stats()["moe"]["total"]["hits"] == 0                 # cold cache, zeroed counters
    assert status["kv"]["prefix_cached_tokens"] == 0                # new KV pool: tree dropped
    assert llm.generate(PROMPT, params)[0].token_ids == before
    # the flags as the user gave them: neither start-up nor the resize wrote sizes back into them
    assert llm.core.config is llm.config and llm.config.moe_cache_size is None and llm.config.num_kv_tokens is None
    assert status["plan"]["expert_slots"] == 20 and status["plan"]["kv_tokens"] == 1000


def test_a_rebuild_sizes_the_expert_cache_once(llm):
    """The resize is planned once: the changed decision (here the cap at Lm*E = 64) is logged once,
    with why, then the rebuild's own line."""
    lines, log = [], logging.getLogger("freetoken")

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    handler, level = Keep(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        assert llm.core.rebuild_cache(moe_cache_size=100)["moe"]["slots"] == 64
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert lines == ["plan: expert cache 64 (moe_cache_size; 100 asked, 64 (= Lm*E) are enough)",
                     f"cache rebuilt: expert cache 64 slots, KV pool {llm.core.kv.num_slots} tokens"], lines


def test_invalid_geometry_changes_nothing(llm):
    status = llm.core.cache_status()
    for bad in [dict(moe_cache_size=-3), dict(moe_cache_size=0), dict(num_kv_tokens=1), {}]:
        with pytest.raises(RebuildRejected):
            llm.core.rebuild_cache(**bad)
    assert llm.core.cache_status() == status


def test_hybrid_rebuilds_to_any_cache_size():
    """Three slots for 4 layers x 16 experts, top-4: fewer than one step routes; hybrid still runs
    and gives the same tokens (the rest of each step's misses run on the CPU)."""
    llm = LLM(backend="cpu", moe_backend="hybrid", moe_cache_rate=0.5, moe_fetch_fraction=0.5)
    params = SamplingParams(max_tokens=12)
    before = llm.generate(PROMPT, params)[0].token_ids
    assert llm.core.rebuild_cache(moe_cache_size=3)["moe"]["slots"] == 3
    assert llm.generate(PROMPT, params)[0].token_ids == before
    total = llm.stats()["moe"]["total"]
    assert total["cpu_execs"] > 0 and total["fills"] + total["cpu_execs"] == total["misses"]


def test_offload_rebuild_below_one_step_is_rejected():
    """A running offload runtime cannot become hybrid: below one step's need (16 here) the rebuild
    is refused with both ways out named (docs/moe.md, "Any cache size"), and nothing changes."""
    llm = LLM(backend="cpu", moe_backend="offload", moe_cache_size=16)
    status = llm.core.cache_status()
    with pytest.raises(RebuildRejected, match=r"offload needs at least 16 .*--moe-backend hybrid"):
        llm.core.rebuild_cache(moe_cache_size=3)
    assert llm.core.cache_status() == status and status["moe"]["backend"] == "offload"


def test_rejected_while_busy(llm):
    req = llm.core.add_request(llm.tokenizer.encode(PROMPT), SamplingParams(max_tokens=4))
    with pytest.raises(EngineBusy):
        llm.core.rebuild_cache(num_kv_tokens=500)
    llm.core.abort(req)
    assert not llm.core.has_work()


def test_fused_backend_has_no_expert_cache():
    with pytest.raises(RebuildRejected, match="no expert cache"):
        LLM(backend="cpu", moe_backend="fused").core.rebuild_cache(moe_cache_size=32)
