"""The prefix cache: :class:`RadixTree`, radix-style sharing of finished requests' slot paths, LRU eviction,
and the depth-first walk the sweep verifies."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import numpy as np


class RadixNode:
    __slots__ = ("children", "key", "last_use", "lock", "parent", "slots", "uid")

    def __init__(self, key: np.ndarray, slots: np.ndarray, parent: RadixNode | None, uid: int) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock = 0
        self.last_use = 0
        self.uid = uid


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.shape[0] else n


class RadixTree:
    """A radix tree from key sequences to slot sequences: the prefix cache (a donor's prefix for later
    requests). Nodes on the path of a live request are locked; unlocked leaves are evicted LRU first."""

    def __init__(self) -> None:
        self._uid = itertools.count()
        self.root = RadixNode(np.empty(0, np.int64), np.empty(0, np.int64), None, next(self._uid))
        self.root.lock = 1
        self.size = 0  # slots held

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        parent = child.parent
        assert parent is not None
        head = RadixNode(child.key[:at], child.slots[:at], parent, next(self._uid))
        head.lock, head.last_use = child.lock, child.last_use
        parent.children[int(head.key[0])] = head
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], head
        head.children[int(child.key[0])] = child
        return head

    def match(self, keys: np.ndarray, now: int) -> tuple[np.ndarray, RadixNode]:
        """Longest cached prefix of ``keys``: its slots and the node that ends exactly there."""
        node, i, parts = self.root, 0, []
        while i < keys.shape[0]:
            child = node.children.get(int(keys[i]))
            if child is None:
                break
            common = _common_prefix(child.key, keys[i:])
            child.last_use = now
            if common < child.key.shape[0]:
                child = self._split(child, common)
            parts.append(child.slots)
            node, i = child, i + common
            if child.key.shape[0] != common:
                break
        slots = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return slots, node

    def insert(self, keys: np.ndarray, slots: np.ndarray, now: int) -> tuple[int, RadixNode]:
        """Add ``keys -> slots``; returns how many leading keys were cached already (their slots in
        ``slots`` are duplicates the caller frees) and the node that ends at the last key."""
        node, i = self.root, 0
        while i < keys.shape[0]:
            child = node.children.get(int(keys[i]))
            if child is None:
                leaf = RadixNode(keys[i:].copy(), slots[i:].copy(), node, next(self._uid))
                leaf.last_use = now
                node.children[int(keys[i])] = leaf
                self.size += leaf.slots.shape[0]
                return i, leaf
            common = _common_prefix(child.key, keys[i:])
            child.last_use = now
            if common < child.key.shape[0]:
                child = self._split(child, common)
            node, i = child, i + common
        return i, node

    def lock(self, node: RadixNode, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            node = node.parent  # type: ignore[assignment]

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, want: int, release: Callable[[np.ndarray], None]) -> int:
        """Drop unlocked leaves, least recently used first, until ``want`` slots were released."""
        heap = [(n.last_use, n.uid, n) for n in self._nodes() if not n.children and n.lock == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < want and heap:
            _, _, node = heapq.heappop(heap)
            release(node.slots)
            freed += node.slots.shape[0]
            self.size -= node.slots.shape[0]
            parent = node.parent
            assert parent is not None
            del parent.children[int(node.key[0])]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_use, parent.uid, parent))
        return freed

    def walk(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Depth-first ``(slot, position = depth + j, prev slot)`` of every cached slot (prev −1 at the root),
        the sweep's verify entries (SPEC §7.3)."""
        slots, positions, prevs = [], [], []
        stack = [(child, 0, -1) for child in reversed(list(self.root.children.values()))]
        while stack:
            node, depth, prev = stack.pop()
            n = node.slots.shape[0]
            slots.append(node.slots)
            positions.append(depth + np.arange(n, dtype=np.int64))
            prevs.append(np.concatenate([np.array([prev], np.int64), node.slots[:-1]]))
            last = int(node.slots[-1])
            stack.extend((child, depth + n, last) for child in reversed(list(node.children.values())))
        if not slots:
            empty = np.empty(0, np.int64)
            return empty, empty, empty
        return np.concatenate(slots), np.concatenate(positions), np.concatenate(prevs)
