"""The residency kernel (cuda/residency.cu) against the numpy spec (SlotCache.step), bit for bit.

gpu: the kernel over 256 random steps per case, several cache sizes (from 1 slot, below one step's
distinct experts, where q is bounded by the evictable slots), batch shapes and policies:
rewritten ids, CPU ids, fill plan, slots, owners, usage, recency, clock and counters after every
step; the invalidate, count and copy kernels against their mirrors.
CPU: a step-by-step Python port of the kernel's phases (a block of threads, atomics in any order,
per-thread coldest slot, only the winner's thread rescanning) against the spec, so the kernel's
algorithm is checked in CI, where the kernel cannot run.
"""
import numpy as np
import pytest

from freetoken.moe.residency import COUNTERS, SlotCache
from freetoken.moe.residency_gpu import ORDERS, invalidate_mirror, policy_args
from freetoken.moe.split import FetchPolicy
from freetoken.cupy_loader import cupy as load_cupy

POLICIES = {
    "all": FetchPolicy.fetch_all(),
    "phi0.3": FetchPolicy.fraction(0.3),
    "phi0.3-minfill": FetchPolicy.fraction(0.3, min_fill=1),
    "phi0.682": FetchPolicy.fraction(0.682),
    "phi0": FetchPolicy.fraction(0.0),
    "cap2": FetchPolicy.fixed_cap(2),
    "lowest-id": FetchPolicy.fraction(0.5, order="lowest_id"),
}
CASES = [  # (L, E, k, max tokens, S)
    (4, 16, 4, 1, 4), (4, 16, 4, 2, 9), (3, 32, 8, 4, 32), (6, 64, 8, 4, 100), (2, 8, 2, 3, 16),
    # tiny caches: most steps route more distinct experts than there are slots
    (3, 8, 2, 2, 1), (2, 16, 4, 3, 2), (4, 8, 4, 2, 3), (2, 64, 8, 4, 3),
]


def routing(rng, steps, L, E, k, max_t, locality=0.5):
    """(layer, ids int32[T,k]) per step, cyclic layers, some temporal locality, duplicates allowed."""
    prev, out = {}, []
    for step in range(steps):
        layer = step % L if rng.random() < 0.8 else int(rng.integers(L))
        T = int(rng.integers(1, max_t + 1))
        ids = rng.integers(0, E, (T, k)).astype(np.int32)
        if layer in prev and rng.random() < locality:
            keep = rng.random((T, k)) < 0.6
            ids = np.where(keep, prev[layer][:1].repeat(T, 0)[:, :k], ids).astype(np.int32)
        prev[layer] = ids
        out.append((layer, ids))
    return out


# --- the kernel's algorithm, phase by phase (CPU) ----------------------------------------------

def _count(m, kind, frac, cap, min_fill):
    q = m
    if kind == 0:
        lo = (m * frac) >> 16
        cost = lambda f: max(f * (65536 - frac), (m - f) * frac)   # noqa: E731
        q = min(lo if cost(lo) <= cost(lo + 1) else lo + 1, m)
    elif kind == 1:
        q = min(m, cap)
    return max(q, 1) if min_fill and m > 0 else q


def simulate(c: SlotCache, layer, ids, policy, rng, threads=8):
    """residency_step_i32 on SlotCache's arrays; returns (cpu_ids, fill slots, fill experts)."""
    E, a = c.E, policy_args(policy)
    flat = ids.ravel()
    c.clock += 1
    now, routed = c.clock, np.zeros(E, bool)
    routed[flat[(flat >= 0) & (flat < E)]] = True
    hits, found = 0, []
    for e in np.flatnonzero(routed):
        s = c.slot_for[layer, e]
        if s >= 0:
            c.usage[s], hits = now, hits + 1
        else:
            found.append(int(e))
    rng.shuffle(found)                                   # atomics: any order
    rec = c.recency[layer]
    first = (lambda x, y: rec[x] > rec[y] or (rec[x] == rec[y] and x < y)) if a["order"] == 0 \
        else (lambda x, y: x < y)
    order = [0] * len(found)
    for f in found:
        order[sum(first(g, f) for g in found)] = f
    q = min(_count(len(found), a["kind"], a["frac_q16"], a["cap"], a["min_fill"]), c.S - hits)
    slots, experts, evictions = _victims(c, layer, routed, order[:q], now, threads)
    rec[routed] = now
    raw = ids.copy()
    ids[...] = np.where((raw >= 0) & (raw < E), c.slot_for[layer][np.clip(raw, 0, E - 1)], -1)
    for name, v in zip(COUNTERS, (hits, len(found), len(slots), len(found) - len(slots), evictions)):
        c.counters[name][layer] += v
    return np.where(ids < 0, raw, -1), np.array(slots, np.int32), np.array(experts, np.int32)


