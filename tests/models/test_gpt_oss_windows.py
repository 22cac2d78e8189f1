"""gpt-oss's sliding layers keep their KV as per-request state (engine/window_pool.py): a ring of
W + piece positions per request, written and read in pieces, checkpointed at agent edit points
and restored when a request reuses a cached prefix. The fixture (tests/fixtures/hf/gpt_oss/) has
a window of 6 on layers 0 and 2, so a chunk of 5 makes a ring of 11 that the 44 tokens of
prompt and greedy output wrap four times."""
import numpy as np
import pytest

from freetoken import LLM, SamplingParams
from freetoken.engine.window_pool import PIECE, WindowPool

from tests.models.test_gpt_oss_parity import FIXTURE, run
from tests.models.test_hf_parity import assert_fp32_parity, teacher_forced_logits

EXACT = dict(cpu_dots="f32", kv_dtype="float32")


def filled_pool(rows=3, window=4, piece=3, length=20):
    """A pool whose row 1 holds positions 0..length-1 written one by one (value = position + 1),
    checked after each write: every position inside the window reads its own value."""
    pool = WindowPool(2, rows, window, piece, 1, 2, np.float32, context=40)
    row = np.array([1], np.int32)
    for p in range(length):
        at = pool.slots(row, np.zeros(1, np.int32), np.array([p], np.int32))
        pool.k[:, at] = p + 1
        pool.v[:, at] = -(p + 1)
        table = pool.table(row, p + 1)[0]
        got = pool.k[0, table[max(0, p - window + 1):p + 1], 0, 0]
        np.testing.assert_array_equal(got, np.arange(max(0, p - window + 1), p + 1) + 1)
    return pool


def test_the_ring_serves_every_position_of_a_window_and_a_checkpoint_moves_it_to_another_row():
    pool = filled_pool()
    assert pool.ring == 7 and pool.k.shape == (2, 3 * 7, 1, 2)
    parts = pool.read(1, 20)                       # the 4 positions before 20
    assert parts["k"].shape == pool.checkpoint_parts()["k"][0] == (2, 4, 1, 2)
    np.testing.assert_array_equal(parts["k"][0, :, 0, 0], [17, 18, 19, 20])
    ring = pool.k[1][7:14]                         # layer 1's ring of row 1, as the model's sink gets it
    np.testing.assert_array_equal(pool.capture("k", 1, ring, 20), parts["k"][1])
    pool.write(2, 20, {name: a.copy() for name, a in parts.items()})
    table = pool.table(np.array([2], np.int32), 20)[0]
    np.testing.assert_array_equal(pool.v[1, table[16:20], 0, 1], [-17, -18, -19, -20])


def test_a_checkpoint_before_the_window_fills_keeps_the_positions_there_are():
    pool = filled_pool(length=3)
    pool.write(0, 3, pool.read(1, 3))
    table = pool.table(np.array([0], np.int32), 3)[0]
    np.testing.assert_array_equal(pool.k[0, table, 0, 0], [1, 2, 3])


