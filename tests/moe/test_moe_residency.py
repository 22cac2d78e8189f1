"""SlotCache: the residency step (docs/design.md), checked by invariants over random sequences, at
every cache size from one slot up (q is bounded by the evictable slots; the rest runs on the CPU)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.moe.residency import COUNTERS, SlotCache
from freetoken.moe.split import FetchPolicy


def check_tables(c: SlotCache):
    """slot_for and owner_of are inverse maps."""
    for s, o in enumerate(c.owner_of):
        if o >= 0:
            assert c.slot_for[o // c.E, o % c.E] == s
    layer, expert = np.nonzero(c.slot_for >= 0)
    assert np.array_equal(c.owner_of[c.slot_for[layer, expert]], layer * c.E + expert)
    assert len(layer) == np.count_nonzero(c.owner_of >= 0)


def checked_step(c: SlotCache, layer, ids, policy):
    """One step with every per-step property asserted against a snapshot of the state before."""
    before = dict(slot_for=c.slot_for.copy(), owner=c.owner_of.copy(), usage=c.usage.copy(),
                  recency=c.recency.copy(), counters={k: v.copy() for k, v in c.counters.items()})
    raw = ids.copy()
    fills = c.step(layer, ids, policy)
    routed = list(dict.fromkeys(raw.ravel().tolist()))
    hit_slots = {int(before["slot_for"][layer, e]) for e in routed if before["slot_for"][layer, e] >= 0}
    misses = sorted((e for e in routed if before["slot_for"][layer, e] < 0),
                    key=lambda e: policy.miss_key(int(before["recency"][layer, e]), e))
    q = min(policy.count(len(misses)), c.S - len(hit_slots))    # bounded by the evictable slots
    assert fills.experts.tolist() == misses[:q]
    assert len(set(fills.slots.tolist())) == q                  # no slot assigned twice in a step
    # victims: the q smallest (usage, slot) among slots no routed expert of this layer owned
    protected = set(hit_slots)
    candidates = sorted((int(before["usage"][s]), s) for s in range(c.S) if s not in protected)
    assert fills.slots.tolist() == [s for _, s in candidates[:q]]
    for s in hit_slots:                       # a slot routed in this layer-step is never evicted
        assert c.owner_of[s] == before["owner"][s] and c.usage[s] == c.clock
    # rewritten ids: a slot owned by that (layer, expert), or -1 for the misses left to the CPU
    for r, s in zip(raw.ravel(), ids.ravel()):
        assert (s == -1 and r in misses[q:]) or (s >= 0 and c.owner_of[s] == layer * c.E + r)
    resident = set(ids[ids >= 0].tolist())
    assert len(resident) == len(routed) - (len(misses) - q)
    delta = {k: int(c.counters[k][layer] - before["counters"][k][layer]) for k in COUNTERS}
    emptied = sum(before["owner"][s] < 0 for s in fills.slots)
    assert delta == dict(hits=len(hit_slots), misses=len(misses), fills=q,
                         cpu_execs=len(misses) - q, evictions=q - emptied)
    assert delta["hits"] + delta["misses"] == len(routed)
    assert delta["fills"] + delta["cpu_execs"] == delta["misses"]
    assert all(c.recency[layer, e] == c.clock for e in routed)
    check_tables(c)


orders = st.sampled_from(["recency", "lowest_id"])
policies = st.one_of(
    st.builds(FetchPolicy.fraction, st.floats(0.0, 1.2), st.integers(0, 1), orders),
    st.builds(FetchPolicy.fixed_cap, st.integers(0, 5), st.integers(0, 1), orders),
    st.builds(FetchPolicy.fetch_all, orders))


@settings(max_examples=80, deadline=None)
@given(L=st.integers(1, 4), E=st.integers(2, 12), k=st.integers(1, 4), T=st.integers(1, 3),
       S=st.integers(1, 16), policy=policies, seed=st.integers(0, 2**31), steps=st.integers(1, 150))
def test_invariants_over_random_sequences(L, E, k, T, S, policy, seed, steps):
    """Any S from 1 up, also below one step's distinct experts (then some misses run on the CPU)."""
    k = min(k, E)
    rng = np.random.default_rng(seed)
    c = SlotCache(L, E, S)
    for n in range(steps):
        layer = int(rng.integers(L)) if seed % 2 else n % L       # random or cyclic layer order
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
        checked_step(c, layer, ids, policy)
    tot = {k_: int(v.sum()) for k_, v in c.counters.items()}
    assert tot["hits"] + tot["misses"] <= steps * T * k
    assert tot["fills"] + tot["cpu_execs"] == tot["misses"]
    assert tot["evictions"] <= tot["fills"] and c.clock == steps


def test_global_lru_across_layers():
    """The victim is the least recently used slot of any layer, not of the calling layer."""
    c, fetch = SlotCache(num_layers=2, num_experts=4, num_slots=3), FetchPolicy.fetch_all()
    for layer, e in [(0, 0), (1, 0), (0, 1)]:               # clocks 1, 2, 3 -> slots 0, 1, 2
        c.step(layer, np.array([[e]], np.int32), fetch)
    ids = np.array([[2]], np.int32)
    fills = c.step(1, ids, fetch)                           # layer 1 evicts layer 0's expert 0
    assert fills.slots.tolist() == [0] and ids.tolist() == [[0]]
    assert c.slot_for[0, 0] == -1 and c.owner_of.tolist() == [1 * 4 + 2, 1 * 4 + 0, 0 * 4 + 1]
    c.step(1, np.array([[0]], np.int32), fetch)             # a hit refreshes (1,0): clock 5
    fills = c.step(0, np.array([[3]], np.int32), fetch)     # LRU now (0,1) at clock 3, slot 2
    assert fills.slots.tolist() == [2] and c.counters["evictions"].tolist() == [1, 1]


