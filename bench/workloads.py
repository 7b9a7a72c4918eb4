"""Workloads and array-op baselines shared by the CPU and GPU benchmark suites.

Workloads are built on the host with NumPy (the GPU suite uploads them): a batch of ``bs`` requests, each
with ``prefix`` tokens already in the KV cache and ``extend`` new ones, whose slots are a random permutation
of the pool (so gathers are as scattered as in a long-running engine), an expected-token pool that agrees
with what was written, optionally an SWA window with a permuted full-to-SWA LUT, and real-KV sources.

The array-op baselines compute what the plan, verify and write kernels compute with nothing but generic
array operations (cumsum, a cumsum-built repeat, take, where, elementwise uint64 arithmetic), for any module
``xp`` with NumPy's API: NumPy on the CPU, CuPy on a GPU. They allocate freely and never read a device value
on the host, so they can be captured in a CUDA graph. Each benchmark checks them once against the real
implementation before timing anything. They cover the paths the workloads take (no padding rows, no
skipped writes, no violations recorded in a ring); the rare paths are the kernels' business, not a cost.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvcanary_cupy as kc

SLOT_FIELDS = 4  # int64 fields per canary slot
ENTRY_BYTES = 32  # one verify entry = 4 int64 (slot, expected token, position, prev slot)
REAL_KV_BYTES = 256  # bytes per slot in each real-KV source of the benchmarks
TOKEN_RANGE = 150_000  # token ids drawn from [0, TOKEN_RANGE), a large vocabulary

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
ANCHOR_HASH = np.uint64(0xDE7FAE23A9A1B716)  # splitmix64(CANARY_CHAIN_ANCHOR), SPEC §2.2


# ----------------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """One step's batch shape: ``bs`` requests, ``prefix`` cached tokens and ``extend`` new tokens each."""

    bs: int
    prefix: int
    extend: int = 1
    window: int = 0  # SWA window; 0 = full attention
    tokens: bool = True  # expected-token pool given to the plan
    sources: int = 0  # real-KV sources of REAL_KV_BYTES bytes (ALL mode) for verify / write

    @property
    def verify_entries(self) -> int:
        return self.bs * (min(self.prefix, self.window) if self.window else self.prefix)

    @property
    def write_tokens(self) -> int:
        return self.bs * self.extend

    @property
    def width(self) -> int:
        """Columns of ``req_to_token`` and of the expected-token pool."""
        return self.prefix + self.extend

    @property
    def num_slots(self) -> int:
        return 1 + self.bs * self.width

    @property
    def id(self) -> str:
        parts = [f"bs{self.bs}", f"p{self.prefix}"]
        if self.extend != 1:
            parts.append(f"e{self.extend}")
        if self.window:
            parts.append(f"swa{self.window}")
        if self.tokens:
            parts.append("tok")
        if self.sources:
            parts.append(f"kv{self.sources}x{REAL_KV_BYTES}")
        return "-".join(parts)

    def describe(self, what: str = "verify") -> str:
        """Human label of the batch, e.g. ``bs=32 prefix=1024 +tokens`` (entries are added by callers)."""
        text = f"bs={self.bs} prefix={self.prefix}"
        if what == "write" or self.extend != 1:
            text += f" extend={self.extend}"
        if self.window:
            text += f" SWA window={self.window}"
        if self.tokens and what != "write":
            text += " +expected tokens"
        if self.sources:
            text += f" +{self.sources}x{REAL_KV_BYTES} B real-KV"
        return text


def with_sources(batch: Batch, sources: int) -> Batch:
    return Batch(batch.bs, batch.prefix, batch.extend, batch.window, batch.tokens, sources)