@pytest.mark.parametrize("backend", ["ref", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pieces_and_a_wrapping_ring_keep_transformers_logits_and_tokens(backend):
    """One forward over all 43 positions in pieces of 5 (teacher forced), then prefill in chunks of
    5 and decode, each over rings of 11 positions."""
    llm, exp, logits = run("fp32", backend, chunked_prefill_size=5, **EXACT)
    assert (llm.core.states.ring, llm.core.states.piece) == (11, 5)
    assert_fp32_parity(llm, exp, logits)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_tiled_prefill_reads_a_wrapped_ring(backend):
    """150 tokens in pieces of 32 (the cpu's tiled GEMMs from 32 tokens, cuda's prefill tiles)
    over rings of 38 positions, against ref over one ring that never wraps."""
    ids = np.random.default_rng(3).integers(10, 4000, 150)
    want = teacher_forced_logits(LLM(str(FIXTURE / "fp32"), backend="ref", **EXACT), ids)
    llm = LLM(str(FIXTURE / "fp32"), backend=backend, chunked_prefill_size=32, **EXACT)
    assert llm.core.states.ring == 38
    np.testing.assert_allclose(teacher_forced_logits(llm, ids), want, atol=2e-4, rtol=0)


def test_the_kv_pool_holds_the_full_layers_and_a_request_its_rings():
    core = LLM(str(FIXTURE / "fp32"), backend="cpu", max_running_requests=3, kv_dtype="bfloat16").core
    cfg = core.model_config
    assert cfg.sliding_layers == (0, 2) and cfg.attention_layers == (1, 3)
    assert core.kv.k.shape[0] == 2 and core.plan.state_rows == 3
    assert core.states.ring == 6 + PIECE and core.states.bytes == 3 * WindowPool.bytes_per_row(cfg, 8192, 2)
    assert core.states.num_free == 3                 # the warm-up's row came back


def generate(llm, prompts, n=6):
    params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)
    return [llm.generate([p], params)[0] for p in prompts]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_cached_prefix_resumes_at_a_window_checkpoint(backend):
    """Checkpoints every 8 prompt tokens and at a request's end: a prompt sharing 35 tokens of an
    earlier one resumes at 32, the next turn of a conversation at the earlier one's end; each
    writes what a run without a prefix cache writes."""
    rng = np.random.default_rng(5)
    first = rng.integers(10, 4000, 40).tolist()
    kw = dict(backend=backend, state_checkpoint_interval=8, chunked_prefill_size=16, **EXACT)
    cached = LLM(str(FIXTURE / "fp32"), **kw)
    plain = LLM(str(FIXTURE / "fp32"), enable_prefix_cache=False, **kw)
    out = generate(cached, [first])[0]
    shared = first[:35] + rng.integers(10, 4000, 9).tolist()
    turn = first + out.token_ids + rng.integers(10, 4000, 7).tolist()
    got = generate(cached, [shared, turn])
    counters = cached.core.checkpoints.counters
    assert counters.hits == 2 and counters.reused_tokens == 32 + 45, counters
    for want, have in zip(generate(plain, [shared, turn]), got):
        assert have.token_ids == want.token_ids
        np.testing.assert_allclose([lp.logprob for lp in have.logprobs], [lp.logprob for lp in want.logprobs],
                                   atol=1e-4)


def test_the_plan_counts_the_full_layers_per_token_and_the_rings_per_request():
    """gpt-oss-20b on a 24 GB GPU at 128k of context: a token costs the 12 full layers' KV (it
    cost all 24 before), a running request its rings (15 MiB in bf16), a checkpoint 3 MiB."""
    from dataclasses import replace
    from freetoken.config import EngineConfig
    from freetoken.engine.plan import make_plan
    from freetoken.engine.plan_memory import checkpoint_bytes, kv_bytes_per_token
    from freetoken.models.hf_config import model_config_from_dict
    from freetoken.models.synth_gpt_oss import PRESETS
    from tests.models.test_gpt_oss_parity import GPU
    cfg = model_config_from_dict(PRESETS["gpt-oss-20b"].hf_config())
    assert kv_bytes_per_token(cfg, 2) == 2 * 12 * 8 * 64 * 2
    assert WindowPool.bytes_per_row(cfg, 8192, 2) == 2 * 12 * (128 + 512) * 8 * 64 * 2      # 15 MiB
    assert checkpoint_bytes(cfg, 2) == 3 << 20
    config = EngineConfig(model="synth:gpt-oss-20b", max_model_len=131072, max_running_requests=4, kv_dtype="bfloat16")
    plan = make_plan(cfg, config, replace(GPU, free_device_bytes=24 << 30))
    assert plan.state_rows == 4 and plan.memory.state_bytes == 4 * WindowPool.bytes_per_row(cfg, 8192, 2)
    assert plan.prefix_cache and plan.checkpoint_host_bytes >= checkpoint_bytes(cfg, 2)


# docs/performance.md's table: (preset, context) -> (KV tokens, expert-cache slots) on a 24 GB GPU
PLAN_TABLE = {("gpt-oss-20b", 32768): (131072, 291), ("gpt-oss-20b", 131072): (180376, 267),
              ("gpt-oss-120b", 32768): (115523, 256), ("gpt-oss-120b", 131072): (131072, 245)}


@pytest.mark.parametrize("preset,context", list(PLAN_TABLE))
def test_the_memory_table_in_performance_md(preset, context):
    from dataclasses import replace
    from freetoken.config import EngineConfig
    from freetoken.engine.plan import make_plan
    from freetoken.models.hf_config import model_config_from_dict
    from freetoken.models.synth_gpt_oss import PRESETS
    from tests.models.test_gpt_oss_parity import GPU
    cfg = model_config_from_dict(PRESETS[preset].hf_config())
    config = EngineConfig(model="synth:" + preset, max_model_len=context, max_running_requests=4, kv_dtype="bfloat16")
    plan = make_plan(cfg, config, replace(GPU, free_device_bytes=24 << 30))
    assert (plan.kv_tokens, plan.moe.slots) == PLAN_TABLE[preset, context]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_concurrent_requests_aborts_and_a_kv_resize_leave_no_row_behind(backend):
    """Five prompts sharing prefixes on three rows, in one batch (prefill chunks holding several
    requests, decode steps of three): each writes what it writes alone without a prefix cache.
    Then an aborted request and a KV-pool resize: every row is free again, the tree is consistent,
    and the engine still answers as before. cuda: decode batches of 1 to 3 replay CUDA graphs."""
    rng = np.random.default_rng(7)
    base = rng.integers(10, 4000, 30).tolist()
    prompts = [base[:n] + rng.integers(10, 4000, m).tolist() for n, m in ((30, 5), (25, 9), (30, 1), (12, 20), (0, 17))]
    kw = dict(backend=backend, state_checkpoint_interval=8, chunked_prefill_size=24, max_running_requests=3, **EXACT)
    cached, plain = LLM(str(FIXTURE / "fp32"), **kw), LLM(str(FIXTURE / "fp32"), enable_prefix_cache=False, **kw)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    generate(cached, [base])                               # its checkpoints, for the batch to resume from
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in cached.generate(prompts, params)] == want
    core = cached.core
    assert core.checkpoints.counters.hits >= 3
    req = core.add_request(prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
    core.step()
    core.abort(req)
    assert core.states.num_free == 3
    core.rebuild_cache(num_kv_tokens=core.kv.num_slots // 2)
    assert core.states.num_free == 3 and core.prefix_cache.size == 0 and len(core.checkpoints) == 0
    assert [o.token_ids for o in cached.generate(prompts[:2], params)] == want[:2]


def test_without_checkpoint_memory_the_prefix_cache_is_off_and_says_why():
    """A cached prefix carries no sliding KV: with --state-checkpoint-mb 0 there is nothing to resume
    from, so the plan turns the prefix cache off and its decision says why; requests still run."""
    llm = LLM(str(FIXTURE / "fp32"), backend="cpu", state_checkpoint_mb=0)
    (prefix,) = [d for d in llm.core.plan.decisions if d.name == "prefix cache"]
    assert prefix.value == "off" and "sliding-window model" in prefix.why and llm.core.prefix_cache is None
    assert len(generate(llm, [[5, 6, 7]], n=3)[0].token_ids) == 3 and llm.core.states.num_free == llm.core.states.rows