def _victims(c, layer, routed, fill, now, threads):
    E = c.E

    def protected(s):
        o = c.owner_of[s]
        return o >= 0 and o // E == layer and routed[o % E]

    def coldest(t):
        keys = [(int(c.usage[s]), s) for s in range(t, c.S, threads) if not protected(s)]
        return min(keys) if keys else None

    heads = [coldest(t) for t in range(threads)]
    slots, experts, evictions = [], [], 0
    for e in fill:
        live = [h for h in heads if h is not None]
        if not live:
            break
        _, s = min(live)
        old = int(c.owner_of[s])
        if old >= 0:
            c.slot_for[old // E, old % E] = -1
            evictions += 1
        c.owner_of[s], c.slot_for[layer, e], c.usage[s] = layer * E + e, s, now
        slots.append(s)
        experts.append(e)
        heads[s % threads] = coldest(s % threads)
    return slots, experts, evictions


def _state(c):
    return (c.slot_for, c.owner_of, c.usage, c.recency, np.array([c.clock]),
            np.stack([c.counters[n] for n in COUNTERS]))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}E{c[1]}k{c[2]}T{c[3]}S{c[4]}" for c in CASES])
def test_kernel_algorithm_matches_spec(case, policy):
    L, E, k, max_t, S = case
    rng = np.random.default_rng(S * 31 + E)
    spec, sim = SlotCache(L, E, S), SlotCache(L, E, S)
    for layer, ids in routing(rng, 256, L, E, k, max_t):
        want_ids, got_ids = ids.copy(), ids.copy()
        fills = spec.step(layer, want_ids, POLICIES[policy])
        cpu, slots, experts = simulate(sim, layer, got_ids, POLICIES[policy], rng)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(cpu, np.where(want_ids < 0, ids, -1))
        np.testing.assert_array_equal(slots, fills.slots)
        np.testing.assert_array_equal(experts, fills.experts)
        for a, b in zip(_state(sim), _state(spec)):
            np.testing.assert_array_equal(a, b)


def test_policy_args_cover_every_kind_and_order():
    assert policy_args(FetchPolicy.fixed_cap(3, min_fill=1)) == dict(kind=1, frac_q16=0, cap=3,
                                                                     min_fill=1, order=0)
    assert policy_args(FetchPolicy.fraction(1.0, order="lowest_id"))["order"] == ORDERS["lowest_id"]
    assert policy_args(FetchPolicy.fixed_cap(2**40))["cap"] == 2**31 - 1   # fits the int32 argument
    for m in range(40):
        for frac in (0, 1, 19661, 32768, 44696, 65535, 65536):
            assert _count(m, 0, frac, 0, 0) == FetchPolicy("fraction", frac_q16=frac).count(m)


def test_invalidate_mirror_unlinks_owners():
    c = SlotCache(2, 4, 6)
    c.step(0, np.array([[0, 1, 2]], np.int32), FetchPolicy.fetch_all())
    c.step(1, np.array([[3, 0]], np.int32), FetchPolicy.fetch_all())
    invalidate_mirror(c, 0, 3)
    assert (c.owner_of[:3] == -1).all() and (c.usage[:3] == 0).all()
    for s in range(3, 6):
        o = c.owner_of[s]
        assert o < 0 or c.slot_for[o // 4, o % 4] == s
    assert not ((c.slot_for >= 0) & (c.slot_for < 3)).any()
    assert (c.owner_of[3:] >= 0).sum() == 2          # 5 experts in 6 slots, 3 wiped


# --- the kernel itself (GPU) -------------------------------------------------------------------

def _device_state(res):
    s = res.snapshot()
    return (s["slot_for"], s["owner_of"], s["usage"], s["recency"], np.array([s["clock"]]),
            s["counters"].T)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}E{c[1]}k{c[2]}T{c[3]}S{c[4]}" for c in CASES])
