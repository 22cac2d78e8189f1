"""attention: cpu vs ref over GQA ratios, head dims, cache dtypes, several sequences with shuffled
slots, chunked prefill over a cached prefix and decode; ref against a masked float64 formula;
non-finite q, keys and values (ref against the rule in attention.py, cpu against ref)."""
import numpy as np
import pytest

from freetoken.kernels import attention
from freetoken.kernels._bf16 import from_f32, to_f32
from tests.helpers import assert_close
from tests.helpers import assert_follows_ref


def kv_pool(rng, N, G, D, dtype):
    k, v = (rng.standard_normal((2, N, G, D))).astype(np.float32)
    return (from_f32(k), from_f32(v)) if dtype == np.uint16 else (k, v)


def mixed_step(rng, lengths, N):
    """Sequences of the given cached lengths on shuffled pool slots; the step holds, per
    sequence, a chunk that ends at its last position: 1 token (decode) up to all (prefill)."""
    C = max(lengths) + 3
    perm = rng.permutation(N).astype(np.int32)
    table = np.full((len(lengths), C), -1, np.int32)
    seq, pos, start = [], [], 0
    for s, n in enumerate(lengths):
        table[s, :n] = perm[start:start + n]
        start += n
        chunk = int(rng.integers(1, n + 1))
        seq += [s] * chunk
        pos += range(n - chunk, n)
    order = rng.permutation(len(seq))                      # tokens of sequences interleaved
    return table, np.array(seq, np.int32)[order], np.array(pos, np.int32)[order]


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("Hq,G,D", [(4, 4, 32), (8, 4, 64), (8, 2, 128), (6, 3, 64)])
def test_cpu_matches_ref(Hq, G, D, dtype):
    rng = np.random.default_rng(Hq * G * D)
    lengths = [1, 7, 33, 20]
    N = sum(lengths) + 11
    k_cache, v_cache = kv_pool(rng, N, G, D, dtype)
    table, seq, pos = mixed_step(rng, lengths, N)
    q = rng.standard_normal((seq.shape[0], Hq, D)).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    expect = attention.ref(q, k_cache, v_cache, table, seq, pos, scale)
    got = attention.cpu(q, k_cache, v_cache, table, seq, pos, scale)
    assert_close(f"attention Hq{Hq} G{G} D{D}", expect, got, atol=2e-5, rtol=1e-4)
    out = np.full_like(q, np.nan)
    assert attention.cpu(q, k_cache, v_cache, table, seq, pos, scale, out=out) is out
    np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("T", [1, 3])
def test_decode_and_chunk_over_cached_prefix(T):
    rng = np.random.default_rng(T)
    N, G, D, Hq = 64, 2, 64, 4
    k_cache, v_cache = kv_pool(rng, N, G, D, np.uint16)
    table = rng.permutation(N)[None, :40].astype(np.int32)
    pos = np.arange(40 - T, 40, dtype=np.int32)            # a prefix of 40 - T is cached
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    args = (q, k_cache, v_cache, table, np.zeros(T, np.int32), pos, 0.125)
    assert_close(f"attention chunk T{T}", attention.ref(*args), attention.cpu(*args), 2e-5, 1e-4)


