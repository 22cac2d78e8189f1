"""Radix prefix cache over token ids: shares KV slots between requests and across turns.

Token granular (one KV slot per token). A node's edge holds token ids and their KV slots.
Requests lock the path they reuse; unlocked leaves are evicted least recently used first.
Pure Python; the KV pool owns the slots, this tree only holds references to them.
"""
from __future__ import annotations

import heapq
import itertools


class Node:
    __slots__ = ("key", "slots", "children", "parent", "ref", "last_used", "checkpoint")

    def __init__(self, key: list[int], slots: list[int], parent: "Node | None"):
        self.key, self.slots, self.parent = key, slots, parent
        self.children: dict[int, Node] = {}
        self.ref = 0              # requests whose reused prefix runs through this node
        self.last_used = 0
        self.checkpoint = None    # the request state after this node's last token (GDN, windows: checkpoints.py)


class RadixCache:
    def __init__(self, checkpoints=None):
        self.checkpoints = checkpoints   # the state CheckpointPool (GDN, windows): evicted nodes drop theirs
        self.root = Node([], [], None)
        self.root.ref = 1         # never evicted
        self._clock = itertools.count(1)
        self.evictable_size = 0   # tokens in unlocked nodes
        self.protected_size = 0   # tokens in locked nodes

    @property
    def size(self) -> int:
        return self.evictable_size + self.protected_size

    def match(self, tokens: list[int]) -> tuple[list[int], Node]:
        """Longest cached prefix of tokens: (its KV slots, the node where it ends)."""
        node, slots, i, now = self.root, [], 0, next(self._clock)
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = _common(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_used = now
            slots.extend(child.slots)
            node, i = child, i + n
        return slots, node

    def insert(self, tokens: list[int], slots: list[int]) -> list[int]:
        """Cache tokens with their KV slots; returns the caller's slots that duplicate cached ones
        (same tokens already held under other slots), which the caller must free."""
        node, i, dups, now = self.root, 0, [], next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = Node(list(tokens[i:]), list(slots[i:]), node)
                leaf.last_used = now
                node.children[tokens[i]] = leaf
                self.evictable_size += len(leaf.key)
                break
            n = _common(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            dups.extend(s for s, c in zip(slots[i:i + n], child.slots) if s != c)
            child.last_used = now
            node, i = child, i + n
        return dups

    def match_resumable(self, tokens: list[int]) -> tuple[list[int], Node]:
        """The longest cached prefix of tokens that ends at a node holding a state checkpoint
        (a GDN model can resume only there): (its KV slots, that node; the root when none)."""
        slots, end = self.match(tokens)
        path, node = [], end
        while node is not self.root:
            path.append(node)
            node = node.parent
        depth = len(slots)
        for node in path:                      # deepest first
            if node.checkpoint is not None:
                return slots[:depth], node
            depth -= len(node.key)
        return [], self.root

    def node_at(self, tokens: list[int]) -> Node | None:
        """The node ending exactly after tokens (splitting an edge there), or None when the tree
        does not hold all of them."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return None
            n = _common(child.key, tokens[i:])
            if n < len(child.key):
                if i + n < len(tokens):
                    return None
                child = self._split(child, n)
            node, i = child, i + n
        return node if node is not self.root else None

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.ref -= 1
            assert node.ref >= 0, "radix node unlocked more often than locked"
            if node.ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> list[int]:
        """Free at least num_tokens tokens (or all evictable ones) from unlocked leaves, LRU first;
        returns their slots."""
        heap = [(n.last_used, id(n), n) for n in self._leaves() if n.ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            freed.extend(leaf.slots)
            if leaf.checkpoint is not None:
                self.checkpoints.drop(leaf.checkpoint)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def _split(self, child: Node, n: int) -> Node:
        """Cut child's edge after n tokens; returns the new upper node (child keeps the tail)."""
        upper = Node(child.key[:n], child.slots[:n], child.parent)
        upper.ref, upper.last_used = child.ref, child.last_used
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        return upper

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                yield node
            stack.extend(node.children.values())

    def all_slots(self) -> list[int]:
        """Every slot the tree references (for invariant checks)."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.slots)
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        """Invariants: sizes add up, children keyed by their first token, refs >= children's."""
        evictable = protected = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.key and child.key[0] == first and child.parent is node
                assert len(child.key) == len(child.slots)
                assert node is self.root or node.ref >= child.ref
                stack.append(child)
            if node is not self.root:
                if node.ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
        assert (evictable, protected) == (self.evictable_size, self.protected_size)
        slots = self.all_slots()
        assert len(slots) == len(set(slots)), "a KV slot is referenced twice"


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
