"""Recurrent-state checkpoints of a hybrid at semantic anchors (engine/checkpoints.py, anchors.py,
resume.py) on the Qwen3.5-MoE fixture: resuming gives the uninterrupted run's tokens and logprobs,
an edit in the middle of a conversation resumes from the anchor just before it, a tight budget and
aborts never leave a dangling link or a leaked slot, and anchors sit where the template's markers
are (also for markers that tokenize to several tokens)."""
from pathlib import Path

import numpy as np
import pytest

from freetoken import LLM, SamplingParams
from freetoken.engine.anchors import Anchors

# the fixture was trained for 256 positions; these conversations run past that (a WARN, no harm to a test)
FIXTURE = str(Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen35moe_text" / "fp32")
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)


def conversation(turns: int, think: bool = True) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Step {i}: read file_{i}.py and fix the bug."})
        msgs.append({"role": "assistant", "content": f"Reading file_{i}.py now.",
                     **({"reasoning_content": f"I should open file_{i}.py first."} if think else {}),
                     "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": {"path": f"file_{i}.py"}}}]})
        msgs.append({"role": "tool", "content": f"def f_{i}(x):\n    return x + {i}\n" * 3})
    return msgs


@pytest.fixture(scope="module")
def engines():
    cached = LLM(FIXTURE, backend="cpu", moe_backend="fused", state_checkpoint_interval=0, max_model_len=2048)
    plain = LLM(FIXTURE, backend="cpu", moe_backend="fused", enable_prefix_cache=False, max_model_len=2048)
    yield cached, plain
    cached.core.close()
    plain.core.close()


def run(llm, ids, params=PARAMS):
    req = llm.core.add_request(ids, params)
    while req.finish_reason is None:
        llm.core.step()
    return req


def check_tree(llm):
    """No dangling link either way, budget kept, every KV slot and state row accounted for."""
    core = llm.core
    tree, pool = core.prefix_cache, core.checkpoints
    tree.check()
    linked, stack = [], [tree.root]
    while stack:
        node = stack.pop()
        if node.checkpoint is not None:
            assert node.checkpoint.node is node
            linked.append(node.checkpoint)
        stack.extend(node.children.values())
    assert sorted(map(id, linked)) == sorted(map(id, pool.linked())) and pool.bytes == sum(c.nbytes for c in linked)
    assert pool.bytes <= pool.budget
    c = pool.counters
    assert c.taken == len(pool) + c.evicted + c.dropped     # each one taken is live, evicted or dropped
    assert core.kv.num_free + tree.size == core.kv.num_slots and tree.protected_size == 0
    assert core.states.num_free == core.states.rows


def test_a_follow_up_turn_resumes_and_matches_the_uninterrupted_run(engines):
    cached, plain = engines
    first = cached.chat_prompt(conversation(2))
    run(cached, first)
    follow = cached.chat_prompt(conversation(3))
    req = run(cached, follow)
    want = run(plain, follow)
    assert req.num_cached > len(first) // 2 and req.output_ids == want.output_ids
    np.testing.assert_allclose([lp.logprob for lp in req.output_logprobs],
                               [lp.logprob for lp in want.output_logprobs], atol=1e-4)
    assert cached.core.checkpoints.counters.hits >= 1
    check_tree(cached)


def test_an_edit_in_the_middle_resumes_from_the_anchor_before_it(engines):
    cached, plain = engines
    msgs = conversation(4, think=False)
    run(cached, cached.chat_prompt(msgs))
    edited = [dict(m) for m in msgs]
    edited[6]["content"] = "[old tool output removed]"          # the second tool result
    ids = cached.chat_prompt(edited)
    original = cached.chat_prompt(msgs)
    diverge = next(i for i, (a, b) in enumerate(zip(ids, original)) if a != b)
    anchors = cached.core.scheduler.recurrent.anchors.positions(ids)
    before = max(p for p in anchors if p <= diverge)
    req = run(cached, ids)
    assert req.num_cached == before                      # the deepest anchor before the edit
    assert req.output_ids == run(plain, ids).output_ids
    check_tree(cached)