def test_ref_matches_masked_float64_attention():
    rng = np.random.default_rng(9)
    T, Hq, G, D = 6, 4, 2, 32
    k_cache, v_cache = kv_pool(rng, T, G, D, np.uint16)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = np.repeat(to_f32(k_cache).astype(np.float64), Hq // G, axis=1)   # [T,Hq,D]
    v = np.repeat(to_f32(v_cache).astype(np.float64), Hq // G, axis=1)
    s = np.einsum("thd,shd->hts", q.astype(np.float64), k) * 0.2
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    expect = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v)
    table = np.arange(T, dtype=np.int32)[None]
    got = attention.ref(q, k_cache, v_cache, table, np.zeros(T, np.int32),
                        np.arange(T, dtype=np.int32), 0.2)
    assert_close("attention ref vs f64", expect, got, atol=1e-5, rtol=1e-5)


def test_bad_slot_raises():
    k_cache = np.zeros((4, 1, 32), np.float32)
    table = np.array([[0, 1, 2], [0, 1, 9]], np.int32)
    q = np.zeros((1, 1, 32), np.float32)
    with pytest.raises(IndexError, match="sequence 1 reads a slot outside"):
        attention.cpu(q, k_cache, k_cache, table, np.ones(1, np.int32), np.array([2], np.int32), 1.0)
    attention.cpu(q, k_cache, k_cache, table, np.ones(1, np.int32), np.array([1], np.int32), 1.0)   # slots 0, 1
    for seq, pos in ((2, 0), (0, 3), (-1, 0), (0, -1)):
        with pytest.raises(IndexError, match="outside slot_table"):
            attention.cpu(q, k_cache, k_cache, table, np.array([seq], np.int32), np.array([pos], np.int32), 1.0)


def pool_step(rng, lengths, chunks, G, D, dtype, Hq):
    """Sequences of `lengths` cached positions on shuffled slots; the step computes the last
    `chunks[i]` positions of sequence i; tokens of the sequences interleaved."""
    N = sum(lengths) + 5
    k_cache, v_cache = kv_pool(rng, N, G, D, dtype)
    perm = rng.permutation(N).astype(np.int32)
    table = np.full((len(lengths), max(lengths) + 2), -1, np.int32)
    seq, pos, start = [], [], 0
    for s, (n, c) in enumerate(zip(lengths, chunks)):
        table[s, :n] = perm[start:start + n]
        start += n
        seq += [s] * c
        pos += range(n - c, n)
    order = rng.permutation(len(seq))
    q = rng.standard_normal((len(seq), Hq, D)).astype(np.float32)
    return q, k_cache, v_cache, table, np.array(seq, np.int32)[order], np.array(pos, np.int32)[order], D ** -0.5



@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("Hq,G,D", [(8, 2, 64), (6, 3, 32)])
def test_tiled_prefill_matches_ref(Hq, G, D, dtype):
    """The tiled path (attention_tiles): a whole 700-token prefill (several query tiles and key
    blocks, a causal mask inside blocks), a 150-token chunk over a cached 600-token prefix, and
    a 40-token chunk and two decode tokens in the same step, all interleaved."""
    rng = np.random.default_rng(D * G)
    q, k_cache, v_cache, table, seq, pos, scale = pool_step(rng, [700, 750, 90, 900, 5], [700, 150, 40, 1, 1],
                                                           G, D, dtype, Hq)
    assert set(attention._by_path(seq)[1].tolist()) == set(np.flatnonzero(seq >= 3).tolist())
    args = (q * 2, k_cache, v_cache, table, seq, pos, scale)
    assert_close(f"tiled attention Hq{Hq} G{G} D{D}", attention.ref(*args), attention.cpu(*args),
                 atol=2e-5, rtol=1e-4)


def test_tiled_softmax_keeps_a_dominant_score():
    """Scores far apart (a key that takes nearly all the weight, found in a late key block):
    the running max must rescale what earlier blocks added, not overflow or lose it."""
    rng = np.random.default_rng(4)
    T, G, D = 600, 1, 16
    k = rng.standard_normal((T, G, D)).astype(np.float32)
    v = rng.standard_normal((T, G, D)).astype(np.float32)
    q = np.repeat(k[None, 560, :, :] * 8, T, axis=0)             # every query points at key 560
    args = (q, k, v, np.arange(T, dtype=np.int32)[None], np.zeros(T, np.int32),
            np.arange(T, dtype=np.int32), 1.0)
    got = attention.cpu(*args)
    assert_close("tiled attention, one dominant key", attention.ref(*args), got, 2e-5, 1e-4)
    np.testing.assert_allclose(got[580, 0], v[560, 0], atol=1e-3)


@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("Hq,G,D", [(16, 4, 64), (8, 8, 32), (6, 2, 33), (24, 2, 128)])
def test_split_decode_over_long_and_short_contexts(Hq, G, D, dtype):
    """One decode token per sequence, contexts from 1 to 2500 positions: many chunks per long
    sequence, empty chunks for the short ones, merged into one softmax (bf16 of odd D reads rows
    element by element)."""
    rng = np.random.default_rng(D)
    lengths = [2500, 1, 130, 700]
    N = sum(lengths) + 5
    k_cache, v_cache = kv_pool(rng, N, G, D, dtype)
    perm = rng.permutation(N).astype(np.int32)
    table = np.full((len(lengths), max(lengths)), -1, np.int32)
    start = 0
    for s, n in enumerate(lengths):
        table[s, :n] = perm[start:start + n]
        start += n
    seq = np.arange(len(lengths), dtype=np.int32)
    pos = np.array(lengths, np.int32) - 1
    q = rng.standard_normal((len(lengths), Hq, D)).astype(np.float32)
    args = (q, k_cache, v_cache, table, seq, pos, 1.0 / np.sqrt(D))
    assert_close(f"split decode Hq{Hq} G{G} D{D}", attention.ref(*args), attention.cpu(*args),
                 atol=2e-5, rtol=1e-4)


def test_split_decode_rescales_to_a_late_dominant_key():
    """The chunk holding a key with nearly all the weight comes last: the merge must rescale the
    earlier chunks (whose scores are ~60 below) rather than add them at their own max."""
    rng = np.random.default_rng(5)
    C, G, D = 3000, 1, 16
    k = rng.standard_normal((C, G, D)).astype(np.float32)
    v = rng.standard_normal((C, G, D)).astype(np.float32)
    q = k[None, 2900] * 8
    args = (q, k, v, np.arange(C, dtype=np.int32)[None], np.zeros(1, np.int32),
            np.array([C - 1], np.int32), 1.0)
    got = attention.cpu(*args)
    assert_close("split decode, one dominant key", attention.ref(*args), got, 2e-5, 1e-4)
    np.testing.assert_allclose(got[0, 0], v[2900, 0], atol=1e-3)


@pytest.mark.parametrize("values", [[1.0, np.nan, 3.0, -5.0], [np.nan, np.nan], [np.nan, -np.inf], [-0.0, 0.0, -1.0],
                                    [-3.0, -2.5, -1e-30], [2.0, np.inf, np.nan], [], [-np.inf, -1e38, 1e-45]])
def test_decode_max_skips_nan(values):
    """finite_max, the chunk's softmax max reduced as integers: numpy's nanmax, -inf for none."""
    from freetoken.kernels.attention_decode import finite_max
    row = np.array(values + [7.0], np.float32)                # one past n: not read
    want = np.float32(-np.inf) if np.isnan(row[:-1]).all() else np.nanmax(row[:-1])
    got = finite_max(row, len(values))
    assert got == want                                       # 0.0 == -0.0: either sign shifts alike


def test_decode_exp_matches_numpy():
    from freetoken.kernels.attention_decode import exp_le0
    x = np.concatenate([-np.geomspace(1e-8, 87, 4000), [0.0, -0.5, -1.0, -86.99]]).astype(np.float32)
    got = np.array([exp_le0.dispatcher(v) for v in x], np.float32)
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=3e-7, atol=0)
    assert 0 <= exp_le0.dispatcher(np.float32(-1e4)) < 1e-37
    assert exp_le0.dispatcher(np.float32(-np.inf)) < 1e-37


