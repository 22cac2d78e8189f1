"""The checkpoint pool and the radix tree together, under random operation sequences
(hypothesis): however inserts, checkpoint links, LRU eviction by budget and KV eviction
interleave, no node points at a freed checkpoint, no checkpoint points at a gone node, the
budget holds, counters add up, and a resumable match ends at a node that has a checkpoint."""
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings, strategies as st

from freetoken.engine.checkpoints import CheckpointPool
from freetoken.engine.radix import RadixCache

STATES = SimpleNamespace(conv=np.zeros((2, 4, 3, 5), np.float32), rule=np.zeros((2, 4, 2, 3, 3), np.float32))
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
    assert sorted(map(id, linked)) == sorted(pool._lru)
    assert all(c.node in nodes for c in pool._lru.values())
    assert pool.bytes == sum(c.nbytes for c in linked) <= pool.budget
    c = pool.counters
    assert c.taken == len(pool) + c.evicted + c.dropped      # every one taken is live, evicted or dropped


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(1, 4))
def test_random_operations_keep_every_link_valid(sequence, capacity):
    pool = CheckpointPool(capacity * ONE, np.asarray, np.asarray)
    tree, next_slot = RadixCache(pool), [0]
    for op in sequence:
        if op[0] == "insert":
            slots = list(range(next_slot[0], next_slot[0] + len(op[1])))
            next_slot[0] += len(op[1])
            tree.insert(op[1], slots)
        elif op[0] == "link":
            node = tree.node_at(op[1][:op[2]])
            ckpt = pool.take(STATES, 0, min(op[2], len(op[1])))
            if node is None:
                pool.counters.dropped += 1          # never linked: counted as dropped, as resume.py does
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