def test_a_tight_budget_and_aborts_leave_nothing_dangling():
    llm = LLM(FIXTURE, backend="cpu", moe_backend="fused", state_checkpoint_interval=7, max_model_len=2048)
    pool = llm.core.checkpoints
    pool.tiers["host"].budget = 3 * (llm.core.states.conv[:, 0].nbytes + llm.core.states.rule[:, 0].nbytes)
    rng = np.random.default_rng(0)
    try:
        for i in range(12):
            ids = llm.chat_prompt(conversation(int(rng.integers(1, 4)), think=bool(i % 2)))
            req = llm.core.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True))
            for _ in range(int(rng.integers(1, 6))):
                llm.core.step()
            if req.finish_reason is None and i % 3 == 0:
                llm.core.abort(req)
            while llm.core.has_work():
                llm.core.step()
            check_tree(llm)
        c = pool.counters
        assert c.evicted > 0 and c.hits > 0 and len(pool) <= 3
        assert c.taken >= len(pool) + c.evicted
    finally:
        llm.core.close()


def test_anchor_positions_on_the_rendered_template(engines):
    cached, _ = engines
    tok = cached.tokenizer
    ids = cached.chat_prompt(conversation(2))
    anchors = Anchors.for_tokenizer(tok)
    found = anchors.positions(ids)
    end_turn, think_end, opener, result_end = (tok.encode(m)[0] for m in
                                               ("<|im_end|>", "</think>", "<tool_call>", "</tool_response>"))
    want = {i + 1 for i, t in enumerate(ids) if t in (end_turn, think_end, result_end)} | \
        {i for i, t in enumerate(ids) if t == opener}
    assert found == sorted(p for p in want if 0 < p < len(ids))
    assert any(ids[p - 1] == result_end for p in found) and any(ids[p] == opener for p in found)
    off = Anchors.for_tokenizer(tok, semantic=False, interval=10)
    assert off.positions(ids) == list(range(10, len(ids), 10))


def test_markers_of_several_tokens_match_as_sequences():
    a = Anchors(after=[(10, 11)], before=[(20, 21, 22)])
    ids = [1, 10, 11, 2, 10, 3, 20, 21, 22, 4, 20, 21, 5, 10, 11]
    assert a.positions(ids) == [3, 6]                    # 10 alone and 20 21 without 22 are no anchors


def test_decode_keeps_the_state_before_a_sampled_tool_call_opener(engines):
    """A reply forced to open a tool call: the state before the opener is checkpointed in decode
    and linked when the request's KV enters the tree."""
    cached, _ = engines
    opener = cached.tokenizer.encode("<tool_call>")[0]
    ids = cached.chat_prompt(conversation(1))
    pool = cached.core.checkpoints
    taken = pool.counters.taken
    req = run(cached, ids, SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=((opener, 100.0),)))
    assert req.output_ids[0] == opener
    positions = {c.position for c in pool.linked()}
    assert len(ids) + 0 in positions                  # before the first sampled opener (= prompt end)
    assert len(ids) + 1 in positions and len(ids) + 2 in positions   # each later opener
    assert pool.counters.taken >= taken + 3
    check_tree(cached)


def state_after(llm, ids):
    """(conv, rule) state rows after prefilling ids in one forward (no prefix cache)."""
    req = llm.core.add_request(ids, SamplingParams(max_tokens=2, ignore_eos=True))
    llm.core.step()                                   # the whole prompt, then the first token is sampled
    states = llm.core.states
    got = states.conv[:, req.state_row].copy(), states.rule[:, req.state_row].copy()
    while llm.core.has_work():
        llm.core.step()
    return got


