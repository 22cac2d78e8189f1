"""attention.gpu vs ref on the device: decode (split-K + reduce) and prefill (query tiles, online
softmax), GQA ratios 1/2/4/8, head_dim 32/64/128/256, contexts 1..3000, batches mixing prefill,
chunked prefill over a cached prefix and decode rows. KV slots no sequence owns hold NaN and
the ops' scratch is poisoned with NaN before the checked call, so reading anything outside a
token's context shows. Outputs poisoned with NaN. Plus CPU dry runs of the launches, and both
kernels on non-finite q, keys and values against ref (test_attention's rule cases)."""
import numpy as np
import pytest

from freetoken.kernels import attention
from freetoken.kernels._bf16 import from_f32
from tests.helpers import assert_close
from tests.kernels.test_attention import NON_FINITE, non_finite_step, quiet_ref
from tests.helpers import assert_follows_ref
from tests.kernels.test_gpu_experts import poison_scratch
from tests.kernels.test_gpu_linear import dry_run
from freetoken.cupy_loader import cupy as load_cupy

DECODE = [  # context length per sequence (one new token each), G, rep, D
    ([1], 4, 1, 64), ([5], 2, 2, 128), ([300, 17, 1], 2, 4, 32), ([40, 3000], 1, 8, 128),
    ([129, 2048, 7, 1000], 4, 2, 64), ([2999], 8, 4, 128), ([77, 1], 2, 8, 256),
]
PREFILL = [  # context length per sequence, tokens computed this step (the last ones), G, rep, D
    ([33], [33], 2, 2, 64), ([20, 50], [20, 3], 1, 4, 128), ([45, 9, 30], [45, 9, 1], 2, 1, 64),
    ([37], [37], 1, 2, 256), ([700, 1], [300, 1], 4, 8, 128), ([1500], [200], 4, 4, 64),
    ([17, 2500], [17, 40], 2, 1, 32), ([37], [37], 4, 1, 64),
]
HEAVY = {("C1500-T200-G4-r4-D64", "f32"), ("C1500-T200-G4-r4-D64", "bf16"), ("C700-T301-G4-r8-D128", "f32")}


def case(lens, new, G, rep, D, dtype, seed=0):
    """Sequences own random slots of a pool whose other slots hold NaN; token i of the step is
    position pos[i] of sequence seq[i]."""
    rng = np.random.default_rng(seed + sum(lens) + D)
    B, N = len(lens), sum(lens) + 9
    perm = rng.permutation(N).astype(np.int32)
    table, used = np.zeros((B, max(lens)), np.int32), 0
    for b, n in enumerate(lens):
        table[b, :n] = perm[used:used + n]
        used += n
    k_cache, v_cache = (rng.standard_normal((N, G, D), dtype=np.float32) for _ in range(2))
    k_cache[perm[used:]], v_cache[perm[used:]] = np.nan, np.nan
    if dtype == "bf16":
        k_cache, v_cache = from_f32(k_cache), from_f32(v_cache)
    seq = np.concatenate([np.full(m, b) for b, m in enumerate(new)]).astype(np.int32)
    pos = np.concatenate([np.arange(n - m, n) for n, m in zip(lens, new)]).astype(np.int32)
    q = rng.standard_normal((len(seq), G * rep, D), dtype=np.float32)
    return q, k_cache, v_cache, table, seq, pos, np.float32(D ** -0.5)


def _check(name, args):
    cp = load_cupy()
    dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    out = cp.full(args[0].shape, np.nan, cp.float32)
    attention.gpu(*dev, out)                      # sizes the scratch
    poison_scratch()
    out.fill(np.nan)
    assert attention.gpu(*dev, out) is out
    assert_close(name, attention.ref(*args), out.get(), 2e-5, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("lens,G,rep,D", DECODE,
                         ids=[f"C{max(c[0])}-G{c[1]}-r{c[2]}-D{c[3]}" for c in DECODE])
def test_gpu_decode_matches_ref(lens, G, rep, D, dtype):
    _check(f"attention decode {lens} G{G} rep{rep} D{D} {dtype}",
           case(lens, [1] * len(lens), G, rep, D, dtype))


def _prefill_id(c):
    return f"C{max(c[0])}-T{sum(c[1])}-G{c[2]}-r{c[3]}-D{c[4]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,lens,new,G,rep,D", [
    pytest.param(dtype, *c, id=f"{_prefill_id(c)}-{dtype}",
                 marks=[pytest.mark.heavy] if (_prefill_id(c), dtype) in HEAVY else [])
    for c in PREFILL for dtype in ("bf16", "f32")])