def test_kernel_matches_spec(case, policy):
    cp = load_cupy()

    from freetoken.moe.residency_gpu import GpuResidency
    L, E, k, max_t, S = case
    rng = np.random.default_rng(S * 7 + E)
    spec, res = SlotCache(L, E, S), GpuResidency(L, E, S)
    buffers = {}             # one pair per shape, as the runtime keeps them (few allocations)
    for layer, ids in routing(rng, 256, L, E, k, max_t):
        want = ids.copy()
        fills = spec.step(layer, want, POLICIES[policy])
        if ids.shape not in buffers:
            buffers[ids.shape] = cp.empty(ids.shape, cp.int32), cp.empty(ids.shape, cp.int32)
        slots, cpu = buffers[ids.shape]
        slots.set(ids)
        cpu.fill(-7)
        res.step(layer, slots, cpu, POLICIES[policy])
        np.testing.assert_array_equal(slots.get(), want)
        np.testing.assert_array_equal(cpu.get(), np.where(want < 0, ids, -1))
        got = res.snapshot()["fills"]
        np.testing.assert_array_equal(got[0], fills.slots)
        np.testing.assert_array_equal(got[1], fills.experts)
        for a, b in zip(_device_state(res), _state(spec)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_invalidate_and_count_kernels():
    cp = load_cupy()

    from freetoken.moe.residency_gpu import GpuResidency
    rng = np.random.default_rng(3)
    spec, res = SlotCache(3, 16, 20), GpuResidency(3, 16, 20)
    for layer, ids in routing(rng, 60, 3, 16, 4, 2):
        spec.step(layer, ids.copy(), FetchPolicy.fetch_all())
        res.step(layer, cp.asarray(ids), cp.empty(ids.shape, cp.int32), FetchPolicy.fetch_all())
    invalidate_mirror(spec, 2, 11)
    res.invalidate(2, 11)
    for a, b in zip(_device_state(res), _state(spec)):
        np.testing.assert_array_equal(a, b)
    ids = np.array([[1, 5, 5], [15, 1, 2]], np.int32)
    before = res.counters_host()
    res.count_routed(2, cp.asarray(ids), ("misses", "cpu_execs"))
    diff = res.counters_host() - before
    assert diff[2, COUNTERS.index("misses")] == diff[2, COUNTERS.index("cpu_execs")] == 4
    assert diff.sum() == 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_fill_and_prefill_copies(dtype):
    cp = load_cupy()

    from freetoken.moe.host_pool import pin_host_pool
    from freetoken.moe.residency_gpu import GpuResidency
    rng = np.random.default_rng(5)
    L, E, S, H, I = 2, 8, 20, 24, 12
    banks = [((rng.random((E, 2 * I, H)) * 100).astype(dtype), (rng.random((E, H, I)) * 100).astype(dtype))
             for _ in range(L)]
    with pin_host_pool(banks) as host:
        assert host.pinned
        res, pool = GpuResidency(L, E, S), (cp.zeros((S, 2 * I, H), dtype), cp.zeros((S, H, I), dtype))
        ids = np.array([[3, 6], [1, 3]], np.int32)
        res.step(1, cp.asarray(ids), cp.empty(ids.shape, cp.int32), FetchPolicy.fetch_all())
        res.fill(host.device_views(1), pool)
        slot_for = res.snapshot()["slot_for"]
        for e in (1, 3, 6):
            np.testing.assert_array_equal(pool[0][slot_for[1, e]].get(), banks[1][0][e])
            np.testing.assert_array_equal(pool[1][slot_for[1, e]].get(), banks[1][1][e])
        pool[0][int(slot_for[1, 3])] = 7                  # marks the resident copy
        res.load_layer(1, 0, E, host.device_views(1), pool, dst0=12, keep_lo=0)
        assert (pool[0][12 + 3].get() == 7).all()         # copied device to device
        for e in np.flatnonzero(slot_for[1] < 0):
            np.testing.assert_array_equal(pool[0][12 + e].get(), banks[1][0][e])
        np.testing.assert_array_equal(pool[1][12:20].get(), banks[1][1])


@pytest.mark.gpu
def test_quantized_copies_into_slots_a_stride_apart():
    """Layer 0 in Q4_K, layer 1 in Q6_K: the byte pool's slots are as wide as layer 1's experts, so
    layer 0's views are a stride apart from their rows; fills and prefill loads (from the host and
    from a resident slot) move each expert's bytes exactly, and nothing past them in the slot."""
    cp = load_cupy()

    from freetoken.kernels.qformats import random_blocks
    from freetoken.moe.host_pool import pin_host_pool
    from freetoken.moe.pool import Bank, slot_pool, slot_views
    from freetoken.moe.residency_gpu import GpuResidency
    rng = np.random.default_rng(6)
    E, S = 6, 16
    banks = [Bank(random_blocks(f, (E, 512), 256, rng), random_blocks(f, (E, 256), 256, rng)) for f in ("q4_k", "q6_k")]
    with pin_host_pool([(b.gate_up, b.down) for b in banks]) as host:
        res, pool = GpuResidency(2, E, S), slot_pool(cp, S, banks)
        pool[0].fill(0xAB)
        views = slot_views(pool, banks[0])
        assert views[0].strides[0] == pool[0].shape[1] > banks[0].gate_up[0].nbytes
        ids = np.array([[4, 1]], np.int32)
        res.step(0, cp.asarray(ids), cp.empty(ids.shape, cp.int32), FetchPolicy.fetch_all())
        res.fill(host.device_views(0), views)
        slot_for = res.snapshot()["slot_for"]
        for e in (1, 4):
            s = int(slot_for[0, e])
            np.testing.assert_array_equal(views[0][s].get(), banks[0].gate_up[e])
            np.testing.assert_array_equal(views[1][s].get(), banks[0].down[e])
            assert (pool[0][s, banks[0].gate_up[0].nbytes:].get() == 0xAB).all()     # the slack untouched
        res.load_layer(0, 0, E, host.device_views(0), views, dst0=8, keep_lo=0)
        for e in range(E):
            np.testing.assert_array_equal(views[0][8 + e].get(), banks[0].gate_up[e])
            np.testing.assert_array_equal(views[1][8 + e].get(), banks[0].down[e])


# --- the wrappers up to the launch, on numpy arrays (CPU) ----------------------------------------

def test_wrappers_bind_every_argument(monkeypatch):
    """GpuResidency's launches with numpy standing in for CuPy: every argument reaches the launch
    with the declared dtype or exact scalar type; grids are positive, blocks whole warps."""
    import sys

    from freetoken.kernels import _cuda
    from freetoken.moe import residency_gpu
    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setattr(residency_gpu, "load_cupy", lambda: np)   # the loader also wants cupyx
    launches = []
    monkeypatch.setattr(_cuda, "kernel", lambda name, entry, defines=(): (name, entry))
    monkeypatch.setattr(_cuda, "launch", lambda k, grid, block, args, shared_mem=0, touches=():
                        launches.append((k[1], grid, block, args, shared_mem)))
    L, E, S, H, I = 3, 16, 40, 24, 8
    res = residency_gpu.GpuResidency(L, E, S)
    ids = np.array([[1, 2], [3, 1]], np.int32)
    res.step(2, ids, np.empty_like(ids), FetchPolicy.fraction(0.3, min_fill=1))
    for dtype in (np.uint16, np.float32):
        host = (np.zeros((E, 2 * I, H), dtype), np.zeros((E, H, I), dtype))
        pool = (np.zeros((S, 2 * I, H), dtype), np.zeros((S, H, I), dtype))
        res.fill(host, pool)
        res.load_layer(1, 4, 9, host, pool, dst0=2 * E - 9, keep_lo=2 * E)
    res.invalidate(0, 2 * E)
    res.count_routed(0, ids, ("misses", "cpu_execs"))
    names = [entry for entry, *_ in launches]
    assert names == ["residency_step_i32", "fill_rows_bf16", "prefill_load_bf16", "fill_rows_f32",
                     "prefill_load_f32", "residency_invalidate_i32", "residency_count_i32"]
    for entry, grid, block, args, shared in launches:
        decl = residency_gpu.ARGS[entry]
        assert len(args) == len(decl)
        for item, a in zip(decl, args):
            tag = item.partition(":")[2]
            want = _cuda.POINTER_DTYPES.get(tag) or _cuda.SCALAR_TYPES[tag]
            assert (a.dtype if tag.endswith("*") else type(a)) == want, (entry, item)
        assert all(g > 0 for g in grid) and block[0] % 32 == 0 and shared <= 48 * 1024
    step = dict(zip((d.split(":")[0] for d in residency_gpu.ARGS["residency_step_i32"]), launches[0][3]))
    assert (step["P"], step["layer"], step["kind"], step["frac_q16"], step["min_fill"]) == (4, 2, 0, 19661, 1)
    rows = {entry: dict(zip((d.split(":")[0] for d in residency_gpu.ARGS[entry]), args))["rows"]
            for entry, _, _, args, _ in launches if "rows:i32" in residency_gpu.ARGS[entry]}
    assert rows == {"fill_rows_bf16": 4, "fill_rows_f32": 4, "prefill_load_bf16": 9, "prefill_load_f32": 9}
    assert launches[1][1] == (8,) and launches[2][1] == (18,)   # rows * 2 banks * 1 chunk
    assert launches[0][2] == (residency_gpu.RES_THREADS,) and launches[0][4] == 12 * E