def test_miss_order_prefers_recently_routed_then_lower_id():
    c = SlotCache(1, 8, 4)
    cpu = FetchPolicy.fixed_cap(0)
    c.step(0, np.array([[5, 6]], np.int32), cpu)            # routed, run on the CPU, not cached
    fills = c.step(0, np.array([[1, 6, 2, 5]], np.int32), FetchPolicy.fixed_cap(3))
    assert fills.experts.tolist() == [5, 6, 1]              # recency desc, then id asc


def test_lowest_id_order_ignores_recency():
    c = SlotCache(1, 8, 4)
    c.step(0, np.array([[5, 6]], np.int32), FetchPolicy.fixed_cap(0, order="lowest_id"))
    ids = np.array([[1, 6, 2, 5]], np.int32)
    fills = c.step(0, ids, FetchPolicy.fixed_cap(3, order="lowest_id"))
    assert fills.experts.tolist() == [1, 2, 5] and fills.slots.tolist() == [0, 1, 2]
    assert ids.tolist() == [[0, -1, 1, 2]]                  # 6 (recently routed) left to the CPU
    assert c.counters["cpu_execs"].tolist() == [3]


def test_order_validation():
    with pytest.raises(ValueError, match="order"):
        FetchPolicy("all", order="fifo")
    assert "lowest_id" in FetchPolicy.fraction(0.5, order="lowest_id").describe()
    assert "order" not in FetchPolicy.fraction(0.5).describe()


def test_fill_order_and_rewrite_with_duplicates():
    c = SlotCache(2, 6, 6)
    ids = np.array([[3, 1], [1, 4]], np.int32)
    fills = c.step(1, ids, FetchPolicy.fetch_all())
    assert fills.experts.tolist() == [1, 3, 4] and fills.slots.tolist() == [0, 1, 2]
    assert ids.tolist() == [[1, 0], [0, 2]]


def test_phi_zero_never_fills_and_rewrites_all_to_cpu():
    c, rng = SlotCache(3, 8, 8), np.random.default_rng(1)
    for n in range(100):
        ids = rng.integers(0, 8, (2, 3)).astype(np.int32)
        assert len(c.step(n % 3, ids, FetchPolicy.fraction(0.0))) == 0
        assert (ids == -1).all()
    assert c.counters["fills"].sum() == 0 and (c.owner_of == -1).all()


def test_one_slot_serves_a_step_of_many_experts():
    """S = 1 < 4 distinct: the one slot takes the first miss, the other three run on the CPU."""
    c = SlotCache(2, 8, 1)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    fills = c.step(0, ids, FetchPolicy.fetch_all())
    assert fills.slots.tolist() == [0] and fills.experts.tolist() == [0]
    assert ids.tolist() == [[0, -1], [-1, -1]]
    ids = np.array([[0, 4]], np.int32)                      # 0 is a hit and pins the only slot
    assert len(c.step(0, ids, FetchPolicy.fetch_all())) == 0 and ids.tolist() == [[0, -1]]
    ids = np.array([[5]], np.int32)                          # another layer evicts it
    assert c.step(1, ids, FetchPolicy.fixed_cap(1)).slots.tolist() == [0] and ids.tolist() == [[0]]
    assert c.slot_for[0, 0] == -1 and c.owner_of.tolist() == [1 * 8 + 5]
    got = {k: c.counters[k].tolist() for k in COUNTERS}
    assert got == dict(hits=[1, 0], misses=[5, 1], fills=[1, 1], cpu_execs=[4, 0], evictions=[0, 1])


def test_hits_pin_their_slots_so_fills_are_bounded():
    """3 slots, 2 of them hits in this step: a policy asking for 3 fills gets the 1 free slot."""
    c = SlotCache(1, 8, 3)
    c.step(0, np.array([[0, 1, 2]], np.int32), FetchPolicy.fetch_all())
    ids = np.array([[0, 1, 5, 6, 7]], np.int32)
    fills = c.step(0, ids, FetchPolicy.fixed_cap(3, order="lowest_id"))
    assert fills.experts.tolist() == [5] and fills.slots.tolist() == [2]
    assert ids.tolist() == [[0, 1, 2, -1, -1]]
    assert c.counters["fills"].tolist() == [4] and c.counters["cpu_execs"].tolist() == [2]


def test_bad_ids_leave_state_untouched():
    c = SlotCache(2, 8, 3)
    with pytest.raises(ValueError):
        c.step(0, np.array([[0, 8]], np.int32), FetchPolicy.fetch_all())
    with pytest.raises(TypeError):
        c.step(0, np.array([[0, 1]], np.int64), FetchPolicy.fetch_all())
    with pytest.raises(IndexError):
        c.step(2, np.array([[0, 1]], np.int32), FetchPolicy.fetch_all())
    assert c.clock == 0 and (c.owner_of == -1).all() and (c.recency == -1).all()


def test_reset_is_cold():
    c = SlotCache(2, 4, 4)
    c.step(1, np.array([[0, 1]], np.int32), FetchPolicy.fetch_all())
    c.reset()
    assert c.clock == 0 and (c.slot_for == -1).all() and (c.owner_of == -1).all()
    assert (c.recency == -1).all() and (c.usage == 0).all()
    assert all((v == 0).all() for v in c.counters.values())
