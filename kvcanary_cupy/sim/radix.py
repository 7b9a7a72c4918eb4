"""The prefix cache: :class:`RadixTree`, radix-style sharing of finished requests' slot paths, LRU eviction,
and the depth-first walk the sweep verifies. Sharing is per token, or per whole block of ``unit`` tokens for an
engine that allocates KV in blocks (a partially matching block is not shared)."""

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
        self.children: dict[int | bytes, RadixNode] = {}
        self.lock = 0
        self.last_use = 0
        self.uid = uid


class RadixTree:
    """A radix tree from key sequences to slot sequences: the prefix cache (a donor's prefix for later
    requests). Nodes on the path of a live request are locked; unlocked leaves are evicted LRU first.

    ``unit``: the sharing granularity in keys. With ``unit > 1`` (a block engine) every node starts and ends on
    a block boundary: matches and splits are rounded down to whole blocks, children are told apart by their
    whole first block, and :meth:`insert` takes whole blocks only."""

    def __init__(self, unit: int = 1) -> None:
        self.unit = unit
        self._uid = itertools.count()
        self.root = RadixNode(np.empty(0, np.int64), np.empty(0, np.int64), None, next(self._uid))
        self.root.lock = 1
        self.size = 0  # slots held

    def _edge(self, keys: np.ndarray, at: int) -> int | bytes:
        """The child key of the path continuing with ``keys[at:]``: its first key, or its first whole block."""
        if self.unit == 1:
            return int(keys[at])
        return np.ascontiguousarray(keys[at : at + self.unit], np.int64).tobytes()

    def _common_prefix(self, a: np.ndarray, b: np.ndarray) -> int:
        n = min(a.shape[0], b.shape[0])
        diff = np.flatnonzero(a[:n] != b[:n])
        common = int(diff[0]) if diff.shape[0] else n
        return common - common % self.unit

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        parent = child.parent
        assert parent is not None
        head = RadixNode(child.key[:at], child.slots[:at], parent, next(self._uid))
        head.lock, head.last_use = child.lock, child.last_use
        parent.children[self._edge(head.key, 0)] = head
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], head
        head.children[self._edge(child.key, 0)] = child
        return head

    def match(self, keys: np.ndarray, now: int) -> tuple[np.ndarray, RadixNode]:
        """Longest cached prefix of ``keys`` (whole blocks of ``unit`` keys): its slots and the node that ends
        exactly there."""
        node, i, parts = self.root, 0, []
        while i < keys.shape[0]:
            child = node.children.get(self._edge(keys, i))
            if child is None:
                break
            common = self._common_prefix(child.key, keys[i:])
            child.last_use = now
            if common < child.key.shape[0]:
                child = self._split(child, common)
            parts.append(child.slots)
            node, i = child, i + common
            if child.key.shape[0] != common:
                break
        slots = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return slots, node

    def cached_len(self, keys: np.ndarray) -> int:
        """How many leading ``keys`` the cache holds (what :meth:`insert` would find cached), touching nothing."""
        node, i = self.root, 0
        while i < keys.shape[0]:
            child = node.children.get(self._edge(keys, i))
            if child is None:
                break
            common = self._common_prefix(child.key, keys[i:])
            i += common
            if common < child.key.shape[0]:
                break
            node = child
        return i

    def insert(self, keys: np.ndarray, slots: np.ndarray, now: int) -> tuple[int, RadixNode]:
        """Add ``keys -> slots``; returns how many leading keys were cached already (their slots in
        ``slots`` are duplicates the caller frees) and the node that ends at the last key. ``keys`` holds whole
        blocks of ``unit`` keys."""
        assert keys.shape[0] % self.unit == 0, "the prefix cache takes whole blocks"
        node, i = self.root, 0
        while i < keys.shape[0]:
            child = node.children.get(self._edge(keys, i))
            if child is None:
                leaf = RadixNode(keys[i:].copy(), slots[i:].copy(), node, next(self._uid))
                leaf.last_use = now
                node.children[self._edge(keys, i)] = leaf
                self.size += leaf.slots.shape[0]
                return i, leaf
            common = self._common_prefix(child.key, keys[i:])
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

    def path_keys(self, node: RadixNode) -> np.ndarray:
        """The keys from the root through ``node`` (its whole prefix)."""
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return np.concatenate(parts[::-1]) if parts else np.empty(0, np.int64)

    def evict(self, want: int, release: Callable[[np.ndarray], None],
              on_evict: Callable[[RadixNode], None] | None = None) -> int:
        """Drop unlocked leaves, least recently used first, until ``want`` slots were released. ``on_evict``
        sees each leaf before its slots are released (a tiered cache writes it back)."""
        heap = [(n.last_use, n.uid, n) for n in self._nodes() if not n.children and n.lock == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < want and heap:
            _, _, node = heapq.heappop(heap)
            if on_evict is not None:
                on_evict(node)
            release(node.slots)
            freed += node.slots.shape[0]
            self.size -= node.slots.shape[0]
            parent = node.parent
            assert parent is not None
            del parent.children[self._edge(node.key, 0)]
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
