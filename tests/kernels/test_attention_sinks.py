"""attention with learned per-head sinks and a sliding window (gpt-oss): ref against the formula in
float64 (transformers' eager gpt-oss attention: the sink's logit joins the softmax, its weight is
dropped; key j visible to position p when p - W < j <= p); cpu against ref on the split decode
path and the tiled prefill path, bf16 and f32 caches, contexts shorter and much longer than the
window; without the keywords both give what they gave before (gpu: test_gpu_attention_sinks.py)."""
import numpy as np
import pytest

from freetoken.kernels import attention, attention_tiles
from freetoken.kernels._bf16 import to_f32
from tests.helpers import assert_close, assert_follows_ref
from tests.kernels.test_attention import NON_FINITE, non_finite_step, pool_step, quiet_ref

MODES = {"sinks": (True, 0), "window": (False, 128), "both": (True, 128), "window 1": (False, 1),
         "both W100": (True, 100)}   # (sinks?, W)


def formula(q, k_cache, v_cache, table, seq, pos, scale, sinks=None, window=0):
    """The definition, token by token in float64: softmax over the visible keys' scores and the
    sink's logit, the sink's probability dropped (not renormalised)."""
    k, v = (to_f32(c).astype(np.float64) for c in (k_cache, v_cache))
    T, Hq, D = q.shape
    rep = Hq // k.shape[1]
    out = np.zeros((T, Hq, D))
    for t in range(T):
        p = int(pos[t])
        keys = [j for j in range(p + 1) if window == 0 or j > p - window]
        rows = table[seq[t], keys]
        for h in range(Hq):
            s = k[rows, h // rep] @ q[t, h].astype(np.float64) * scale
            logits = np.append(s, sinks[h]) if sinks is not None else s
            e = np.exp(logits - logits.max())
            out[t, h] = (e[:len(keys)] / e.sum()) @ v[rows, h // rep]
    return out


def head_sinks(rng, Hq):
    """Sink logits around the scores (~N(0, 1)) and, every third head (+8), above nearly all of them."""
    return (rng.uniform(-4, 6, Hq) + np.where(np.arange(Hq) % 3 == 0, 8, 0)).astype(np.float32)


def close(name, want, got):
    assert_close(name, want, got, atol=2e-5 * max(1.0, np.abs(want).max()), rtol=1e-4)


@pytest.mark.parametrize("window", [0, 1, 3, 16, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_ref_matches_the_formula(with_sinks, window):
    """Mixed step (decode tokens, chunked prefill over a cached prefix, a whole prefill), GQA rep 2:
    window 1 (a token sees itself), windows shorter and longer than every context."""
    rng = np.random.default_rng(window + 7 * with_sinks)
    args = pool_step(rng, [40, 9, 25, 1], [1, 9, 12, 1], 2, 16, np.float32, 4)
    sinks = head_sinks(rng, 4) if with_sinks else None
    got = attention.ref(*args, sinks=sinks, window=window)
    close(f"ref sinks={with_sinks} W{window}", formula(*args, sinks, window), got)
    if window == 1 and not with_sinks:                     # the token's own value row, exactly
        q, k, v, table, seq, pos, _ = args
        np.testing.assert_allclose(got, np.repeat(v[table[seq, pos]], 2, axis=1), rtol=1e-6)


def test_ref_sink_takes_weight_and_dominates():
    """Value rows of ones: each output is the weight the keys keep, 1 - the sink's probability;
    a sink far above every score leaves the keys ~e^-20 of it (and the output is not renormalised
    back to a weighted mean of the values)."""
    rng = np.random.default_rng(3)
    q, k, v, table, seq, pos, scale = pool_step(rng, [30, 12], [30, 1], 1, 8, np.float32, 3)
    v[:] = 1.0
    sinks = np.array([-30.0, 0.5, 30.0], np.float32)
    got = attention.ref(q, k, v, table, seq, pos, scale, sinks=sinks)
    want = formula(q, k, v, table, seq, pos, scale, sinks)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    np.testing.assert_allclose(got[:, 0], 1.0, rtol=1e-6)          # sink far below: no weight
    assert (got[:, 1] < 0.999).all() and (got[:, 1] > 0.01).all()
    assert (got[:, 2] < 1e-8).all() and (got[:, 2] > 0).all()


def test_no_keywords_is_the_old_attention_exactly():
    """sinks None and window 0 are today's attention bit for bit: ref against its pre-sink body
    (numpy's exp(s - max) / sum), cpu against itself without the keywords, on both paths; a
    window at least as long as every context is the same as none (cpu too, both paths)."""
    rng = np.random.default_rng(11)
    args = pool_step(rng, [300, 700, 20, 1], [1, 200, 5, 1], 2, 64, np.uint16, 8)
    q, k_cache, v_cache, table, seq, pos, scale = args
    old = np.empty(q.shape, np.float32)
    for t in range(q.shape[0]):
        slots = table[seq[t], :pos[t] + 1]
        for h in range(q.shape[1]):
            s = (to_f32(k_cache[slots])[:, h // 4] @ q[t, h]) * np.float32(scale)
            p = np.exp(s - s.max())
            old[t, h] = (p / p.sum()) @ to_f32(v_cache[slots])[:, h // 4]
    np.testing.assert_array_equal(attention.ref(*args), old)
    np.testing.assert_array_equal(attention.ref(*args, sinks=None, window=0), old)
    np.testing.assert_array_equal(attention.ref(*args, window=701), old)
    plain = attention.cpu(*args)
    np.testing.assert_array_equal(attention.cpu(*args, sinks=None, window=0), plain)
    np.testing.assert_array_equal(attention.cpu(*args, window=701), plain)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("Hq,G,D", [(8, 2, 64), (6, 3, 32)])
@pytest.mark.parametrize("mode", list(MODES))
def test_cpu_decode_matches_ref(mode, Hq, G, D, dtype):
    """One token per sequence (the split decode path), contexts 1..1000 against W 128: many
    chunks' worth of context cut to the window, some shorter than it; then a batch-1 step at
    1000 positions (the most chunks a token gets) and a few tokens of one sequence over its
    cached prefix. D 64 rep 4: the vector blocks (_simd.head_scores); D 32 rep 2 dot by dot."""
    with_sinks, window = MODES[mode]
    rng = np.random.default_rng(D + G)
    sinks = head_sinks(rng, Hq) if with_sinks else None
    lengths = [1000, 300, 5, 128, 129, 1]
    q, k, v, table, seq, pos, scale = pool_step(rng, lengths, [1] * len(lengths), G, D, dtype, Hq)
    for name, pick in (("batch", slice(None)), ("batch 1", np.flatnonzero(seq == 0))):
        args = (q[pick], k, v, table, seq[pick], pos[pick], scale)
        close(f"decode {mode} {name}", attention.ref(*args, sinks=sinks, window=window),
              attention.cpu(*args, sinks=sinks, window=window))
    args = pool_step(rng, [600, 40], [7, 3], G, D, dtype, Hq)          # 10 tokens: still decode
    close(f"decode chunk {mode}", attention.ref(*args, sinks=sinks, window=window),
          attention.cpu(*args, sinks=sinks, window=window))


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("Hq,G,D", [(8, 2, 64), (6, 3, 32)])
@pytest.mark.parametrize("mode", list(MODES))
def test_cpu_prefill_matches_ref(mode, Hq, G, D, dtype):
    """The tiled path: a whole 700-token prefill (query tiles wider than the window, key blocks
    that start at the tile's window), a 150-token chunk over a 600-position cached prefix, a
    40-token chunk, and decode tokens in the same step."""
    with_sinks, window = MODES[mode]
    rng = np.random.default_rng(D * G + 1)
    sinks = head_sinks(rng, Hq) if with_sinks else None
    args = pool_step(rng, [700, 750, 90, 900, 5], [700, 150, 40, 1, 1], G, D, dtype, Hq)
    assert len(attention._by_path(args[4])[0]) == 890
    close(f"prefill {mode}", attention.ref(*args, sinks=sinks, window=window),
          attention.cpu(*args, sinks=sinks, window=window))


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_positions_before_the_window_are_never_read(prefill, monkeypatch):
    """Table entries before every token's window point at a slot of NaN keys and values (or are
    -1, which the slot check lets pass): any read of them would NaN the output. And the tiled
    path folds about TILE_Q + W keys a query tile, not the whole prefix."""
    rng = np.random.default_rng(5)
    W, n = 64, 1000
    q, k, v, table, seq, pos, scale = pool_step(rng, [n], [300 if prefill else 1], 2, 32, np.float32, 4)
    unused = np.setdiff1d(np.arange(k.shape[0]), table[0, :n])
    k[unused], v[unused] = np.nan, np.nan
    table[0, :pos.min() - W + 1] = unused[0]
    table[0, :100] = -1
    folded = []

    def spy(S, *rest):
        folded.append(S.shape[1])
        return fold(S, *rest)
    fold = attention_tiles._fold_scores
    monkeypatch.setattr(attention_tiles, "_fold_scores", spy)
    args, sinks = (q, k, v, table, seq, pos, scale), head_sinks(rng, 4)
    got = attention.cpu(*args, sinks=sinks, window=W)
    assert np.isfinite(got).all()
    close("window reads", attention.ref(*args, sinks=sinks, window=W), got)
    tiles = -(-q.shape[0] // attention_tiles.TILE_Q) * 2 if prefill else 0
    assert sum(folded) <= tiles * (attention_tiles.TILE_Q + W)
    table[0, pos.max() - W + 1] = -1
    with pytest.raises(IndexError, match="sequence 0 reads a slot outside"):
        attention.cpu(*args, window=W)


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_a_sink_turns_all_minus_inf_scores_into_zero(prefill):
    """test_attention's -inf keys (sequence 0, group 0, positions 0..140): without a sink those
    tokens' heads are NaN (0 / 0); with a finite sink 0. ref by the rule, cpu as ref. Decode:
    the 16 tokens of 130..145 of sequence 0 and one of each other sequence (< TILED_MIN)."""
    args = non_finite_step("k_neginf", True, np.float32, 64, 4)
    if not prefill:
        keep = (args[4] != 0) | (args[5] <= 145)
        args = tuple(a[keep] if i in (0, 4, 5) else a for i, a in enumerate(args))
        assert len(attention._by_path(args[4])[0]) == 0
    q, seq, pos = args[0], args[4], args[5]
    sinks = np.linspace(-2, 2, q.shape[1]).astype(np.float32)
    with np.errstate(all="ignore"):
        want = attention.ref(*args, sinks=sinks)
        got = attention.cpu(*args, sinks=sinks)
    assert np.isfinite(want).all()
    dead = (seq == 0) & (pos <= 140)
    assert dead.any() and np.isnan(quiet_ref(args)[dead, :4]).all()
    np.testing.assert_array_equal(want[dead, :4], 0.0)
    assert_follows_ref(want, got, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(got[dead, :4], 0.0, atol=1e-30)


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", NON_FINITE)
def test_cpu_follows_ref_on_non_finite_inputs_in_a_window(kind, prefill):
    """test_attention's non-finite cases (the poisoned key or value row at position 150) with W 20
    and sinks: tokens at 150..169 read that row, those before and from 170 on must not (on the
    tiled path a query tile spans both: rows whose window has left it take their own keys)."""
    args = non_finite_step(kind, prefill, np.float32, 64, 4)
    sinks = np.linspace(-1, 3, args[0].shape[1]).astype(np.float32)
    with np.errstate(all="ignore"):
        want = attention.ref(*args, sinks=sinks, window=20)
        got = attention.cpu(*args, sinks=sinks, window=20)
    seq, pos = args[4], args[5]
    bad = np.zeros(args[0].shape[:2], bool)                     # [T,Hq]: a non-finite output
    if kind == "q_nan":
        bad[np.flatnonzero(seq == 0)[-1], 1] = True
    elif kind != "k_neginf":                                    # -inf keys: weight 0, sink finite
        bad[(seq == 0) & (pos >= 150) & (pos < 170), :4] = True  # kv group 0's heads
    np.testing.assert_array_equal(~np.isfinite(want).all(-1), bad)
    assert_follows_ref(want, got, rtol=1e-4, atol=2e-5)