def test_gpu_prefill_matches_ref(lens, new, G, rep, D, dtype):
    _check(f"attention prefill {lens} new {new} G{G} rep{rep} D{D} {dtype}",
           case(lens, new, G, rep, D, dtype))


@pytest.mark.gpu
def test_gpu_decode_on_a_wide_padded_table():
    """A CUDA graph's slot_table is [B, max_context] with most columns unused: chunks past a
    token's context must be skipped, not merged."""
    q, k, v, table, seq, pos, scale = case([50, 9], [1, 1], 2, 4, 64, "bf16")
    wide = np.zeros((2, 40960), np.int32)
    wide[:, :table.shape[1]] = table
    _check("attention decode, padded table", (q, k, v, wide, seq, pos, scale))


@pytest.mark.parametrize("T,B,entries", [
    (3, 3, ["attention_decode_bf16", "attention_decode_reduce_f32"]),
    (40, 2, ["attention_prefill_bf16"]),
])
def test_dry_run_picks_kernel_and_binds_args(T, B, entries, monkeypatch):
    lens, new = ([60] * B, [1] * B) if T == B else ([30, 25], [30, 10])
    args = case(lens, new, 2, 4, 128, "bf16")
    got = dry_run(monkeypatch, attention, attention.gpu, *args, np.empty(args[0].shape, np.float32))
    assert got == entries


def test_decode_chunks_fill_the_gpu_and_fit_shared_memory():
    for T, G, C, rep, D in [(1, 4, 40960, 8, 128), (4, 4, 3000, 8, 128), (16, 8, 1, 4, 64),
                            (1, 1, 100000, 32, 128), (2, 2, 7, 1, 256)]:
        CH = attention._decode_chunk(T, G, C, rep, D)
        assert CH % 32 == 0 and 32 <= CH <= attention.MAX_CHUNK
        assert 4 * (rep * D + rep * CH + CH) <= 48 * 1024
        nch = -(-C // CH)
        enough = min(attention.TARGET_BLOCKS, -(-C // 32) * T * G) // 2
        assert nch * T * G >= enough or CH == attention.MAX_CHUNK, (T, G, C, CH)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_gpu_decode_on_a_cache_not_16_byte_aligned(dtype):
    """A KV cache view starting one element into its allocation (a pool's later part, say): the
    decode kernel must take its scalar loads there (a vector load would fault on a GPU)."""
    cp = load_cupy()
    q, k_cache, v_cache, table, seq, pos, scale = case([40, 7], [1, 1], 2, 2, 64, dtype)
    dev = []
    for c in (k_cache, v_cache):
        flat = cp.zeros(c.size + 1, c.dtype)
        flat[1:] = cp.asarray(c.reshape(-1))
        dev.append(flat[1:].reshape(c.shape))
    assert dev[0].data.ptr % 16 != 0
    out = cp.full(q.shape, np.nan, cp.float32)
    attention.gpu(cp.asarray(q), *dev, cp.asarray(table), cp.asarray(seq), cp.asarray(pos), scale, out)
    assert_close("attention decode, unaligned cache", attention.ref(q, k_cache, v_cache, table, seq, pos, scale),
                 out.get(), 2e-5, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", NON_FINITE)
def test_gpu_follows_ref_on_non_finite_inputs(kind, prefill, dtype):
    """Both kernels as ref (the rule in attention.py). Before, both shifted a block of scores that
    were all -inf by their max, exp(-inf + inf) = NaN: a decode chunk of only -inf keys, or a
    prefill row whose first key tile was all -inf, came out NaN where ref gives those keys weight
    0. The scratch is sized on finite inputs first and then filled with NaN: the emulator reports
    a NaN written while an input holds never-written words, and here NaN is the right answer."""
    cp = load_cupy()
    args = non_finite_step(kind, prefill, dtype)
    dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    out = cp.full(args[0].shape, 7.0, cp.float32)
    attention.gpu(cp.zeros_like(dev[0]), cp.zeros_like(dev[1]), cp.zeros_like(dev[2]), *dev[3:], out)
    poison_scratch()
    out.fill(7.0)
    assert attention.gpu(*dev, out) is out
    assert_follows_ref(quiet_ref(args), out.get(), rtol=1e-3, atol=2e-5)
