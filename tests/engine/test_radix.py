"""Radix prefix cache: unit cases and random operation sequences (hypothesis)."""
from hypothesis import given, settings, strategies as st

from freetoken.engine.kv_pool import KVPool
from freetoken.engine.radix import RadixCache


def test_match_insert_split_and_dups():
    c = RadixCache()
    assert c.insert([1, 2, 3, 4], [10, 11, 12, 13]) == []
    slots, node = c.match([1, 2, 9])
    assert slots == [10, 11] and node.key == [1, 2]          # split at the divergence
    assert c.insert([1, 2, 3, 5], [20, 21, 22, 23]) == [20, 21, 22]
    assert c.match([1, 2, 3, 5, 6])[0] == [10, 11, 12, 23]
    c.check()


def test_locked_paths_survive_eviction_and_lru_order():
    c = RadixCache()
    c.insert([1, 2], [1, 2])
    c.insert([3, 4], [3, 4])
    c.insert([5, 6], [5, 6])
    c.match([1, 2])                                           # touch: [3,4] is now oldest
    _, locked = c.match([5, 6])
    c.lock(locked)
    assert c.evict(1) == [3, 4]
    assert sorted(c.evict(10)) == [1, 2]                      # [5, 6] is locked
    c.unlock(locked)
    assert c.evict(10) == [5, 6] and c.size == 0
    c.check()


def test_evict_cascades_to_parents():
    c = RadixCache()
    c.insert([1, 2, 3], [1, 2, 3])
    c.insert([1, 2, 4], [1, 2, 4])
    assert sorted(c.evict(100)) == [1, 2, 3, 4]
    c.check()


ops = st.lists(st.tuples(st.sampled_from(["req", "evict"]),
                         st.lists(st.integers(0, 3), min_size=1, max_size=12),
                         st.integers(1, 8)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_requests_conserve_slots(sequence):
    """Simulate requests that reuse a prefix, compute the rest, and finish (insert + unlock)."""
    pool, cache = KVPool(1, 256, 1, 1, "float32"), RadixCache()
    for op, tokens, n in sequence:
        if op == "evict":
            pool.free(cache.evict(n))
        else:
            slots, node = cache.match(tokens[:-1])
            cache.lock(node)
            short = len(tokens) - len(slots) - pool.num_free
            if short > 0:
                pool.free(cache.evict(short))
            mine = slots + pool.alloc(len(tokens) - len(slots))
            pool.free(cache.insert(tokens, mine))
            cache.unlock(node)
        cache.check()
        held = cache.all_slots()
        assert pool.num_free + len(held) == pool.num_slots
        assert not set(held) & set(pool._free)
