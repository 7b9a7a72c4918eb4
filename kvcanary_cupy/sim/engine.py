"""A small synthetic serving engine (:class:`Engine`, sized by :class:`EngineConfig`): the state a real engine
keeps around its KV cache, and nothing else. The pieces live in their own modules: :mod:`.workload`,
:mod:`.allocator`, :mod:`.radix`, :mod:`.kvstore`, :mod:`.requests`; this one schedules and runs them.

What it models (each piece is what the canary is meant to watch):

* **token-to-KV slot pool** — slots ``[1, num_slots)``; slot 0 is the reserved padding slot. A free-list
  allocator (:class:`SlotAllocator`, a stack, so a freed unit is handed out again soon) with reference counts,
  because a unit can be held by a live request and by the prefix cache at once. The unit is one slot in the
  token layout (SGLang, page size 1), and one block of ``block_size`` slots in the block and csr layouts (vLLM,
  transformers, FlashInfer): block ``b`` holds slots ``b * block_stride + [0, block_size)`` (block 0, which
  holds the padding slot, is never handed out; with ``block_stride > block_size`` the slots between blocks stay
  unused, as in transformers' physical layout).
* **the slot table** — one ``int32`` row per request (row 0 is the padding row): ``req_to_token`` (one slot per
  position) in the token layout, or ``req_to_block`` (one block id per ``block_size`` positions, the request's
  block list) in the block layouts. Rows are recycled when requests finish and are never cleared, so the
  stale tail of the previous owner stays behind (the plan only reads positions below the prefix).
* **slot layout** — what the plan reads: ``req_to_token`` itself ("token", SGLang), or, gathered on the device
  before every plan from the requests' ``req_to_block`` rows, a batch-row block table ("block", vLLM's
  persistent batch; ``slot = block * block_stride + pos % block_size``) or CSR page lists in batch order
  ("csr", FlashInfer; ``block_stride == block_size``). Corrupting a request's table entry reaches every layout.
  The two batch-row layouts have no request rows: the expected-token pool is indexed by batch row (every
  request's history is scattered into its row each step) and padding rows have zero lengths, as in vLLM.
* **prefix cache** — :class:`RadixTree`, radix-style: a finished request donates its token sequence and slots;
  later requests whose prompt starts the same way reuse the donor's slots (their chain hashes are identical
  because the chain covers content only). With EAGLE the keys are token bigrams, as in SGLang, so that the
  draft slot at the last shared position (which holds the *next* token's KV) matches too. In the block layouts
  only whole blocks are cached and shared (a request whose match ends inside a block recomputes from the
  block's start), and every holder of a block (each request whose block list has it, and the cache) holds one
  reference to it.
* **requests and batches** — chunked prefill under a token budget and one-token decode steps in the same
  batch; decode-only batches are padded to a CUDA-graph batch size with padding rows (``req_pool_index`` 0).
* **real KV** — :class:`KvStore`, a paged tensor per layer (page size > 1) written by :meth:`Engine.forward`
  for every new token and exposed as :class:`~kvcanary_cupy.RealKvSource`\\ s.
* **SWA group** (optional) — a second slot pool for sliding-window layers, the full→SWA LUT (0 = evicted),
  and eviction of positions that leave the window. Prompt positions are protected (a real engine inserts
  the prompt into its prefix cache after prefill), prefix matches are cut back until the last window of the
  shared prefix is still resident, as SGLang's SWA radix cache does.
* **EAGLE draft pool** (optional) — the draft model's own KV, indexed by the same slots; the draft's slot at
  position ``p`` holds the KV of token ``p + 1``.
* **token histories** — each step, the requests' true token histories (:meth:`Engine.expected_token_inputs`),
  which the canary scatters into its expected-token pool (``pool_host`` is the engine's host mirror of it).

State that the canary kernels read lives in ``xp`` arrays (NumPy or CuPy); the bookkeeping a real engine keeps
on the host (free lists, request objects, the tree, and host mirrors of ``req_to_token`` and the LUT) lives in
Python and NumPy. Nothing in the step path copies device memory to the host.

Every token a request will ever see is drawn when the workload is made (prompt and "sampled" outputs), so the
engine always knows the ground truth that a correct step must reproduce.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..layouts import BlockTable, PageList
from .allocator import SlotAllocator
from .kvstore import KvStore
from .radix import RadixNode, RadixTree
from .requests import Batch, Request
from .workload import RequestSpec

# ---- engine configuration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int  # token-to-KV pool, slot 0 reserved
    max_reqs: int  # req_to_token rows, row 0 is the padding row
    max_seq_len: int  # req_to_token / expected-token pool width
    max_running: int = 16
    chunk_size: int = 64  # prefill tokens per step
    page_size: int = 16
    kv_words_per_token: int = 4  # 8-byte words of K (and of V) per token per layer
    num_layers: int = 2  # each layer is one real-KV source (at most 4)
    with_v: bool = False
    swa_window: int = 0  # 0: no SWA group
    swa_slots: int = 0
    eagle: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    layout: str = "token"  # the plan's slot layout: token, block or csr
    block_size: int = 1  # tokens per KV block (block and csr layouts; 1 in the token layout)
    block_stride: int = 0  # slots between consecutive block ids (0: block_size)

    @property
    def paged(self) -> bool:
        """KV is allocated in blocks and the engine keeps block lists (the block and csr layouts)."""
        return self.layout != "token"

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_size

    @property
    def max_blocks(self) -> int:
        """Entries of a slot-table row: positions, or blocks of ``block_size`` positions."""
        return -(-self.max_seq_len // self.block_size)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_words_per_token * 8

    @property
    def max_padded_batch(self) -> int:
        fits = [b for b in self.cuda_graph_batch_sizes if b >= self.max_running]
        return max(self.max_running, min(fits) if fits else self.max_running)

    @property
    def max_batch_rows(self) -> int:
        """Rows of the largest batch the canary is sized for (and of the batch-row layouts)."""
        return max(self.max_reqs, self.max_padded_batch)

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_slots": self.num_slots, "max_reqs": self.max_reqs, "max_seq_len": self.max_seq_len,
            "max_running": self.max_running, "chunk_size": self.chunk_size, "page_size": self.page_size,
            "kv_bytes_per_token": self.kv_bytes_per_token, "num_layers": self.num_layers, "with_v": self.with_v,
            "swa_window": self.swa_window, "swa_slots": self.swa_slots, "eagle": self.eagle, "layout": self.layout,
            "block_size": self.block_size, "block_stride": self.stride,
        }


def size_engine(workload: list[RequestSpec], *, max_running: int, **kwargs: Any) -> EngineConfig:
    """An engine big enough for ``max_running`` of the workload's longest requests plus a prefix cache."""
    longest = max(spec.total_len for spec in workload)
    page = int(kwargs.get("page_size", 16))
    max_seq_len = -(-(longest + 8) // 64) * 64
    slots = max_running * longest + 4 * longest + 256
    if kwargs.get("layout", "token") != "token":
        # whole blocks: every request may leave its last block partly empty, and the cache holds whole blocks
        size = int(kwargs.get("block_size", 1))
        stride = int(kwargs.get("block_stride", 0)) or size
        blocks = 1 + (max_running + 4) * -(-longest // size) + -(-256 // size)
        slots = blocks * stride
    slots = -(-slots // page) * page
    rows = max_running + 4  # a few spare rows; finished rows are recycled LIFO
    swa_slots = slots + 256 if kwargs.get("swa_window", 0) else 0
    return EngineConfig(num_slots=slots, max_reqs=rows, max_seq_len=max_seq_len, max_running=max_running,
                        swa_slots=swa_slots, **kwargs)


# ---- the engine --------------------------------------------------------------------------------------------


AssignHook = Callable[[Request, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
SpliceHook = Callable[[int, int], None]
EvictHook = Callable[[RadixNode], None]
# (request, its prompt's prefix-cache keys, the device match's slots, the node ending it, step) -> True while the
# request must wait for a load-back from a lower tier
LookupHook = Callable[[RequestSpec, np.ndarray, np.ndarray, RadixNode, int], bool]


class Engine:
    """Scheduler, memory and "model" of the synthetic engine; the runner installs the canary on it through
    :mod:`kvcanary_cupy.runtime`, like any engine."""

    def __init__(self, cfg: EngineConfig, workload: list[RequestSpec], xp: Any) -> None:
        self.cfg = cfg
        self.xp = xp
        self.workload = sorted(workload, key=lambda s: (s.arrival, s.rid))
        self._arrivals = deque(self.workload)
        if cfg.layout not in ("token", "block", "csr"):
            raise ValueError(f"--layout must be token, block or csr, got {cfg.layout!r}")
        if not cfg.paged and (cfg.block_size != 1 or cfg.stride != 1):
            raise ValueError("the token layout allocates single slots: block_size and block_stride must be 1")
        if cfg.layout == "csr" and cfg.stride != cfg.block_size:
            raise ValueError("CSR page lists have no block stride: block_stride must equal block_size")
        self.paged = cfg.paged
        self.unit = cfg.block_size  # positions per slot-table entry
        self.stride = cfg.stride
        # allocation units: slots, or blocks (block b holds slots b * stride + [0, unit))
        self.alloc = SlotAllocator(cfg.num_slots // self.stride if self.paged else cfg.num_slots)
        self.rows_free = list(range(cfg.max_reqs - 1, 0, -1))
        self.row_used = np.zeros(cfg.max_reqs, bool)
        # the slot table: req_to_token (token layout) or req_to_block (the requests' block lists), host mirror
        self.table_host = np.zeros((cfg.max_reqs, cfg.max_blocks), np.int32)
        self.table = xp.zeros((cfg.max_reqs, cfg.max_blocks), np.int32)
        self.req_to_token: Any = None if self.paged else self.table
        self.row_less = self.paged  # the plan reads batch rows, not request rows
        rows = cfg.max_batch_rows
        self.pool_host = np.zeros((rows if self.row_less else cfg.max_reqs, cfg.max_seq_len), np.int32)
        if cfg.layout == "block":
            self.block_table = xp.zeros((rows, cfg.max_blocks), np.int32)
        elif cfg.layout == "csr":
            self.kv_page_indptr = xp.zeros(rows + 1, np.int32)
            self.kv_page_indices = xp.zeros(rows * cfg.max_blocks, np.int32)
        self.tree = RadixTree(self.unit)
        self.swa = cfg.swa_window > 0
        self.lut_host = np.zeros(cfg.num_slots + 1, np.int64)
        self.lut: Any = xp.zeros(cfg.num_slots + 1, np.int64) if self.swa else None
        self.swa_alloc = SlotAllocator(cfg.swa_slots) if self.swa else None
        self.swa_owner = np.zeros(max(cfg.swa_slots, 1), np.int64)  # SWA slot -> full slot that holds it
        words, layers = cfg.kv_words_per_token, cfg.num_layers
        self.kv: dict[str, KvStore] = {
            "FULL": KvStore(xp, cfg.num_slots, cfg.page_size, words, layers, cfg.with_v, salt=0x51),
        }
        if self.swa:
            self.kv["SWA"] = KvStore(xp, cfg.swa_slots, cfg.page_size, words, layers, cfg.with_v, salt=0x5A)
        if cfg.eagle:
            self.kv["DRAFT"] = KvStore(xp, cfg.num_slots, cfg.page_size, words, layers, cfg.with_v, salt=0xD7)
        self.waiting: deque[RequestSpec] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.on_assign: AssignHook | None = None
        self.on_splice: SpliceHook | None = None
        self.on_evict: EvictHook | None = None  # a tiered cache: write back what leaves the device
        self.on_lookup: LookupHook | None = None  # a tiered cache: load back a prefix found in a lower tier
        self._table_dirty: list[tuple[int, int, int]] = []
        self.table_overrides: dict[tuple[int, int], int] = {}  # device entries that differ from the host's (faults)
        self._lut_dirty: set[int] = set()
        self.stats = dict(requests_admitted=0, requests_finished=0, prefill_tokens=0, decode_tokens=0,
                          prefix_tokens_reused=0, rows_recycled=0, padding_rows=0, tree_evicted_slots=0,
                          swa_evicted_slots=0, peak_running=0, peak_slots_used=0)

    # -- queries used by the fault injectors ---------------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return self.prefilling + self.decoding

    def keys(self, tokens: np.ndarray) -> np.ndarray:
        """Prefix-cache keys of a token sequence: the tokens, or bigrams with EAGLE (one key per slot whose
        draft KV, which holds the next token, is also determined)."""
        if not self.cfg.eagle:
            return tokens
        return (tokens[:-1] << 32) | tokens[1:]

    def holders(self, slot: int) -> list[tuple[np.ndarray, int]]:
        """Every (slot sequence, position) at which ``slot`` is held: live requests and cached paths."""
        out: list[tuple[np.ndarray, int]] = []
        for req in self.running:
            held = req.slots[: req.assigned]
            out.extend((held, int(p)) for p in np.flatnonzero(held == slot))
        return out

    def successors(self, slot: int) -> set[int]:
        """Slots that follow ``slot`` in a live request or in the prefix cache (their stored chain hash was
        derived from ``slot``'s canary)."""
        out = {int(seq[p + 1]) for seq, p in self.holders(slot) if p + 1 < seq.shape[0] and seq[p + 1] > 0}
        slots, _, prevs = self.tree.walk()
        out.update(int(s) for s in slots[prevs == slot])
        return out

    def swa_of(self, full_slot: int) -> int:
        return int(self.lut_host[full_slot]) if self.swa else 0

    def entry_intact(self, req: Request, position: int) -> bool:
        """Whether the device slot-table entry that maps ``position`` of ``req`` is the engine's."""
        return (req.rp, position // self.unit) not in self.table_overrides

    def corrupt_table_entry(self, row: int, index: int, value: int) -> None:
        """Overwrite one device slot-table entry (a slot, or a block id) behind the engine's back (fault
        injection); the engine writes the entry again when the row's owner is given that position (or block)."""
        self.table[row, index] = value
        self.table_overrides[(row, index)] = value

    def block_slots(self, block: int) -> np.ndarray:
        """The slots of ``block``."""
        return block * self.stride + np.arange(self.unit, dtype=np.int64)

    def _set_entries(self, row: int, start: int, values: Any) -> None:
        """Write slot-table entries ``[start, start + len)`` of ``row`` (host now, device at the next flush)."""
        values = np.asarray(values, np.int64)
        self.table_host[row, start : start + values.shape[0]] = values
        self._table_dirty.append((row, start, start + values.shape[0]))

    # -- memory --------------------------------------------------------------------------------------------

    def _release(self, slots: Any) -> None:
        """Drop one reference to each slot (token layout), or to each whole block that ``slots`` spans."""
        if self.paged:
            self._release_blocks(np.asarray(slots, np.int64)[:: self.unit] // self.stride)
            return
        for f in self.alloc.free(slots):
            if self.swa:
                self._drop_swa(f)

    def _release_blocks(self, blocks: Any) -> None:
        for b in self.alloc.free(blocks):
            if self.swa:
                for f in self.block_slots(b).tolist():
                    self._drop_swa(f)

    def _drop_swa(self, full_slot: int) -> None:
        x = int(self.lut_host[full_slot])
        if x == 0:
            return
        self.lut_host[full_slot] = 0
        self._lut_dirty.add(full_slot)
        if self.swa_owner[x] == full_slot:
            self.swa_owner[x] = 0
            self.swa_alloc.free([x])  # type: ignore[union-attr]

    def _evict_tree(self, want: int) -> None:
        """Evict cached paths until ``want`` allocation units were released."""
        freed = self.tree.evict(want * self.unit, self._release, self.on_evict)
        self.stats["tree_evicted_slots"] += freed

    def _alloc(self, n: int) -> np.ndarray:
        """``n`` fresh allocation units (slots, or blocks)."""
        if self.alloc.available < n:
            self._evict_tree(n - self.alloc.available)
        slots = self.alloc.alloc(n)
        if slots is None:
            unit = "blocks" if self.paged else "slots"
            raise RuntimeError(f"sim: the KV pool ran out ({n} {unit} wanted, {self.alloc.available} free)")
        return slots

    def _blocks_for(self, positions: int) -> int:
        return -(-positions // self.unit)

    def _grow(self, req: Request, end: int) -> np.ndarray:
        """Block layouts: extend ``req``'s block list to cover positions ``[0, end)`` (a new block when the last
        one is full) and return the slots of its positions ``[req.assigned, end)``."""
        new = self._alloc(max(0, self._blocks_for(end) - len(req.blocks)))
        if new.shape[0]:
            self._set_entries(req.rp, len(req.blocks), new)
            req.blocks.extend(new.tolist())
        pos = np.arange(req.assigned, end, dtype=np.int64)
        return np.asarray(req.blocks, np.int64)[pos // self.unit] * self.stride + pos % self.unit

    def _assign(self, req: Request, start: int, slots: np.ndarray) -> None:
        """Give ``req`` fresh ``slots`` for positions ``[start, start + len)`` (and SWA slots). In the block
        layouts the slots come from the request's blocks (:meth:`_grow`), whose table entries are written."""
        n = slots.shape[0]
        if n == 0:
            return
        req.slots[start : start + n] = slots
        req.assigned = max(req.assigned, start + n)
        if not self.paged:
            self._set_entries(req.rp, start, slots)
        swa = np.zeros(n, np.int64)
        if self.swa:
            got = self.swa_alloc.alloc(n)  # type: ignore[union-attr]
            if got is None:
                raise RuntimeError("sim: the SWA pool ran out")
            swa = got
            self.swa_owner[swa] = slots
            self.lut_host[slots] = swa
            self._lut_dirty.update(slots.tolist())
        if self.on_assign is not None:
            preds = np.empty(n, np.int64)
            preds[0] = req.slots[start - 1] if start > 0 else -1
            preds[1:] = slots[:-1]
            pred_swa = np.where(preds > 0, self.lut_host[np.maximum(preds, 0)], 0) if self.swa else preds * 0
            positions = np.arange(start, start + n, dtype=np.int64)
            self.on_assign(req, positions, slots, preds, swa, pred_swa)

    def rebind(self, batch: Batch, token: int, slot: int) -> int:
        """Make new token ``token`` of ``batch`` land in ``slot`` instead of the slot allocated for it (which
        is freed); ``slot`` gains a reference. Returns the slot given up. Used by the double-allocation fault:
        this is what an allocator that hands out a live slot does."""
        row = int(batch.token_row[token])
        req, pos = batch.reqs[row], int(batch.token_pos[token])
        old = int(req.slots[pos])
        self.alloc.share(slot)
        if self.swa:
            self._drop_swa(old)  # the SWA slot allocated with it goes back
        self._release([old])
        req.slots[pos] = slot
        self._set_entries(req.rp, pos, [slot])
        if self.swa:
            got = self.swa_alloc.alloc(1)  # type: ignore[union-attr]
            if got is None:
                raise RuntimeError("sim: the SWA pool ran out")
            x = int(got[0])
            self.swa_owner[x] = slot
            self.lut_host[slot] = x  # the previous SWA slot of `slot` is orphaned, as the real bug would do
            self._lut_dirty.add(slot)
        if self.on_assign is not None:
            pred = int(req.slots[pos - 1]) if pos > 0 else -1
            pred_swa = self.swa_of(pred) if pred > 0 else 0
            self.on_assign(req, np.array([pos]), np.array([slot]), np.array([pred]),
                           np.array([self.swa_of(slot)]), np.array([pred_swa]))
        batch.token_slot[token] = slot
        self.flush()
        batch.out_cache_loc[token] = slot
        if self.swa:
            batch.swa_out_cache_loc[token] = self.lut[slot]
        return old

    def rebind_block(self, batch: Batch, row: int, index: int, block: int) -> None:
        """Block layouts: make block ``index`` of batch row ``row``'s request, allocated this step, be ``block``
        instead (the fresh block is freed); ``block`` gains a reference. Used by the double-allocation fault: this
        is what a block allocator that hands out a live block does. This step's tokens in it are redirected."""
        req = batch.reqs[row]
        self.alloc.share(block)
        self._release_blocks([req.blocks[index]])  # with the SWA slots given with its slots
        req.blocks[index] = block
        self._set_entries(req.rp, index, [block])
        lo, hi = index * self.unit, min((index + 1) * self.unit, req.assigned)
        slots = self.block_slots(block)[: hi - lo]
        req.slots[lo:hi] = slots
        swa = np.zeros(hi - lo, np.int64)
        if self.swa:
            got = self.swa_alloc.alloc(hi - lo)  # type: ignore[union-attr]
            if got is None:
                raise RuntimeError("sim: the SWA pool ran out")
            swa = got
            self.swa_owner[swa] = slots
            self.lut_host[slots] = swa  # the victim's SWA slots there are orphaned, as the real bug would do
            self._lut_dirty.update(slots.tolist())
        if self.on_assign is not None:
            preds = np.concatenate([[req.slots[lo - 1] if lo > 0 else -1], slots[:-1]]).astype(np.int64)
            pred_swa = np.where(preds > 0, self.lut_host[np.maximum(preds, 0)], 0) if self.swa else preds * 0
            self.on_assign(req, np.arange(lo, hi, dtype=np.int64), slots, preds, swa, pred_swa)
        tokens = batch.token_index(row, lo) + np.arange(hi - lo)
        batch.token_slot[tokens] = slots
        self.flush()
        batch.out_cache_loc[self.xp.asarray(tokens)] = self.xp.asarray(slots)
        if self.swa:
            batch.swa_out_cache_loc[self.xp.asarray(tokens)] = self.lut[self.xp.asarray(slots)]

    def flush(self) -> None:
        """Copy the host-side changes of the slot table and the LUT to the device (one scatter each)."""
        xp = self.xp
        if self._table_dirty:
            for r, a, b in self._table_dirty if self.table_overrides else ():
                for index in range(a, b):
                    self.table_overrides.pop((r, index), None)
            rows = np.concatenate([np.full(b - a, r, np.int64) for r, a, b in self._table_dirty])
            cols = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in self._table_dirty])
            self.table[xp.asarray(rows), xp.asarray(cols)] = xp.asarray(self.table_host[rows, cols])
            self._table_dirty.clear()
        if self._lut_dirty:
            idx = np.fromiter(sorted(self._lut_dirty), np.int64)
            self.lut[xp.asarray(idx)] = xp.asarray(self.lut_host[idx])
            self._lut_dirty.clear()

    # -- scheduling ----------------------------------------------------------------------------------------

    def _usable(self, slots: np.ndarray, length: int) -> int:
        """Longest ``L' <= length`` of whole blocks (any length in the token layout) whose last window of shared
        positions still has SWA slots."""
        length -= length % self.unit
        if not self.swa or length == 0:
            return length
        alive = self.lut_host[slots[:length]] != 0
        run = np.zeros(length, np.int64)
        count = 0
        for i, a in enumerate(alive.tolist()):
            count = count + 1 if a else 0
            run[i] = count
        window = self.cfg.swa_window
        for cut in range(length, 0, -self.unit):
            if run[cut - 1] >= min(window, cut):
                return cut
        return 0

    def _admit(self, spec: RequestSpec, step: int) -> Request | None:
        if not self.rows_free:
            return None
        keys = self.keys(spec.tokens[: spec.prompt_len])
        shared, node = self.tree.match(keys, step)
        if self.on_lookup is not None and self.on_lookup(spec, keys, shared, node, step):
            return None  # its prefix is being loaded back from a lower tier
        usable = self._usable(shared, min(shared.shape[0], spec.prompt_len - 1))
        if usable < shared.shape[0]:
            shared, node = self.tree.match(keys[:usable], step)
            shared = shared[:usable]
        need = self._blocks_for(spec.total_len - 1) - usable // self.unit + sum(map(self._units_left, self.running))
        self.tree.lock(node, +1)
        if self.alloc.available < need:
            self._evict_tree(need - self.alloc.available)
        if self.alloc.available < need:
            self.tree.lock(node, -1)
            return None
        rp = self.rows_free.pop()
        req = Request(spec, rp, self.cfg.max_seq_len)
        req.recycled = bool(self.row_used[rp])
        self.stats["rows_recycled"] += int(req.recycled)
        self.row_used[rp] = True
        req.node, req.tree_len, req.computed, req.admitted_step = node, usable, usable, step
        req.assigned = usable
        if usable and self.paged:
            req.slots[:usable] = shared
            req.blocks = (shared[:: self.unit] // self.stride).tolist()  # the cached path's whole blocks
            for b in req.blocks:
                self.alloc.share(b)
            self._set_entries(rp, 0, req.blocks)
        elif usable:
            req.slots[:usable] = shared
            self._set_entries(rp, 0, shared)
        self.stats["requests_admitted"] += 1
        self.stats["prefix_tokens_reused"] += usable
        return req

    def _units_left(self, req: Request) -> int:
        """Allocation units (slots, or blocks) ``req`` will still be given."""
        if not self.paged:
            return req.kv_left
        return self._blocks_for(req.spec.total_len - 1) - len(req.blocks)

    def schedule(self, step: int) -> Batch:
        """Admit, pick this step's rows (prefill chunks, then decodes) and give every new token a slot."""
        while self._arrivals and self._arrivals[0].arrival <= step:
            self.waiting.append(self._arrivals.popleft())
        rows: list[tuple[Request, int]] = []
        admitted: list[Request] = []
        budget = self.cfg.chunk_size
        for req in self.prefilling:
            take = min(budget, req.prompt_len - req.computed)
            if take > 0:
                rows.append((req, take))
                budget -= take
        while budget > 0 and self.waiting and len(self.running) < self.cfg.max_running:
            new = self._admit(self.waiting[0], step)
            if new is None:
                break
            self.waiting.popleft()
            self.prefilling.append(new)
            admitted.append(new)
            take = min(budget, new.prompt_len - new.computed)
            rows.append((new, take))
            budget -= take
        rows.extend((req, 1) for req in self.decoding)

        extend = np.array([e for _, e in rows], np.int64)
        if self.paged:
            for req, e in rows:
                self._assign(req, req.computed, self._grow(req, req.computed + e))
        else:
            allocated = self._alloc(int(extend.sum()))
            at = 0
            for req, e in rows:
                self._assign(req, req.computed, allocated[at : at + e])
                at += e
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
        used = (self.alloc.size - 1 - self.alloc.available) * self.unit
        self.stats["peak_slots_used"] = max(self.stats["peak_slots_used"], used)
        return self._build_batch(step, [r for r, _ in rows], extend, admitted)

    def _build_batch(self, step: int, reqs: list[Request], extend: np.ndarray, admitted: list[Request]) -> Batch:
        xp = self.xp
        prefix = np.array([r.computed for r in reqs], np.int64)
        n_real = int(extend.sum())
        token_row = np.repeat(np.arange(len(reqs), dtype=np.int64), extend)
        starts = np.repeat(prefix - np.concatenate([[0], np.cumsum(extend)[:-1]]), extend) if reqs else prefix
        token_pos = np.arange(n_real, dtype=np.int64) + starts if n_real else np.empty(0, np.int64)
        spans = list(zip(reqs, prefix.tolist(), extend.tolist(), strict=True))
        token_slot = np.concatenate([r.slots[p : p + e] for r, p, e in spans] or [np.empty(0, np.int64)])
        token_ids = np.concatenate([r.tokens[p : p + e] for r, p, e in spans] or [np.empty(0, np.int64)])
        decode_only = bool(reqs) and all(not r.prefilling for r in reqs)
        padding = 0
        if decode_only:
            fits = [b for b in self.cfg.cuda_graph_batch_sizes if b >= len(reqs)]
            padding = (min(fits) - len(reqs)) if fits else 0
        self.stats["padding_rows"] += padding
        self.stats["prefill_tokens"] += int(sum(e for r, e in zip(reqs, extend.tolist(), strict=True)
                                                if r.prefilling))
        self.stats["decode_tokens"] += int(sum(1 for r in reqs if not r.prefilling))
        # padding rows carry garbage lengths, except where no padding sentinel exists (batch-row layouts)
        garbage = np.full(padding, 0 if self.row_less else 7 + step % 89, np.int64)
        rpi = np.concatenate([np.array([r.rp for r in reqs], np.int64), np.zeros(padding, np.int64)])
        prefix_all = np.concatenate([prefix, garbage])
        extend_all = np.concatenate([extend, np.full(padding, 0 if self.row_less else 1, np.int64)])
        valid = np.concatenate([np.array([r.num_tokens for r in reqs], np.int64), np.zeros(padding, np.int64)])
        ids = np.concatenate([token_ids, np.zeros(padding, np.int64)])
        pos = np.concatenate([token_pos, np.zeros(padding, np.int64)])
        loc = np.concatenate([token_slot, np.zeros(padding, np.int64)])
        self.flush()
        batch = Batch(step=step, reqs=reqs, prefix_h=prefix, extend_h=extend, admitted=admitted, num_padding=padding,
                      token_row=token_row, token_pos=token_pos, token_slot=token_slot, num_real_tokens=n_real)
        batch.row_of_req = {r.rid: i for i, r in enumerate(reqs)}
        batch.req_pool_indices = xp.asarray(rpi)
        batch.prefix_lens = xp.asarray(prefix_all)
        batch.extend_seq_lens = xp.asarray(extend_all)
        batch.valid_lens = xp.asarray(valid)
        batch.input_ids = xp.asarray(ids.copy())
        batch.positions = xp.asarray(pos.copy())
        batch.expected_tokens = xp.asarray(ids)
        batch.expected_positions = xp.asarray(pos)
        batch.out_cache_loc = xp.asarray(loc)
        if self.swa:
            batch.swa_out_cache_loc = xp.take(self.lut, batch.out_cache_loc)  # the caller gathers through the LUT
        return batch

    # -- slot layout ---------------------------------------------------------------------------------------

    def slot_layout(self) -> BlockTable | PageList | None:
        """The layout the plan reads (None: ``req_to_token`` itself). Its arrays are refilled in place."""
        if self.cfg.layout == "block":
            return BlockTable(self.block_table, self.unit, block_stride=self.stride, batch_rows=True,
                              num_slots=self.cfg.num_slots)
        if self.cfg.layout == "csr":
            return PageList(self.kv_page_indptr, self.kv_page_indices, self.unit, num_slots=self.cfg.num_slots)
        return None

    def fill_layout(self, batch: Batch) -> None:
        """Write ``batch``'s block table rows / page lists from the requests' device block lists
        (``req_to_block`` rows, so a corrupted entry is seen as the plan would see it). Device gathers only: no
        host synchronisation. Padding rows get no pages (zero lengths: the plan reads nothing of them)."""
        if not self.paged or not batch.reqs:
            return
        xp, width = self.xp, self.cfg.max_blocks
        rps = np.array([r.rp for r in batch.reqs], np.int64)
        if self.cfg.layout == "block":
            self.block_table[: rps.shape[0]] = self.table[xp.asarray(rps)]
            return
        # the pages a FlashInfer plan gets: those of the cached and the new tokens
        lens = -(-(batch.prefix_h + batch.extend_h) // self.unit)
        indptr = np.zeros(self.kv_page_indptr.shape[0], np.int32)
        np.cumsum(lens, out=indptr[1 : lens.shape[0] + 1])
        indptr[lens.shape[0] + 1 :] = indptr[lens.shape[0]]
        flat = np.concatenate([rp * width + np.arange(n, dtype=np.int64) for rp, n in zip(rps, lens.tolist(),
                                                                                           strict=True)])
        self.kv_page_indptr[...] = xp.asarray(indptr)
        self.kv_page_indices[: flat.shape[0]] = self.table.reshape(-1)[xp.asarray(flat)]

    # -- expected-token pool -------------------------------------------------------------------------------

    def pool_row(self, batch: Batch, req: Request) -> int:
        """The expected-token pool row the plan reads for ``req``: its request row, or its batch row."""
        return batch.row_of_req[req.rid] if self.row_less else req.rp

    def expected_token_inputs(self, batch: Batch) -> tuple[Any, Any, Any]:
        """``(flat_in, offsets, pool rows)`` for the scatter: each request's true token history
        (requests flagged ``skip_scatter`` are left out, so their row keeps whatever it held)."""
        xp = self.xp
        reqs = [r for r in batch.reqs if not r.skip_scatter]
        parts = [r.tokens[: r.num_tokens] for r in reqs]
        lens = np.array([p.shape[0] for p in parts], np.int64)
        offsets = np.zeros(len(reqs) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
        rpi = np.array([self.pool_row(batch, r) for r in reqs], np.int64)
        for row, p in zip(rpi.tolist(), parts, strict=True):
            self.pool_host[row, : p.shape[0]] = p
        return xp.asarray(flat), xp.asarray(offsets), xp.asarray(rpi)

    # -- the model -----------------------------------------------------------------------------------------

    def forward(self, batch: Batch, redirect: dict[str, tuple[int, int]] | None = None) -> None:
        """The target model's forward: the KV of every new token lands in its slot (full and SWA layers).
        ``redirect[group] = (token, slot)`` sends one token's KV to another slot (fault injection)."""
        n = batch.num_real_tokens
        ids, pos = batch.input_ids[:n], batch.positions[:n]
        groups = [("FULL", batch.out_cache_loc)] + ([("SWA", batch.swa_out_cache_loc)] if self.swa else [])
        for name, loc in groups:
            intended = loc[:n]
            dest = intended
            if redirect and name in redirect:
                token, victim = redirect[name]
                dest = intended.copy()
                dest[token] = victim
            self.kv[name].write(dest, ids, pos, intended)

    def sample(self, batch: Batch) -> None:
        """After the target forward: advance every row and append the sampled token where one is due."""
        for req, p, e in zip(batch.reqs, batch.prefix_h.tolist(), batch.extend_h.tolist(), strict=True):
            req.computed = p + e
            if req.computed == req.num_tokens and req.num_tokens < req.spec.total_len:
                req.num_tokens += 1
        if self.cfg.eagle:
            spans = zip(batch.reqs, batch.prefix_h.tolist(), batch.extend_h.tolist(), strict=True)
            draft = [r.tokens[p + 1 : p + e + 1] for r, p, e in spans]  # the input rotation
            draft.append(np.zeros(batch.num_padding, np.int64))
            batch.draft_input_ids = self.xp.asarray(np.concatenate(draft))

    def forward_draft(self, batch: Batch, redirect: dict[str, tuple[int, int]] | None = None) -> None:
        """The EAGLE draft's forward: its slot at position p receives the KV of token p + 1."""
        n = batch.num_real_tokens
        intended = batch.out_cache_loc[:n]
        dest = intended
        if redirect and "DRAFT" in redirect:
            token, victim = redirect["DRAFT"]
            dest = intended.copy()
            dest[token] = victim
        self.kv["DRAFT"].write(dest, batch.draft_input_ids[:n], batch.expected_positions[:n], intended)

    # -- end of step ---------------------------------------------------------------------------------------

    def finish_step(self, batch: Batch) -> list[Request]:
        """Retire finished requests into the prefix cache, move prefilled ones to decode, slide SWA windows."""
        done = []
        for req in batch.reqs:
            if req.num_tokens >= req.spec.total_len and req.computed >= req.spec.total_len - 1:
                done.append(req)
        for req in done:
            self._finish(req, batch.step)
        still: list[Request] = []
        for req in self.prefilling:
            if req in done:
                continue
            (still if req.prefilling else self.decoding).append(req)
        self.prefilling = still
        self.decoding = [r for r in self.decoding if r not in done]
        for req in self.decoding:
            if req.computed > req.prompt_len:
                req.skip_scatter = False  # a decoded token refreshes the whole expected-token row
            if self.swa:
                self._slide_window(req)
        self.flush()
        return done

    def _slide_window(self, req: Request) -> None:
        limit = req.computed - self.cfg.swa_window
        for p in range(max(req.swa_evicted, req.prompt_len), limit):
            f = int(req.slots[p])
            if self.lut_host[f]:
                self._drop_swa(f)
                self.stats["swa_evicted_slots"] += 1
        req.swa_evicted = max(req.swa_evicted, limit)

    def _finish(self, req: Request, step: int) -> None:
        if self.paged:
            self._finish_blocks(req, step)
            return
        keys = self.keys(req.tokens[: req.computed])
        n = keys.shape[0]
        cached, node = self.tree.insert(keys, req.slots[:n], step)
        if 0 < cached < n and self.on_splice is not None and node.parent is not None:
            # the request's own chain now continues the cached path: a new (prev, slot) adjacency
            self.on_splice(int(node.parent.slots[-1]), int(node.slots[0]))
        if cached > req.tree_len:
            self._release(req.slots[req.tree_len : cached])  # duplicates of what the cache already holds
        if n < req.computed:
            self._release(req.slots[n : req.computed])
        if req.node is not None:
            self.tree.lock(req.node, -1)
        self.rows_free.append(req.rp)
        self.stats["requests_finished"] += 1

    def _finish_blocks(self, req: Request, step: int) -> None:
        """Block layouts: the cache takes a reference to each whole block it did not hold yet, then the request
        drops its references (a duplicate of a cached block, or its partly filled last block, is freed)."""
        keys = self.keys(req.tokens[: req.computed])
        n = keys.shape[0] - keys.shape[0] % self.unit
        cached, node = self.tree.insert(keys[:n], req.slots[:n], step)
        if 0 < cached < n and self.on_splice is not None and node.parent is not None:
            self.on_splice(int(node.parent.slots[-1]), int(node.slots[0]))
        for b in req.blocks[cached // self.unit : n // self.unit]:
            self.alloc.share(b)
        self._release_blocks(req.blocks)
        if req.node is not None:
            self.tree.lock(req.node, -1)
        self.rows_free.append(req.rp)
        self.stats["requests_finished"] += 1