# ----------------------------------------------------------------------------------------------------------
# host-side inputs
# ----------------------------------------------------------------------------------------------------------
@dataclass
class PlanInputs:
    """NumPy arrays for one plan launch (``capacity`` = exactly the batch's verify entries)."""

    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_seq_lens: np.ndarray
    req_to_token: np.ndarray
    full_to_swa_index_mapping: np.ndarray | None
    req_to_verify_expected_tokens: np.ndarray | None
    req_to_verify_expected_tokens_valid_lens: np.ndarray | None
    swa_window_size: int
    verify_capacity: int
    write_req_capacity: int

    def kwargs(self, convert: Callable[[np.ndarray], Any] = lambda a: a) -> dict[str, Any]:
        """Keyword arguments of ``launch_canary_plan_kernels`` (arrays passed through ``convert``)."""
        def c(a):
            return None if a is None else convert(a)

        return {
            "req_pool_indices": c(self.req_pool_indices), "prefix_lens": c(self.prefix_lens),
            "extend_seq_lens": c(self.extend_seq_lens), "req_to_token": c(self.req_to_token),
            "swa_window_size": self.swa_window_size, "full_to_swa_index_mapping": c(self.full_to_swa_index_mapping),
            "verify_capacity": self.verify_capacity,
            "req_to_verify_expected_tokens": c(self.req_to_verify_expected_tokens),
            "req_to_verify_expected_tokens_valid_lens": c(self.req_to_verify_expected_tokens_valid_lens),
            "kv_token_id_vs_position_offset": 0,
        }

    def with_lens(self, prefix: np.ndarray, extend: np.ndarray, capacity: int) -> PlanInputs:
        """The same pool and slot table with other per-request lengths (e.g. to write the whole prefix)."""
        return PlanInputs(self.req_pool_indices, prefix, extend, self.req_to_token, self.full_to_swa_index_mapping,
                          self.req_to_verify_expected_tokens, self.req_to_verify_expected_tokens_valid_lens,
                          self.swa_window_size, capacity, self.write_req_capacity)