@pytest.mark.parametrize("T,C,threads", [(1, 4096, 2), (1, 100, 16), (64, 4096, 2), (1, 30, 2), (3, 16384, 8)])
def test_decode_chunking_covers_the_context(T, C, threads):
    """Chunks tile the longest context; a long context is cut into enough work items for every
    thread (a few each), never into chunks shorter than MIN_CHUNK."""
    from freetoken.kernels.attention_decode import ITEMS_PER_THREAD, MIN_CHUNK, chunking
    CH, nch = chunking(T, C, threads)
    assert CH * nch >= C and CH * (nch - 1) < C and CH >= MIN_CHUNK
    if C >= MIN_CHUNK * ITEMS_PER_THREAD * threads:
        assert T * nch >= ITEMS_PER_THREAD * threads


NON_FINITE = ("q_nan", "k_inf", "k_nan", "k_neginf", "v_inf")


def non_finite_step(kind, prefill, dtype=np.float32, D=32, rep=2):
    """Sequences of 200, 40 and 5 positions (G 2; rep 2, D 32 unless given) on shuffled slots, sequence 0 alone
    holding non-finite data (`kind`): a NaN in q of head 1 of its last token; +inf or NaN in the
    key row of position 150 (group 0); -inf in the key rows of positions 0..140 (group 0: whole
    split chunks and key tiles of them); +inf in the value row of position 150 (group 0). q of
    sequence 0 is positive at that coordinate (3), so an infinite key gives the same-signed score
    to every head of the group. prefill=False: one token per sequence (attention.cpu's split
    path, gpu's _decode); True: sequence 0's last 70 positions (>= TILED_MIN: cpu's tiled path,
    gpu's _prefill), 130..149 before row 150, 130..140 with no finite key, and one token for each
    other sequence."""
    rng = np.random.default_rng(NON_FINITE.index(kind))
    lengths, G, d = [200, 40, 5], 2, 3
    k, v = rng.standard_normal((2, sum(lengths) + 3, G, D)).astype(np.float32)
    perm = rng.permutation(k.shape[0]).astype(np.int32)
    table, starts = np.zeros((3, 200), np.int32), np.cumsum([0] + lengths)
    for s, n in enumerate(lengths):
        table[s, :n] = perm[starts[s]:starts[s + 1]]
    new = [70 if prefill else 1, 1, 1]
    seq = np.repeat(np.arange(3, dtype=np.int32), new)
    pos = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, new)]).astype(np.int32)
    q = rng.standard_normal((seq.size, rep * G, D)).astype(np.float32)
    q[seq == 0, :, d] = np.abs(q[seq == 0, :, d]) + 0.5
    if kind == "q_nan":
        q[new[0] - 1, 1, d] = np.nan
    elif kind == "k_neginf":
        k[table[0, :141], 0, d] = -np.inf
    else:
        (v if kind == "v_inf" else k)[table[0, 150], 0, d] = np.nan if kind == "k_nan" else np.inf
    if dtype == np.uint16:
        k, v = from_f32(k), from_f32(v)
    return q, k, v, table, seq, pos, np.float32(D ** -0.5)


