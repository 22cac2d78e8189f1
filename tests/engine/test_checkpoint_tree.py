"""The checkpoint pool and the radix tree together, under random operation sequences
(hypothesis): however inserts, checkpoint links, demotion from the device tier, LRU eviction by
budget and KV eviction interleave, no node points at a freed checkpoint, no checkpoint points at
a gone node, each tier's budget holds, counters add up, and a resumable match ends at a node that
has a checkpoint. numpy stands in for the device (ops=None), so both tiers are host arrays here."""
import numpy as np
from hypothesis import example, given, settings, strategies as st

from freetoken.engine.checkpoints import CheckpointPool
from freetoken.engine.radix import RadixCache
from freetoken.engine.state_pool import StatePool

STATES = StatePool(num_layers=2, rows=4, conv_dim=5, kernel=4, value_heads=2, key_dim=3, value_dim=3)
ONE = STATES.conv[:, 0].nbytes + STATES.rule[:, 0].nbytes
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)
ops = st.lists(st.one_of(st.tuples(st.just("insert"), seqs), st.tuples(st.just("link"), seqs, st.integers(1, 12)),
                         st.tuples(st.just("evict"), st.integers(1, 20)), st.tuples(st.just("match"), seqs)),
               max_size=40)


def tree_nodes(tree):
    stack, out = [tree.root], []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def check(tree, pool):
    nodes = tree_nodes(tree)
    linked = [n.checkpoint for n in nodes if n.checkpoint is not None]
    assert all(c.node.checkpoint is c for c in linked)
    assert sorted(map(id, linked)) == sorted(map(id, pool.linked()))
    assert all(c.node in nodes for c in pool.linked())
    for name, tier in pool.tiers.items():
        assert all(c.tier == name for c in tier.lru.values())
        assert tier.bytes == sum(c.nbytes for c in tier.lru.values()) <= tier.budget
    assert pool.device_held == pool.tiers["device"].bytes      # nothing pending between operations
    assert pool.tiers["host"].bytes + len(pool._spare) * ONE <= pool.tiers["host"].budget   # reused buffers too
    c = pool.counters
    assert c.taken == len(pool) + c.evicted + c.dropped      # every one taken is live, evicted or dropped


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 4), st.integers(0, 3))
@example(sequence=[("insert", [0]), ("link", [0], 1), ("link", [0], 1)], capacity=1, device=0)   # found once:
# linking one node twice kept the replaced buffer as a spare beside the new one (264 + 264 > 264)
def test_random_operations_keep_every_link_valid(sequence, capacity, device):
    pool = CheckpointPool(capacity * ONE, device * ONE)
    tree, next_slot = RadixCache(pool), [0]
    for op in sequence:
        if op[0] == "insert":
            slots = list(range(next_slot[0], next_slot[0] + len(op[1])))
            next_slot[0] += len(op[1])
            tree.insert(op[1], slots)
        elif op[0] == "link":
            node = tree.node_at(op[1][:op[2]])
            ckpt = pool.take(STATES, 0, min(op[2], len(op[1])))
            if ckpt is None:
                assert capacity == device == 0
            elif node is None:
                pool.discard(ckpt)                  # never linked, as resume.py does
            else:
                pool.link(ckpt, node)               # a checkpoint it replaces counts as dropped
        elif op[0] == "evict":
            tree.evict(op[1])
        else:
            slots, node = tree.match_resumable(op[1])
            assert (node is tree.root) == (not slots)
            assert node is tree.root or node.checkpoint is not None
        tree.check()
        check(tree, pool)


def test_the_device_tier_demotes_its_oldest_to_the_host_and_both_restore():
    """New checkpoints go to the device tier while it has room; a full device tier demotes its
    least recently used one to the host (same contents), and restoring from either tier gives
    back the state it was taken from."""
    rng = np.random.default_rng(0)
    states = StatePool(num_layers=2, rows=4, conv_dim=5, kernel=4, value_heads=2, key_dim=3, value_dim=3)
    states.conv[...] = rng.standard_normal(STATES.conv.shape, np.float32)
    states.rule[...] = rng.standard_normal(STATES.rule.shape, np.float32)
    pool, tree = CheckpointPool(2 * ONE, 2 * ONE), RadixCache()
    tree.checkpoints = pool
    tree.insert([0, 1, 2, 3], [0, 1, 2, 3])
    taken = []
    for position in (1, 2, 3):
        states.conv[:, 0] += 1.0                      # a different state each time
        ckpt = pool.take(states, 0, position)
        assert ckpt.tier == "device"                 # room is made by demoting, not by refusing
        taken.append((ckpt, states.conv[:, 0].copy(), states.rule[:, 0].copy()))
        pool.link(ckpt, tree.node_at([0, 1, 2, 3][:position]))
    assert [c.tier for c, _, _ in taken] == ["host", "device", "device"] and pool.counters.demoted == 1
    for ckpt, conv, rule in taken:
        pool.restore(ckpt, states, 1)
        np.testing.assert_array_equal(states.conv[:, 1], conv)
        np.testing.assert_array_equal(states.rule[:, 1], rule)
    check(tree, pool)
    pending = pool.take(states, 0, 4)                 # device full of linked ones: demote again
    assert pending.tier == "device" and pool.counters.demoted == 2 and pool.device_held == 2 * ONE
    pool.discard(pending)
    assert pool.device_held == ONE and pool.counters.dropped == 1 and len(pool.tiers["host"].lru) == 2
    check(tree, pool)


def test_kept_checkpoints_are_evicted_last_within_their_share():
    """The host tier evicts least recently used first but passes over kept ones (query ends)
    while they hold at most KEEP_SHARE of its budget; past that share they go like any other."""
    from freetoken.engine.checkpoints import KEEP_SHARE
    pool, tree = CheckpointPool(8 * ONE), RadixCache()
    tree.checkpoints = pool
    tree.insert(list(range(20)), list(range(20)))
    ids = list(range(20))
    for p in range(1, 13):
        ckpt = pool.take(STATES, 0, p)
        ckpt.keep = p in (1, 2, 3)                     # three kept: more than 8 * KEEP_SHARE = 2
        pool.link(ckpt, tree.node_at(ids[:p]))
    alive = sorted(c.position for c in pool.linked())
    assert len(alive) == 8 and KEEP_SHARE * 8 == 2
    assert alive == [2, 3, 7, 8, 9, 10, 11, 12]        # 1 went when the kept ones were over their share
    check(tree, pool)
