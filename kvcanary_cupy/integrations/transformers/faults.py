"""Faults injected into transformers' real KV cache, allocator and batch, at the canary's hook points.

Each injector is a :class:`~.hooks.StepObserver` armed at a step; it fires once, at the first step from then
on where it finds a target, and records what it did (:class:`InjectedFault`). The names follow the simulator's
fault vocabulary where the bug is the same:

* ``kv-bitflip`` -- one bit of a live request's K or V row flipped in ``PagedAttentionCache.cache_tensor``
  (within the first 16 bytes of the row, so PARTIAL hashing sees it), after the step that wrote it;
* ``block-table`` -- a live request's block-table entry (``allocator.block_table``) redirected to another
  block for one step (the block-table analogue of the simulator's ``req-to-token``); the engine reads the
  foreign block in that step, then the entry is put back;
* ``kv-write-skip`` -- one layer's K/V write of one token sent to the engine's write-trash slot (the write
  never reaches its slot);
* ``kv-misdirect`` -- one layer's K/V write of one token sent into a slot another live request still reads;
* ``wrong-token`` -- a token id in the forward's ``input_ids`` replaced by another id;
* ``double-alloc`` -- a block a live request still holds is handed out again by the cache pool on its next
  allocation;
* ``copy-corrupt`` -- a block copy of the engine (``copy_blocks``, when it forks a request) delivers a block
  whose bytes differ from the source's in one bit: the copy path's analogue of an offload/restore returning
  different bytes. There is no offload/restore fault itself: transformers' CPU offloading needs pinned memory,
  which CPU-only torch refuses, so that engine path does not run here (soft resets, which re-prefill, do run).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

FAULT_KINDS: dict[str, str] = {
    "kv-bitflip": "a bit flips in a live request's K or V bytes in the cache tensor",
    "block-table": "a live request's block-table entry points at another block for a step",
    "kv-write-skip": "one layer's K/V write of a token lands in the write-trash slot instead of its own",
    "kv-misdirect": "one layer's K/V write of a token lands in a slot another live request reads",
    "wrong-token": "the forward receives a wrong token id",
    "double-alloc": "the pool hands out a block that a live request still holds",
    "copy-corrupt": "a block copy (a forked request's pages) delivers one bit different from its source",
}


@dataclass
class InjectedFault:
    kind: str
    step: int  # the engine step (canary step index) in which the fault takes effect
    group: str
    request: str
    position: int | None
    slot: int | None
    detail: str


def _continuing(future: Any, margin: int = 3) -> bool:
    """A request that decodes and still has ``margin`` tokens to go (so its next steps verify the fault)."""
    state = future.state
    limit = state.max_new_tokens if state.max_new_tokens is not None else 1 << 30
    return int(future.query_length) == 1 and limit - len(state.generated_tokens) >= margin


class Injector:
    """Base: armed at ``at``, fires once; subclasses override the hook they need."""

    kind = ""

    def __init__(self, at: int, seed: int = 0) -> None:
        self.at = at
        self.rng = np.random.default_rng(seed)
        self.fault: InjectedFault | None = None
        self._requests: list[Any] = []
        self._cu: np.ndarray | None = None

    @property
    def armed(self) -> bool:
        return self.fault is None

    def before_batch(self, canary: Any, step: int, kwargs: dict[str, Any], requests: list[Any], cache: Any) -> None:
        self._requests = requests
        self._cu = kwargs["cu_seq_lens_q"].detach().to("cpu").numpy()[: len(requests) + 1].astype(np.int64)

    def on_layer_write(self, canary: Any, step: int, allocator: Any, layer_idx: int, write_index: Any) -> Any:
        return write_index

    def after_forward(self, canary: Any, step: int, batch: Any, cache: Any) -> None:
        return None

    def close(self) -> None:
        """Undo whatever is still patched into the engine (the run is over)."""

    def _target_group(self, canary: Any, cache: Any, sliding: bool = False) -> Any:
        geos = canary.states[id(cache)].geos
        for geo in geos:
            if bool(geo.window) == sliding:
                return geo
        return geos[0]


class KvBitflip(Injector):
    kind = "kv-bitflip"

    def after_forward(self, canary: Any, step: int, batch: Any, cache: Any) -> None:
        if not self.armed or step < self.at:
            return
        geos = canary.states[id(cache)].geos
        geo = geos[int(self.rng.integers(len(geos)))]  # any attention group, sliding windows included
        for i, future in enumerate(self._requests):
            total = int(batch.prefix_lens[i] + batch.extend_lens[i])
            if not _continuing(future) or total < 2:
                continue
            # a position the next step still verifies (a sliding window drops one more position per step)
            first_live = max(0, total + 1 - geo.window) if geo.window else 0
            pos = int(self.rng.integers(first_live, total - 1))
            slot = batch.slot(geo, i, pos)
            layer = int(self.rng.integers(len(geo.layer_indices)))
            kv = int(self.rng.integers(2))
            byte = (slot + (2 * layer + kv) * geo.page_size) * geo.row_bytes + int(self.rng.integers(16))
            bit = int(self.rng.integers(8))
            flat = cache.cache_tensor
            flat[byte] = int(flat[byte]) ^ (1 << bit)
            self.fault = InjectedFault(self.kind, step + 1, geo.name, batch.request_ids[i], pos, slot,
                                       f"bit {bit} of byte {byte} ({'KV'[kv]} of layer "
                                       f"{geo.layer_indices[layer]}) flipped")
            return


class BlockTableRedirect(Injector):
    kind = "block-table"

    def __init__(self, at: int, seed: int = 0) -> None:
        super().__init__(at, seed)
        self._undo: tuple[Any, str, int, int] | None = None

    def close(self) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._undo is not None:
            allocator, rid, k, block = self._undo
            table = allocator.block_table.get(rid)
            if table is not None and k < len(table):
                table[k] = block
            self._undo = None

    def after_forward(self, canary: Any, step: int, batch: Any, cache: Any) -> None:
        if self._undo is not None:  # the redirected step has run: put the entry back
            self._restore()
            return
        if not self.armed or step < self.at:
            return
        geo = self._target_group(canary, cache)
        allocator = geo.allocator
        for i, future in enumerate(self._requests):
            rid = batch.request_ids[i]
            total = int(batch.prefix_lens[i] + batch.extend_lens[i])
            table = allocator.block_table.get(rid, [])
            if not _continuing(future) or geo.window or total < 2 * geo.page_size or not table:
                continue
            foreign = self._foreign_block(allocator, batch, rid, geo)
            if foreign is None:
                continue
            self._undo = (allocator, rid, 0, table[0])
            self.fault = InjectedFault(self.kind, step + 1, geo.name, rid, 0, table[0] * geo.stride,
                                       f"block_table[{rid}][0] = {table[0]} redirected to block {foreign}")
            table[0] = foreign
            return

    @staticmethod
    def _foreign_block(allocator: Any, batch: Any, rid: str, geo: Any) -> int | None:
        """A block another live request has written and ``rid`` does not hold (its last complete one)."""
        mine = set(allocator.block_table.get(rid, []))
        for j, other in enumerate(batch.request_ids):
            blocks = allocator.block_table.get(other, [])
            complete = int(batch.prefix_lens[j]) // geo.page_size  # blocks fully written before this step
            for block in reversed(blocks[:complete]):
                if other != rid and block not in mine:
                    return int(block)
        return None


class _WriteFault(Injector, ABC):
    """Changes where one layer writes one token; ``_destination`` picks the slot."""

    def on_layer_write(self, canary: Any, step: int, allocator: Any, layer_idx: int, write_index: Any) -> Any:
        if not self.armed or step < self.at or self._cu is None:
            return write_index
        if getattr(allocator, "sliding_window", 0) or layer_idx != allocator.layer_indices[-1]:
            return write_index
        for i, future in enumerate(self._requests):
            if not _continuing(future):
                continue
            j = int(self._cu[i])
            dest = self._destination(canary, allocator, future, i)
            if dest is None:
                continue
            original = int(write_index[j])
            changed = write_index.clone()
            changed[j] = dest
            past = int(future.state.position_offset) - int(future.query_length)
            self.fault = InjectedFault(self.kind, step, "FULL", future.state.request_id, past, original,
                                       f"layer {layer_idx} wrote position {past} to slot {dest} instead of "
                                       f"{original}")
            return changed
        return write_index

    @abstractmethod
    def _destination(self, canary: Any, allocator: Any, future: Any, i: int) -> int | None:
        """The slot the layer writes instead of the scheduled one (None: leave this request alone)."""


class KvWriteSkip(_WriteFault):
    kind = "kv-write-skip"

    def _destination(self, canary: Any, allocator: Any, future: Any, i: int) -> int | None:
        return int(allocator.write_trash_index)


class KvMisdirect(_WriteFault):
    kind = "kv-misdirect"

    def _destination(self, canary: Any, allocator: Any, future: Any, i: int) -> int | None:
        mine = set(allocator.block_table.get(future.state.request_id, []))
        stride, ps = int(allocator.block_physical_stride), int(allocator.tokens_per_page)
        for j, other in enumerate(self._requests):
            if j == i or not _continuing(other):
                continue
            past = int(other.state.position_offset) - int(other.query_length)
            blocks = allocator.block_table.get(other.state.request_id, [])
            for k, block in enumerate(blocks):
                if k * ps < past and block not in mine:  # a position the other request wrote and reads
                    return int(block) * stride
        return None


class WrongToken(Injector):
    kind = "wrong-token"

    def __init__(self, at: int, seed: int = 0, vocab_size: int = 2) -> None:
        super().__init__(at, seed)
        self.vocab_size = vocab_size

    def before_batch(self, canary: Any, step: int, kwargs: dict[str, Any], requests: list[Any], cache: Any) -> None:
        super().before_batch(canary, step, kwargs, requests, cache)
        if not self.armed or step < self.at:
            return
        assert self._cu is not None
        for i, future in enumerate(requests):
            if not _continuing(future):
                continue
            j = int(self._cu[i])
            ids = kwargs["input_ids"]
            old = int(ids[0, j])
            new = (old + 1 + int(self.rng.integers(self.vocab_size - 1))) % self.vocab_size
            ids[0, j] = new
            past = int(future.state.position_offset) - int(future.query_length)
            self.fault = InjectedFault(self.kind, step, "FULL", future.state.request_id, past, None,
                                       f"input_ids at position {past}: {old} -> {new}")
            return


class DoubleAlloc(Injector):
    kind = "double-alloc"

    def __init__(self, at: int, seed: int = 0) -> None:
        super().__init__(at, seed)
        self._victim: tuple[str, int] | None = None
        self._pool: Any = None

    def close(self) -> None:
        if self._pool is not None and "get_free_blocks" in vars(self._pool):
            del self._pool.get_free_blocks

    def after_forward(self, canary: Any, step: int, batch: Any, cache: Any) -> None:
        if not self.armed or step < self.at or self._victim is not None:
            return
        geo = self._target_group(canary, cache)
        if geo.window:
            return
        allocator = geo.allocator
        for i, future in enumerate(self._requests):
            rid = batch.request_ids[i]
            blocks = allocator.block_table.get(rid, [])
            total = int(batch.prefix_lens[i] + batch.extend_lens[i])
            if not _continuing(future, margin=6) or total < 2 * geo.page_size or not blocks:
                continue
            self._victim = (rid, int(blocks[0]))
            self._arm(canary, cache, allocator, geo)
            return

    def _arm(self, canary: Any, cache: Any, allocator: Any, geo: Any) -> None:
        pool = self._pool = allocator.pool
        original = pool.get_free_blocks
        state = canary.states[id(cache)]
        assert self._victim is not None
        victim_rid, block = self._victim

        def get_free_blocks(index: int, num_blocks: int) -> list[int]:
            if index != allocator.index or num_blocks < 1 or self.fault is not None:
                return original(index, num_blocks)
            del pool.get_free_blocks  # one bad allocation, then the pool behaves again
            self.fault = InjectedFault(self.kind, state.steps, geo.name, victim_rid, 0, block * geo.stride,
                                       f"block {block}, still held by {victim_rid}, handed out again")
            return [block, *original(index, num_blocks - 1)]

        pool.get_free_blocks = get_free_blocks


class CopyCorrupt(Injector):
    kind = "copy-corrupt"

    def on_block_copy(self, canary: Any, step: int, allocator: Any, sources: list[int], dests: list[int]) -> None:
        import torch

        if not self.armed or step < self.at or not dests:
            return
        dest = int(dests[0])
        stride, ps = int(allocator.block_physical_stride), int(allocator.tokens_per_page)
        row_bytes = int(allocator.num_key_value_heads) * int(allocator.head_dim) * allocator.cache_dtype.itemsize
        layer = int(self.rng.integers(len(allocator.layer_indices)))
        kv = int(self.rng.integers(2))
        slot = dest * stride  # the block's first token: written by the parent, read by the child
        byte = (slot + (2 * layer + kv) * ps) * row_bytes + int(self.rng.integers(16))
        flat = allocator.cache_tensor.view(-1).view(torch.uint8)  # the whole flat cache, from its first byte
        flat[byte] = int(flat[byte]) ^ (1 << int(self.rng.integers(8)))
        self.fault = InjectedFault(self.kind, step, "SWA" if getattr(allocator, "sliding_window", 0) else "FULL",
                                   "-", None, slot, f"copy of block {int(sources[0])} into block {dest} came out "
                                   f"with byte {byte} flipped ({'KV'[kv]} of layer {allocator.layer_indices[layer]})")


def make_injector(kind: str, at: int, seed: int = 0, vocab_size: int = 512) -> Injector:
    classes: dict[str, type[Injector]] = {
        "kv-bitflip": KvBitflip, "block-table": BlockTableRedirect, "kv-write-skip": KvWriteSkip,
        "kv-misdirect": KvMisdirect, "double-alloc": DoubleAlloc, "copy-corrupt": CopyCorrupt,
    }
    if kind == "wrong-token":
        return WrongToken(at, seed, vocab_size)
    if kind not in classes:
        from ..._errors import fail

        fail(f"unknown fault kind {kind!r}; choose from {', '.join(FAULT_KINDS)}")
    return classes[kind](at, seed)