def quiet_ref(args):
    with np.errstate(all="ignore"):
        return attention.ref(*args)


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", NON_FINITE)
def test_ref_follows_the_non_finite_rule(kind, prefill):
    """The rule in attention.py, read off ref: a NaN or +inf score NaNs its (token, head), a -inf
    one is weight 0 (all -inf: NaN), an inf value is inf in its coordinate; nothing reaches
    another sequence, another kv group's heads, or a token before the poisoned position."""
    args = non_finite_step(kind, prefill)
    q, seq, pos = args[0], args[4], args[5]
    nan, inf = np.zeros(q.shape, bool), np.zeros(q.shape, bool)
    mine = seq == 0
    if kind == "q_nan":
        nan[np.flatnonzero(mine)[-1], 1] = True
    elif kind == "k_neginf":
        nan[mine & (pos <= 140), :2] = True
    elif kind == "v_inf":
        inf[mine & (pos >= 150), :2, 3] = True
    else:
        nan[mine & (pos >= 150), :2] = True
    want = quiet_ref(args)
    np.testing.assert_array_equal(np.isnan(want), nan)
    np.testing.assert_array_equal(np.isinf(want), inf)


@pytest.mark.parametrize("D,rep", [(32, 2), (64, 4)])
@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", NON_FINITE)
def test_cpu_follows_ref_on_non_finite_inputs(kind, prefill, dtype, D, rep):
    """Both cpu paths as ref. Before: a split chunk of all -inf keys came out NaN (exp(-inf +
    inf)) where ref gives those keys weight 0; under fastmath's no-NaN assumption the tiled exp
    made a NaN score weight 0; the tiled value GEMM met an inf value row with a masked query's
    zero weight (NaN for tokens before that position); and the split merge kept a chunk only if
    its sum was > 0, which drops a NaN sum once no-NaN is off. D 64, rep 4: decode's scores and
    V rows in blocks (_simd.head_scores, weighted_v_rows); D 32, rep 2 slot by slot."""
    args = non_finite_step(kind, prefill, dtype, D, rep)
    with np.errstate(all="ignore"):
        got = attention.cpu(*args)
    assert_follows_ref(quiet_ref(args), got, rtol=1e-4, atol=2e-5)


def test_the_decode_path_is_said_for_each_geometry(caplog):
    """describe() names what a decode token runs (kernel attention and the engine's start-up log):
    the vector blocks for rep 4k and D 64k, and why not otherwise."""
    import logging
    from freetoken import LLM
    from freetoken.kernels.attention_decode import describe
    assert describe(8, 128) == ("decode attention: scores 4 heads x 4 slots a shuffle tree; "
                                "weighted V rows 4 heads x 64 values in registers")
    assert "a dot at a time (rep 3 is no multiple of 4)" in describe(3, 64)
    assert "a dot at a time (D 40 is no multiple of 16)" in describe(4, 40)
    assert "slot by slot (D 80 is no multiple of 64)" in describe(4, 80)
    with caplog.at_level(logging.INFO, logger="freetoken"):
        LLM("synth:tiny", backend="cpu", max_model_len=64)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode attention:")]
    assert said == ["decode attention: scores a dot at a time (rep 2 is no multiple of 4); "
                    "weighted V rows slot by slot (D 16 is no multiple of 64)"]
