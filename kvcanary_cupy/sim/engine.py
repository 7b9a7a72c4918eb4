"""A small synthetic serving engine: the state a real engine keeps around its KV cache, and nothing else.

What it models (each piece is what the canary is meant to watch):

* **token-to-KV slot pool** — slots ``[1, num_slots)``; slot 0 is the reserved padding slot. A free-list
  allocator (:class:`SlotAllocator`, a stack, so a freed slot is handed out again soon) with reference counts,
  because a slot can be held by a live request and by the prefix cache at once.
* **req_to_token** — ``int32 [max_reqs, max_seq_len]``; row 0 is the padding row. Rows are recycled when requests
  finish and are never cleared, so the stale tail of the previous owner stays behind (the plan only reads
  positions below the prefix).
* **prefix cache** — :class:`RadixTree`, radix-style: a finished request donates its token sequence and slots;
  later requests whose prompt starts the same way reuse the donor's slots (their chain hashes are identical
  because the chain covers content only). With EAGLE the keys are token bigrams, as in SGLang, so that the
  draft slot at the last shared position (which holds the *next* token's KV) matches too.
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
* **expected-token pool** — ``int32 [max_reqs, max_seq_len]``, filled each step by the canary's scatter from
  the requests' true token histories.

State that the canary kernels read lives in ``xp`` arrays (NumPy or CuPy); the bookkeeping a real engine keeps
on the host (free lists, request objects, the tree, and host mirrors of ``req_to_token`` and the LUT) lives in
Python and NumPy. Nothing in the step path copies device memory to the host.

Every token a request will ever see is drawn when the workload is made (prompt and "sampled" outputs), so the
engine always knows the ground truth that a correct step must reproduce.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..context import RealKvSource

# ---- workload ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadShape:
    """How requests look. Lengths are inclusive ``(low, high)`` ranges of tokens."""

    system_prompts: int = 4  # shared prefixes ("system prompts") that many requests start with
    system_len: tuple[int, int] = (16, 64)
    p_system: float = 0.6  # probability that a request starts with a system prompt
    p_followup: float = 0.2  # probability that a request continues an earlier one (multi-turn)
    suffix_len: tuple[int, int] = (8, 96)  # request-specific part of the prompt
    output_len: tuple[int, int] = (8, 64)  # tokens generated
    arrival_fraction: float = 0.6  # requests arrive during the first fraction of the steps
    max_total_len: int = 768
    vocab: int = 32000


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: its prompt followed by the tokens the engine will sample."""

    rid: int
    arrival: int
    tokens: np.ndarray  # int64 [total_len]
    prompt_len: int

    @property
    def total_len(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def output_len(self) -> int:
        return self.total_len - self.prompt_len


REFERENCE_STEPS = 200  # the shapes' output lengths are for runs this long; shorter runs get shorter outputs


def make_workload(shape: WorkloadShape, num_requests: int, steps: int, rng: np.random.Generator) -> list[RequestSpec]:
    """Draw ``num_requests`` requests arriving over the first ``arrival_fraction`` of ``steps``. Output lengths
    shrink with runs shorter than :data:`REFERENCE_STEPS`, so that requests finish, rows get recycled and the
    prefix cache fills even in a short run."""
    scale = min(1.0, max(0.1, steps / REFERENCE_STEPS))
    out_lo, out_hi = shape.output_len
    output_len = (max(1, round(out_lo * scale)), max(2, round(out_hi * scale)))

    def draw(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    def tokens(n: int) -> np.ndarray:
        return rng.integers(1, shape.vocab, size=n, dtype=np.int64)

    systems = [tokens(draw(shape.system_len)) for _ in range(max(1, shape.system_prompts))]
    last_arrival = max(1, int(steps * shape.arrival_fraction))
    arrivals = np.sort(rng.integers(0, last_arrival, size=num_requests))
    specs: list[RequestSpec] = []
    for rid, arrival in enumerate(arrivals.tolist()):
        suffix = tokens(draw(shape.suffix_len))
        output = tokens(max(1, draw(output_len)))
        roll = rng.random()
        head = np.empty(0, np.int64)
        if specs and roll < shape.p_followup:
            head = specs[int(rng.integers(len(specs)))].tokens  # the whole earlier conversation
        elif roll < shape.p_followup + shape.p_system:
            head = systems[int(rng.integers(len(systems)))]
        if head.shape[0] + suffix.shape[0] + output.shape[0] > shape.max_total_len:
            head = np.empty(0, np.int64)
        prompt = np.concatenate([head, suffix])
        if prompt.shape[0] < 2:
            prompt = np.concatenate([prompt, tokens(2)])
        room = shape.max_total_len - prompt.shape[0]
        output = output[: max(1, room)]
        specs.append(RequestSpec(rid, int(arrival), np.concatenate([prompt, output]), int(prompt.shape[0])))
    return specs


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

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_words_per_token * 8

    @property
    def max_padded_batch(self) -> int:
        fits = [b for b in self.cuda_graph_batch_sizes if b >= self.max_running]
        return max(self.max_running, min(fits) if fits else self.max_running)

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_slots": self.num_slots, "max_reqs": self.max_reqs, "max_seq_len": self.max_seq_len,
            "max_running": self.max_running, "chunk_size": self.chunk_size, "page_size": self.page_size,
            "kv_bytes_per_token": self.kv_bytes_per_token, "num_layers": self.num_layers, "with_v": self.with_v,
            "swa_window": self.swa_window, "swa_slots": self.swa_slots, "eagle": self.eagle,
        }


def size_engine(workload: list[RequestSpec], *, max_running: int, **kwargs: Any) -> EngineConfig:
    """An engine big enough for ``max_running`` of the workload's longest requests plus a prefix cache."""
    longest = max(spec.total_len for spec in workload)
    page = int(kwargs.get("page_size", 16))
    max_seq_len = -(-(longest + 8) // 64) * 64
    slots = max_running * longest + 4 * longest + 256
    slots = -(-slots // page) * page
    rows = max_running + 4  # a few spare rows; finished rows are recycled LIFO
    swa_slots = slots + 256 if kwargs.get("swa_window", 0) else 0
    return EngineConfig(num_slots=slots, max_reqs=rows, max_seq_len=max_seq_len, max_running=max_running,
                        swa_slots=swa_slots, **kwargs)


# ---- allocators --------------------------------------------------------------------------------------------


class SlotAllocator:
    """Free-list allocator over ``[1, size)`` with reference counts; slot 0 is never handed out.

    The free list is a stack: ``alloc`` pops from its end and ``free`` pushes there, so a freed slot is the
    next one handed out — the pattern under which a premature free corrupts a live request quickly.
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._free: list[int] = list(range(self.size - 1, 0, -1))
        self.refs = np.zeros(self.size, np.int32)

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray | None:
        if n > len(self._free):
            return None
        if n == 0:
            return np.empty(0, np.int64)
        out = np.array(self._free[-n:][::-1], np.int64)
        del self._free[-n:]
        self.refs[out] = 1
        return out

    def share(self, slot: int) -> None:
        self.refs[slot] += 1

    def free(self, slots: Any) -> list[int]:
        """Drop one reference per slot; returns the slots that went back to the free list."""
        released = []
        for s in np.asarray(slots, np.int64).tolist():
            if s <= 0 or self.refs[s] <= 0:
                continue  # not held: an engine refuses a double free
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self._free.append(s)
                released.append(s)
        return released

    def force_free(self, slot: int) -> None:
        """Return ``slot`` to the free list now, whatever holds it (used by fault injection only)."""
        if self.refs[slot] > 0:
            self.refs[slot] = 0
            self._free.append(int(slot))


# ---- prefix cache ------------------------------------------------------------------------------------------


class _Node:
    __slots__ = ("children", "key", "last_use", "lock", "parent", "slots", "uid")

    def __init__(self, key: np.ndarray, slots: np.ndarray, parent: _Node | None, uid: int) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, _Node] = {}
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
        self.root = _Node(np.empty(0, np.int64), np.empty(0, np.int64), None, next(self._uid))
        self.root.lock = 1
        self.size = 0  # slots held

    def _split(self, child: _Node, at: int) -> _Node:
        parent = child.parent
        assert parent is not None
        head = _Node(child.key[:at], child.slots[:at], parent, next(self._uid))
        head.lock, head.last_use = child.lock, child.last_use
        parent.children[int(head.key[0])] = head
        child.key, child.slots, child.parent = child.key[at:], child.slots[at:], head
        head.children[int(child.key[0])] = child
        return head

    def match(self, keys: np.ndarray, now: int) -> tuple[np.ndarray, _Node]:
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

    def insert(self, keys: np.ndarray, slots: np.ndarray, now: int) -> tuple[int, _Node]:
        """Add ``keys -> slots``; returns how many leading keys were cached already (their slots in
        ``slots`` are duplicates the caller frees) and the node that ends at the last key."""
        node, i = self.root, 0
        while i < keys.shape[0]:
            child = node.children.get(int(keys[i]))
            if child is None:
                leaf = _Node(keys[i:].copy(), slots[i:].copy(), node, next(self._uid))
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

    def lock(self, node: _Node, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            node = node.parent  # type: ignore[assignment]

    def _nodes(self) -> list[_Node]:
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


# ---- real KV -----------------------------------------------------------------------------------------------

_C_TOKEN = np.uint64(0x9E3779B97F4A7C15)
_C_POS = np.uint64(0xC2B2AE3D27D4EB4F)
_C_SLOT = np.uint64(0x165667B19E3779F9)
_C_WORD = np.uint64(0xD6E8FEB86659FD93)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: Any) -> Any:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class KvStore:
    """The real KV of one canary group: per layer a K (and optionally a V) tensor ``uint64 [pages, page_size,
    words]``. Slot ``s`` lives at page ``s // page_size``, row ``s % page_size`` — exactly the layout a
    :class:`~kvcanary_cupy.RealKvSource` with that page size describes.

    The "forward" stores bytes derived from (token, position, slot, layer): any change to the slot's real KV
    changes its fingerprint, and two slots never hold the same bytes.
    """

    def __init__(self, xp: Any, num_slots: int, page_size: int, words: int, layers: int, with_v: bool,
                 salt: int) -> None:
        self.page_size = page_size
        self.words = words
        self.salt = np.uint64(salt)
        pages = -(-num_slots // page_size)
        self.tensors: dict[str, list[Any]] = {
            "K": [xp.zeros((pages, page_size, words), np.uint64) for _ in range(layers)],
            "V": [xp.zeros((pages, page_size, words), np.uint64) for _ in range(layers)] if with_v else [],
        }
        self._word_ids = xp.arange(words, dtype=np.uint64)

    def write(self, dest: Any, tokens: Any, positions: Any, intended: Any) -> None:
        """Store the KV of ``tokens`` at ``positions`` (computed for slots ``intended``) into slots ``dest``."""
        if dest.shape[0] == 0:
            return
        base = _mix((tokens.astype(np.uint64) * _C_TOKEN) ^ (positions.astype(np.uint64) * _C_POS)
                    ^ (intended.astype(np.uint64) * _C_SLOT) ^ self.salt)
        page, row = dest // self.page_size, dest % self.page_size
        for k, layers in enumerate(self.tensors.values()):
            for layer, tensor in enumerate(layers):
                lane = np.uint64(1 + 64 * (2 * layer + k))
                words = _mix(base[:, None] ^ ((self._word_ids[None, :] + lane) * _C_WORD))
                tensor[page, row] = words

    def sources(self, kind: str) -> tuple[RealKvSource, ...]:
        per_token = self.words * 8
        return tuple(RealKvSource(t, page_size=self.page_size, num_bytes_per_token=per_token, read_bytes=per_token)
                     for t in self.tensors[kind])

    def flip_bit(self, kind: str, layer: int, slot: int, byte: int, bit: int) -> None:
        tensor = self.tensors[kind][layer]
        word = byte // 8
        mask = np.uint64(1 << ((byte % 8) * 8 + bit))
        page, row = slot // self.page_size, slot % self.page_size
        tensor[page, row, word] ^= mask


# ---- requests and batches ----------------------------------------------------------------------------------


class Request:
    """A live request: its row, the ground-truth slot of every position, and how far it got."""

    def __init__(self, spec: RequestSpec, rp: int, max_seq_len: int) -> None:
        self.spec = spec
        self.rid = spec.rid
        self.rp = rp
        self.slots = np.zeros(max_seq_len, np.int64)  # ground truth: slot of position p
        self.computed = 0  # positions whose KV is written
        self.assigned = 0  # positions that have a slot (computed + this step's new tokens)
        self.num_tokens = spec.prompt_len  # tokens known so far (prompt + sampled)
        self.tree_len = 0  # leading positions shared from the prefix cache
        self.node: _Node | None = None
        self.swa_evicted = 0
        self.skip_scatter = False  # set by the stale-expected-tokens fault until the first decode step
        self.recycled = False  # its row held another request before
        self.admitted_step = 0

    @property
    def tokens(self) -> np.ndarray:
        return self.spec.tokens

    @property
    def prompt_len(self) -> int:
        return self.spec.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.computed < self.spec.prompt_len

    @property
    def kv_left(self) -> int:
        return self.spec.total_len - 1 - self.computed


@dataclass
class Batch:
    """One forward step. Host arrays (``*_h``) describe the real rows; the device arrays are what the canary
    launches take (padding rows and their single garbage token are included, trailing)."""

    step: int
    reqs: list[Request]
    prefix_h: np.ndarray
    extend_h: np.ndarray
    admitted: list[Request]
    num_padding: int
    token_row: np.ndarray  # batch row of each real token
    token_pos: np.ndarray  # true position of each real token
    token_slot: np.ndarray  # full slot of each real token
    num_real_tokens: int = 0
    # device (xp) arrays
    req_pool_indices: Any = None
    prefix_lens: Any = None
    extend_seq_lens: Any = None
    valid_lens: Any = None
    input_ids: Any = None  # what the forward is fed (faults may change it)
    positions: Any = None
    out_cache_loc: Any = None
    swa_out_cache_loc: Any = None
    expected_tokens: Any = None  # the oracle: true tokens and positions
    expected_positions: Any = None
    draft_input_ids: Any = None  # EAGLE: token p + 1 for the draft slot at position p
    row_of_req: dict[int, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.reqs) + self.num_padding

    def token_index(self, row: int, position: int) -> int:
        """Flat index of the token that ``row`` writes at ``position`` this step."""
        start = int(self.extend_h[:row].sum())
        return start + position - int(self.prefix_h[row])


# ---- the engine --------------------------------------------------------------------------------------------


AssignHook = Callable[[Request, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
SpliceHook = Callable[[int, int], None]


class Engine:
    """Scheduler, memory and "model" of the synthetic engine; the canary wiring lives in the runner."""

    def __init__(self, cfg: EngineConfig, workload: list[RequestSpec], xp: Any) -> None:
        self.cfg = cfg
        self.xp = xp
        self.workload = sorted(workload, key=lambda s: (s.arrival, s.rid))
        self._arrivals = deque(self.workload)
        self.alloc = SlotAllocator(cfg.num_slots)
        self.rows_free = list(range(cfg.max_reqs - 1, 0, -1))
        self.row_used = np.zeros(cfg.max_reqs, bool)
        self.rtt_host = np.zeros((cfg.max_reqs, cfg.max_seq_len), np.int32)
        self.req_to_token = xp.zeros((cfg.max_reqs, cfg.max_seq_len), np.int32)
        self.pool_host = np.zeros((cfg.max_reqs, cfg.max_seq_len), np.int32)
        self.expected_pool = xp.zeros((cfg.max_reqs, cfg.max_seq_len), np.int32)
        self.tree = RadixTree()
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
        self._rtt_dirty: list[tuple[int, int, int]] = []
        self.rtt_overrides: dict[tuple[int, int], int] = {}  # device entries that differ from the host's (faults)
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
        """Whether the device ``req_to_token`` entry of ``req`` at ``position`` is the engine's."""
        return (req.rp, position) not in self.rtt_overrides

    def corrupt_req_to_token(self, row: int, position: int, slot: int) -> None:
        """Overwrite one device ``req_to_token`` entry behind the engine's back (fault injection); the engine
        writes the entry again when the row's owner is given a slot for that position."""
        self.req_to_token[row, position] = slot
        self.rtt_overrides[(row, position)] = slot

    # -- memory --------------------------------------------------------------------------------------------

    def _release(self, slots: Any) -> None:
        for f in self.alloc.free(slots):
            if self.swa:
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
        freed = self.tree.evict(want, self._release)
        self.stats["tree_evicted_slots"] += freed

    def _alloc(self, n: int) -> np.ndarray:
        if self.alloc.available < n:
            self._evict_tree(n - self.alloc.available)
        slots = self.alloc.alloc(n)
        if slots is None:
            raise RuntimeError(f"sim: the KV pool ran out ({n} slots wanted, {self.alloc.available} free)")
        return slots

    def _assign(self, req: Request, start: int, slots: np.ndarray) -> None:
        """Give ``req`` fresh ``slots`` for positions ``[start, start + len)`` (and SWA slots)."""
        n = slots.shape[0]
        if n == 0:
            return
        req.slots[start : start + n] = slots
        req.assigned = max(req.assigned, start + n)
        self.rtt_host[req.rp, start : start + n] = slots
        self._rtt_dirty.append((req.rp, start, start + n))
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
        self.rtt_host[req.rp, pos] = slot
        self._rtt_dirty.append((req.rp, pos, pos + 1))
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

    def flush(self) -> None:
        """Copy the host-side changes of req_to_token and the LUT to the device (one scatter each)."""
        xp = self.xp
        if self._rtt_dirty:
            for r, a, b in self._rtt_dirty if self.rtt_overrides else ():
                for pos in range(a, b):
                    self.rtt_overrides.pop((r, pos), None)
            rows = np.concatenate([np.full(b - a, r, np.int64) for r, a, b in self._rtt_dirty])
            cols = np.concatenate([np.arange(a, b, dtype=np.int64) for _, a, b in self._rtt_dirty])
            self.req_to_token[xp.asarray(rows), xp.asarray(cols)] = xp.asarray(self.rtt_host[rows, cols])
            self._rtt_dirty.clear()
        if self._lut_dirty:
            idx = np.fromiter(sorted(self._lut_dirty), np.int64)
            self.lut[xp.asarray(idx)] = xp.asarray(self.lut_host[idx])
            self._lut_dirty.clear()

    # -- scheduling ----------------------------------------------------------------------------------------

    def _swa_usable(self, slots: np.ndarray, length: int) -> int:
        """Longest ``L' <= length`` whose last window of shared positions still has SWA slots."""
        if not self.swa or length == 0:
            return length
        alive = self.lut_host[slots[:length]] != 0
        run = np.zeros(length, np.int64)
        count = 0
        for i, a in enumerate(alive.tolist()):
            count = count + 1 if a else 0
            run[i] = count
        window = self.cfg.swa_window
        for cut in range(length, 0, -1):
            if run[cut - 1] >= min(window, cut):
                return cut
        return 0

    def _admit(self, spec: RequestSpec, step: int) -> Request | None:
        if not self.rows_free:
            return None
        keys = self.keys(spec.tokens[: spec.prompt_len])
        shared, node = self.tree.match(keys, step)
        usable = self._swa_usable(shared, min(shared.shape[0], spec.prompt_len - 1))
        if usable < shared.shape[0]:
            shared, node = self.tree.match(keys[:usable], step)
            shared = shared[:usable]
        need = spec.total_len - 1 - usable + sum(r.kv_left for r in self.running)
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
        if usable:
            req.slots[:usable] = shared
            self.rtt_host[rp, :usable] = shared
            self._rtt_dirty.append((rp, 0, usable))
        self.stats["requests_admitted"] += 1
        self.stats["prefix_tokens_reused"] += usable
        return req

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
        allocated = self._alloc(int(extend.sum()))
        at = 0
        for req, e in rows:
            self._assign(req, req.computed, allocated[at : at + e])
            at += e
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
        used = self.cfg.num_slots - 1 - self.alloc.available
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
        garbage = np.full(padding, 7 + step % 89, np.int64)  # padding rows carry garbage lengths
        rpi = np.concatenate([np.array([r.rp for r in reqs], np.int64), np.zeros(padding, np.int64)])
        prefix_all = np.concatenate([prefix, garbage])
        extend_all = np.concatenate([extend, np.ones(padding, np.int64)])
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

    # -- expected-token pool -------------------------------------------------------------------------------

    def expected_token_inputs(self, batch: Batch) -> tuple[Any, Any, Any]:
        """``(flat_in, offsets, req_pool_indices)`` for the scatter: each request's true token history
        (requests flagged ``skip_scatter`` are left out, so their row keeps whatever it held)."""
        xp = self.xp
        reqs = [r for r in batch.reqs if not r.skip_scatter]
        parts = [r.tokens[: r.num_tokens] for r in reqs]
        lens = np.array([p.shape[0] for p in parts], np.int64)
        offsets = np.zeros(len(reqs) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
        for r, p in zip(reqs, parts, strict=True):
            self.pool_host[r.rp, : p.shape[0]] = p
        rpi = np.array([r.rp for r in reqs], np.int64)
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