@functools.lru_cache(maxsize=8)
def _tables(bs: int, width: int, window: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(req_to_token, token pool, LUT or None), read-only and shared by every benchmark of the session."""
    rng = np.random.default_rng(seed)
    num_slots = 1 + bs * width
    rtt = np.zeros((bs + 1, width), np.int32)
    rtt[1:] = (rng.permutation(bs * width) + 1).astype(np.int32).reshape(bs, width)
    pool = np.zeros((bs + 1, width), np.int32)
    pool[1:] = rng.integers(0, TOKEN_RANGE, size=(bs, width), dtype=np.int32)
    lut = None
    if window:
        lut = np.zeros(num_slots, np.int64)
        lut[1:] = rng.permutation(num_slots - 1) + 1
    for a in (rtt, pool, lut):
        if a is not None:
            a.flags.writeable = False
    return rtt, pool, lut


def plan_inputs(batch: Batch, seed: int = 0) -> PlanInputs:
    """Inputs of ``batch``: request r uses pool row r + 1 (row 0 is the padding row); its slots are a
    random permutation of the pool; the expected-token pool holds the tokens the requests wrote."""
    bs = batch.bs
    rtt, pool, lut = _tables(bs, batch.width, batch.window, seed)
    return PlanInputs(
        req_pool_indices=np.arange(1, bs + 1, dtype=np.int64),
        prefix_lens=np.full(bs, batch.prefix, np.int64),
        extend_seq_lens=np.full(bs, batch.extend, np.int64),
        req_to_token=rtt,
        full_to_swa_index_mapping=lut,
        req_to_verify_expected_tokens=pool if batch.tokens else None,
        req_to_verify_expected_tokens_valid_lens=np.full(bs, batch.width, np.int64) if batch.tokens else None,
        swa_window_size=batch.window,
        verify_capacity=batch.verify_entries,
        write_req_capacity=bs,
    )


LAYOUT_BLOCK = 16  # tokens per block / page in the layout benchmarks (vLLM's and FlashInfer's common size)
LAYOUT_KINDS = ("token", "block", "csr")


@functools.lru_cache(maxsize=8)
def _block_tables(bs: int, width: int, window: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(block table int32 [bs + 1, blocks], the token table it describes, LUT or None): request r owns table
    row r + 1, its blocks a random permutation of the pool's blocks (row 0 is the padding row)."""
    rng = np.random.default_rng(seed)
    blocks = -(-width // LAYOUT_BLOCK)
    table = np.zeros((bs + 1, blocks), np.int32)
    table[1:] = rng.permutation(bs * blocks).astype(np.int32).reshape(bs, blocks)
    expanded = table[:, :, None].astype(np.int64) * LAYOUT_BLOCK + np.arange(LAYOUT_BLOCK)
    rtt = np.ascontiguousarray(expanded.reshape(bs + 1, blocks * LAYOUT_BLOCK)[:, :width].astype(np.int32))
    lut = None
    if window:
        lut = rng.permutation(bs * blocks * LAYOUT_BLOCK).astype(np.int64) + 1
    for a in (table, rtt, lut):
        if a is not None:
            a.flags.writeable = False
    return table, rtt, lut


def layout_plan_kwargs(batch: Batch, kind: str, convert: Callable[[np.ndarray], Any] = lambda a: a,
                       seed: int = 0) -> dict[str, Any]:
    """Plan inputs of ``batch`` (without the plans) whose slots come from one block-structured pool, given as
    the token table ("token"), the block table ("block") or CSR page lists ("csr") of the same slots, so
    that the three launches plan the very same entries."""
    inputs = plan_inputs(batch, seed)
    table, rtt, lut = _block_tables(batch.bs, batch.width, batch.window, seed)
    kwargs = inputs.kwargs(convert)
    kwargs["full_to_swa_index_mapping"] = None if lut is None else convert(lut)
    if kind == "token":
        kwargs["req_to_token"] = convert(rtt)
        return kwargs
    del kwargs["req_to_token"]
    num_slots = table.size * LAYOUT_BLOCK
    if kind == "block":
        kwargs["layout"] = kc.BlockTable(convert(table), LAYOUT_BLOCK, num_slots=num_slots)
    elif kind == "csr":
        blocks = table.shape[1]
        indptr = np.arange(batch.bs + 1, dtype=np.int32) * blocks
        kwargs["layout"] = kc.PageList(convert(indptr), convert(np.ascontiguousarray(table[1:].reshape(-1))),
                                       LAYOUT_BLOCK, num_slots=num_slots)
    else:
        raise ValueError(kind)
    return kwargs


@dataclass
class WriteInputs:
    """Flat per-token inputs of a write launch, request-major (NumPy)."""

    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray


def write_inputs(batch: Batch, first_position: int, count: int, seed: int = 0) -> WriteInputs:
    """Tokens at positions ``[first_position, first_position + count)`` of every request of ``batch``;
    token ids are the expected-token pool's, slots the slot table's (LUT-translated for SWA)."""
    rtt, pool, lut = _tables(batch.bs, batch.width, batch.window, seed)
    cols = slice(first_position, first_position + count)
    ids = pool[1:, cols].astype(np.int64).reshape(-1)
    loc = rtt[1:, cols].astype(np.int64).reshape(-1)
    if lut is not None:
        loc = lut[loc]
    positions = np.tile(np.arange(first_position, first_position + count, dtype=np.int64), batch.bs)
    return WriteInputs(ids, positions, loc)


def source_bytes(num_slots: int, index: int) -> np.ndarray:
    """Pseudo-random uint8 [num_slots, REAL_KV_BYTES]: real-KV bytes of one source (NumPy)."""
    return np.random.default_rng(1000 + index).integers(0, 256, size=(num_slots, REAL_KV_BYTES), dtype=np.uint8)


def real_kv_sources(tensors: list[Any]) -> tuple[kc.RealKvSource, ...]:
    return tuple(kc.RealKvSource(t, page_size=1, num_bytes_per_token=REAL_KV_BYTES, read_bytes=REAL_KV_BYTES)
                 for t in tensors)


def hash_mode(batch: Batch) -> kc.RealKvHashMode:
    return kc.RealKvHashMode.ALL if batch.sources else kc.RealKvHashMode.NONE


def populate_prefix(ctx: kc.VerifyOrWriteContext, batch: Batch, convert: Callable[[np.ndarray], Any],
                    device: str, backend: str = "auto") -> None:
    """Write every request's ``prefix`` tokens into ``ctx`` (one write launch), as the engine would have
    over earlier steps, so that verifying the prefix finds a clean chain."""
    inputs = plan_inputs(batch)
    bs = batch.bs
    full = inputs.with_lens(np.zeros(bs, np.int64), np.full(bs, batch.prefix, np.int64), capacity=1)
    vp = kc.VerifyPlan.allocate(verify_capacity=1, device=device)
    wp = kc.WritePlan.allocate(write_req_capacity=bs, device=device)
    kc.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **full.kwargs(convert), backend=backend)
    tokens = write_inputs(batch, 0, batch.prefix)
    kc.launch_canary_write_kernel(
        context=ctx, plan=wp, input_ids=convert(tokens.input_ids), positions=convert(tokens.positions),
        out_cache_loc=convert(tokens.out_cache_loc), enable_write_input_assert=False, backend=backend)


# ----------------------------------------------------------------------------------------------------------
# array-op baselines (any xp with NumPy's API)
# ----------------------------------------------------------------------------------------------------------
def numpy_add_at(target: np.ndarray, index: np.ndarray, value: int) -> None:
    np.add.at(target, index, value)


def splitmix64_(xp, x, tmp=None):
    """splitmix64 finalizer of a uint64 array, in place (``tmp``: optional scratch of the same shape)."""
    return _splitmix64_(xp, x, xp.empty_like(x) if tmp is None else tmp)


def _splitmix64_(xp, x, tmp):
    xp.right_shift(x, _S30, out=tmp)
    xp.bitwise_xor(x, tmp, out=x)
    xp.multiply(x, _M1, out=x)
    xp.right_shift(x, _S27, out=tmp)
    xp.bitwise_xor(x, tmp, out=x)
    xp.multiply(x, _M2, out=x)
    xp.right_shift(x, _S31, out=tmp)
    xp.bitwise_xor(x, tmp, out=x)
    return x


def mix3_(xp, acc, b, c):
    """``acc = sm(sm(sm(acc) ^ b) ^ c)`` in place on uint64 arrays."""
    tmp = xp.empty_like(acc)
    _splitmix64_(xp, acc, tmp)
    xp.bitwise_xor(acc, b, out=acc)
    _splitmix64_(xp, acc, tmp)
    xp.bitwise_xor(acc, c, out=acc)
    return _splitmix64_(xp, acc, tmp)


def slot_hash(xp, fields, slots):
    """Chain hash (uint64) of each slot of ``fields`` (int64 [num_slots, >= 4]); negative slots -> anchor."""
    safe = xp.maximum(slots, 0)
    h = xp.ascontiguousarray(fields[safe, 2]).view(xp.uint64)
    mix3_(xp, h, xp.ascontiguousarray(fields[safe, 0]).view(xp.uint64),
          xp.ascontiguousarray(fields[safe, 1]).view(xp.uint64))
    return xp.where(slots < 0, ANCHOR_HASH, h)


def real_kv_fold(xp, sources, slots):
    """Real-KV fingerprint (uint64, ALL mode) of each slot over ``sources``, each a uint8
    [num_slots, REAL_KV_BYTES] array (page size 1)."""
    total = xp.zeros(slots.shape[0], xp.uint64)
    tmp = xp.empty_like(total)
    for data in sources:
        words = data.view(xp.uint64)[slots]  # [n, REAL_KV_BYTES // 8], one gather of the slots' rows
        acc = xp.zeros(slots.shape[0], xp.uint64)
        for w in range(words.shape[1]):
            xp.bitwise_xor(acc, words[:, w], out=acc)
            _splitmix64_(xp, acc, tmp)
        xp.bitwise_xor(total, acc, out=total)
        _splitmix64_(xp, total, tmp)
    return total


def plan_baseline(xp, add_at, a: dict[str, Any]) -> dict[str, Any]:
    """The plan (SPEC §3.3) with array operations. ``a`` holds ``launch_canary_plan_kernels``'s keyword
    arguments as xp arrays plus ``write_req_capacity``. Entries are computed for the whole capacity
    (the workloads size it to the total), so nothing is read back to the host."""
    rpi, prefix, extend, rtt = a["req_pool_indices"], a["prefix_lens"], a["extend_seq_lens"], a["req_to_token"]
    lut, pool, lens = a["full_to_swa_index_mapping"], a["req_to_verify_expected_tokens"], \
        a["req_to_verify_expected_tokens_valid_lens"]
    window, capacity, wcap = a["swa_window_size"], a["verify_capacity"], a["write_req_capacity"]
    offset = a["kv_token_id_vs_position_offset"]
    bs = rpi.shape[0]
    width = rtt.shape[1]
    active = rpi != 0
    clamped = xp.maximum(prefix, 0)
    counts = xp.where(active, xp.minimum(clamped, window) if window else clamped, 0)
    window_start = clamped - counts
    inclusive = xp.cumsum(counts)
    first = inclusive - counts
    total = inclusive[-1:]

    # repeat(arange(bs), counts) without knowing the total on the host: mark each request's first entry
    # and take the running count of marks (int32: CuPy's scatter-add has no int64 atomics).
    marks = xp.zeros(capacity + 1, xp.int32)
    add_at(marks, xp.minimum(first, capacity), 1)
    owner = xp.cumsum(marks[:capacity]) - 1
    k = xp.arange(capacity, dtype=xp.int64)
    pos = k - xp.take(first - window_start, owner)
    row_base = xp.take(rpi, owner) * width
    rtt_flat = rtt.reshape(-1)
    slot = xp.take(rtt_flat, row_base + pos).astype(xp.int64)
    prev = xp.where(pos > 0, xp.take(rtt_flat, row_base + pos - 1).astype(xp.int64), -1)
    if lut is not None:
        slot = xp.where(slot >= 0, xp.take(lut, xp.maximum(slot, 0)), slot)
        prev = xp.where(prev >= 0, xp.take(lut, xp.maximum(prev, 0)), prev)
    if pool is not None:
        source = pos + offset
        wanted = (source >= 0) & (source < xp.take(lens, owner))
        gathered = xp.take(pool.reshape(-1), xp.take(rpi, owner) * pool.shape[1] + source)
        tokens = xp.where(wanted, gathered.astype(xp.int64), -1)
    else:
        tokens = xp.full(capacity, -1, xp.int64)

    write_offsets = xp.zeros(wcap + 1, xp.int64)
    write_offsets[1 : bs + 1] = xp.cumsum(xp.where(active, xp.maximum(extend, 0), 0))
    seed_raw = xp.take(rtt_flat, rpi * width + xp.maximum(prefix - 1, 0)).astype(xp.int64)
    if lut is not None:
        seed_raw = xp.where(seed_raw >= 0, xp.take(lut, xp.maximum(seed_raw, 0)), seed_raw)
    seeds = xp.where(active & (extend > 0) & (prefix > 0), seed_raw, -1)
    return {
        "verify_slot_indices": slot, "verify_expected_tokens": tokens, "verify_expected_positions": pos,
        "verify_prev_slot_indices": prev, "verify_num_valid": xp.minimum(total, capacity).astype(xp.int32),
        "enable": (total <= capacity).astype(xp.int32), "write_offsets": write_offsets,
        "write_seed_slot_indices": seeds,
    }


def verify_baseline(xp, fields, plan: dict[str, Any], sources=(), check_tokens: bool = True):
    """FailReason bits of every verify entry (SPEC §5) with array operations; 0 = clean.
    ``fields`` is the canary as int64 [num_slots, >= 4]; ``plan`` maps VerifyPlan field names to arrays."""
    slots = plan["verify_slot_indices"]
    prev = plan["verify_prev_slot_indices"]
    stored = [xp.ascontiguousarray(fields[slots, f]) for f in range(SLOT_FIELDS)]
    expected_chain = slot_hash(xp, fields, prev).view(xp.int64)
    bits = xp.where((prev != 0) & (stored[2] != expected_chain), 1, 0)
    bits |= xp.where(stored[1] != plan["verify_expected_positions"], 2, 0)
    rkv = real_kv_fold(xp, sources, slots).view(xp.int64) if sources else 0
    bits |= xp.where(stored[3] != rkv, 4, 0)
    if check_tokens:
        expected = plan["verify_expected_tokens"]
        bits |= xp.where((expected != -1) & (stored[0] != expected), 32, 0)
    return xp.where(slots == 0, 0, bits)


def write_baseline(xp, fields, write_offsets, seeds, inputs: dict[str, Any], bs: int, per_request: int,
                   sources=()) -> None:
    """Write ``per_request`` tokens of each of ``bs`` requests into ``fields`` (SPEC §4) with array
    operations, one vector step per token rank (the chain is serial within a request)."""
    running = slot_hash(xp, fields, seeds[:bs])
    starts = write_offsets[:bs]
    for j in range(per_request):
        i = starts + j
        slot = xp.take(inputs["out_cache_loc"], i)
        token = xp.take(inputs["input_ids"], i)
        pos = xp.take(inputs["positions"], i)
        fields[slot, 0] = token
        fields[slot, 1] = pos
        fields[slot, 2] = running.view(xp.int64)
        fields[slot, 3] = real_kv_fold(xp, sources, slot).view(xp.int64) if sources else 0
        mix3_(xp, running, token.view(xp.uint64), pos.view(xp.uint64))