def test_one_forward_captures_the_state_at_every_anchor_it_passes(engines):
    """A prompt with many anchors prefills in one forward (state cuts: the GDN layers run in
    pieces, attention and the MoE once), and each checkpoint holds the state of that prefix."""
    cached, plain = engines
    msgs = conversation(3, think=False)
    msgs[0] = {"role": "system", "content": "You are a careful coding agent."}   # nothing of it cached
    ids = cached.chat_prompt(msgs)
    forwards, forward = [], cached.core.forward
    cached.core.forward = lambda batch: forwards.append(batch.state_cuts) or forward(batch)
    try:
        req = run(cached, ids, SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        cached.core.forward = forward
    assert req.num_cached == 0 and len(forwards) == 1 and len(forwards[0]) == len(req.anchors) >= 6   # the last piece ends at the prompt end
    tree = cached.core.prefix_cache
    taken = [tree.node_at(ids[:p]).checkpoint for p in req.anchors]
    assert all(c is not None and c.position == p for c, p in zip(taken, req.anchors))
    # within float32 rounding of GEMMs over other row counts and of the GDN kernels over other
    # pieces: 2.4e-5 at most with numba's cache warm, 1.3e-4 (one conv value of 0.31) when
    # _gdn_cpu's kernels compile in this process (fresh clone, 2026-12-04; cause not found yet)
    for ckpt in taken[:-1]:
        conv, rule = state_after(plain, ids[:ckpt.position])
        np.testing.assert_allclose(ckpt.parts["conv"], conv, rtol=1e-4, atol=3e-4)
        np.testing.assert_allclose(ckpt.parts["rule"], rule, rtol=1e-4, atol=3e-4)
        assert not np.allclose(ckpt.parts["conv"], state_after(plain, ids[:ckpt.position + 1])[0], rtol=1e-4, atol=1e-4)
    check_tree(cached)


def test_a_prompt_that_ends_a_user_query_keeps_its_end_checkpoint(engines):
    """A prompt whose last message is the user's (not a tool result) marks its end checkpoint
    kept: the template re-renders what follows once the next query arrives, so that state is
    needed turns later."""
    cached, _ = engines
    anchors = cached.core.scheduler.recurrent.anchors
    tool_turn = conversation(2)
    query_turn = tool_turn + [{"role": "user", "content": "Now run the tests."}]
    assert not anchors.ends_a_query(cached.chat_prompt(tool_turn))
    assert anchors.ends_a_query(cached.chat_prompt(query_turn))
    assert anchors.ends_a_query(cached.chat_prompt(conversation(0) + [{"role": "user", "content": "hi"}]))
    ids = cached.chat_prompt(query_turn)
    run(cached, ids, SamplingParams(max_tokens=1, ignore_eos=True))
    node = cached.core.prefix_cache.node_at(ids)
    assert node.checkpoint is not None and node.checkpoint.keep
    check_tree(cached)


@pytest.mark.parametrize("backend,moe", [("ref", "fused"), ("cpu", "cpu"), ("cpu", "offload"), ("cpu", "hybrid")])
def test_resuming_matches_the_uninterrupted_run_on_every_backend(backend, moe):
    """The follow-up turn resumes from a checkpoint (state cuts in its first prefill, a restore
    in the second) and gives the uninterrupted run's logprobs, on the numpy reference ops and
    under every MoE backend of the CPU path (the cuda one: tests/test_backends_agree_cuda.py)."""
    opts = dict(backend=backend, moe_backend=moe, max_model_len=2048,
                **({"moe_cache_rate": 0.5} if moe in ("offload", "hybrid") else {}),
                **({"moe_fetch_fraction": 0.3} if moe == "hybrid" else {}))
    cached, plain = LLM(FIXTURE, state_checkpoint_interval=0, **opts), LLM(FIXTURE, enable_prefix_cache=False, **opts)
    try:
        run(cached, cached.chat_prompt(conversation(1)))
        follow = cached.chat_prompt(conversation(2))
        req, want = run(cached, follow), run(plain, follow)
        assert req.num_cached > 0 and req.output_ids == want.output_ids
        np.testing.assert_allclose([lp.logprob for lp in req.output_logprobs],
                                   [lp.logprob for lp in want.output_logprobs], atol=1e-4)
        check_tree(cached)
    finally:
        cached.core.close()
        plain.core.close()
