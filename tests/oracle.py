"""Scalar test oracle for the kv-canary contract (SPEC §2–§6 plus the project's rules for hostile values).

Everything here is re-derived from the specification and written as plainly as possible: one request,
one position, one slot at a time, with Python integers (unbounded, so every 64-bit wrap is explicit).
It is deliberately slow. It imports nothing from ``kvcanary_cupy``, so a bug shared by the vectorized
reference and the kernels cannot hide in a helper both of them use.

NumPy arrays are accepted at the boundaries and converted to Python ints on entry; arrays handed in
are never modified, except the scatter output buffer, which is the point of ``scatter_oracle``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

U64_MASK = (1 << 64) - 1
U32_MASK = (1 << 32) - 1
ANCHOR = 0xC0FFEE1234567890

# Real-KV hash modes (SPEC §1.5).
MODE_NONE = 0
MODE_PARTIAL = 1
MODE_ALL = 2

# FailReason bits (SPEC §1.3).
VERIFY_CHAIN_HASH_MISMATCH = 1
VERIFY_POSITION_MISMATCH = 2
VERIFY_REAL_KV_HASH_MISMATCH = 4
WRITE_TOKEN_MISMATCH = 8
WRITE_POSITION_MISMATCH = 16
VERIFY_TOKEN_MISMATCH = 32

# Plan status bits (project rule, SPEC §0.5), in the order the checks run.
PLAN_REQ_POOL_INDEX_OUT_OF_RANGE = 1
PLAN_PREFIX_BEYOND_REQ_TO_TOKEN_ROW = 2
PLAN_SWA_SLOT_OUTSIDE_LUT = 4
PLAN_EXPECTED_TOKEN_BEYOND_POOL_ROW = 8

# Context status bits of verify / write / scatter (project rule, SPEC §0.5).
STATUS_SLOT_OUT_OF_RANGE = 1
STATUS_TOKEN_RANGE_OUT_OF_BOUNDS = 2
STATUS_SCATTER_OUT_OF_RANGE = 4
STATUS_WRITE_OFFSETS_OUT_OF_ORDER = 8

FIELDS_PER_SLOT = 4
VIOLATION_FIELDS = 8



@dataclass(frozen=True)
class StridedSource:
    """A real-KV source described by byte strides (a KvByteLayout) over a flat byte buffer.

    ``data`` holds every byte from the tensor's first onward. Slot ``s``'s logical bytes are, for each head
    ``h`` and element ``e`` in order, the ``element_bytes`` bytes at ``(s // page_size) * page_stride +
    (s % page_size) * token_stride + h * head_stride + e * element_stride``. A nonzero ``tokens_per_tile``
    replaces the token's term with ``(o // tokens_per_tile) * tile_stride + (o % tokens_per_tile) *
    token_stride`` (``o = s % page_size``), a nonzero ``elements_per_group`` the element's with ``(e //
    elements_per_group) * group_stride + (e % elements_per_group) * element_stride``.
    """

    data: bytes
    page_size: int
    page_stride: int
    token_stride: int
    head_stride: int
    element_stride: int
    num_heads: int
    elements_per_head: int
    element_bytes: int
    read_bytes: int
    tokens_per_tile: int = 0
    tile_stride: int = 0
    elements_per_group: int = 0
    group_stride: int = 0

    def logical_bytes(self, slot: int, nbytes: int) -> bytes:
        """The first ``nbytes`` of ``slot``'s logical stream, byte by byte."""
        out = bytearray()
        o = slot % self.page_size
        if self.tokens_per_tile:
            token_term = (o // self.tokens_per_tile) * self.tile_stride + (o % self.tokens_per_tile) * self.token_stride
        else:
            token_term = o * self.token_stride
        token = (slot // self.page_size) * self.page_stride + token_term
        for h in range(self.num_heads):
            for e in range(self.elements_per_head):
                if self.elements_per_group:
                    element_term = ((e // self.elements_per_group) * self.group_stride
                                    + (e % self.elements_per_group) * self.element_stride)
                else:
                    element_term = e * self.element_stride
                start = token + h * self.head_stride + element_term
                for b in range(self.element_bytes):
                    if len(out) == nbytes:
                        return bytes(out)
                    if not 0 <= start + b < len(self.data):
                        raise IndexError(f"slot {slot} reads byte {start + b} outside a {len(self.data)}-byte source")
                    out.append(self.data[start + b])
        if len(out) != nbytes:
            raise ValueError(f"slot {slot}: the stream holds {len(out)} bytes, fewer than {nbytes}")
        return bytes(out)


# A real-KV source as the oracle takes it: (uint8 [rows, row_bytes] array, page_size,
# num_bytes_per_token, read_bytes), or a StridedSource.
Source = tuple[np.ndarray, int, int, int] | StridedSource


# ----------------------------------------------------------------------------------------------------------
# integer helpers
# ----------------------------------------------------------------------------------------------------------
def to_u64(x: int) -> int:
    """The 64 low bits of ``x`` read as unsigned."""
    return int(x) & U64_MASK


def to_i64(x: int) -> int:
    """The 64 low bits of ``x`` read as signed two's complement."""
    x = int(x) & U64_MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def to_i32(x: int) -> int:
    """The 32 low bits of ``x`` read as signed two's complement (int64 -> int32 store)."""
    x = int(x) & U32_MASK
    return x - (1 << 32) if x >= 1 << 31 else x


def _scalar(x: Any) -> int:
    """A Python int from an int, a NumPy scalar, or a one-element array (device scalars are int32[1])."""
    if isinstance(x, np.ndarray):
        if x.size != 1:
            raise ValueError(f"expected a one-element array, got shape {x.shape}")
        return int(x.reshape(-1)[0])
    return int(x)


def _ints(a: Any) -> list[int]:
    """A flat list of Python ints from a 1-D array-like."""
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {arr.shape}")
    return [int(v) for v in arr.tolist()]


def _rows_of(a: Any) -> tuple[list[list[int]], int, int]:
    """A 2-D array-like as (list of row lists, rows, width); width survives zero rows."""
    arr = np.asarray(a)
    if arr.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {arr.shape}")
    return arr.tolist(), int(arr.shape[0]), int(arr.shape[1])


# ----------------------------------------------------------------------------------------------------------
# hashes (SPEC §2)
# ----------------------------------------------------------------------------------------------------------
def splitmix64(x: int) -> int:
    """The splitmix64 finalizer (no golden-ratio increment), mod 2**64 with logical shifts."""
    x = to_u64(x)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & U64_MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & U64_MASK
    x ^= x >> 31
    return x


def mix3(a: int, b: int, c: int) -> int:
    """Chain step: sm(sm(sm(a) ^ b) ^ c), inputs taken as unsigned 64-bit."""
    h = splitmix64(to_u64(a))
    h = splitmix64(h ^ to_u64(b))
    return splitmix64(h ^ to_u64(c))


def anchor_hash() -> int:
    """The hash every chain head stores as its prev_hash (unsigned)."""
    return splitmix64(ANCHOR)


def slot_hash(fields: Sequence[Sequence[int]], s: int) -> int:
    """Unsigned chain hash of slot ``s`` (what its successor stores as prev_hash); ``s < 0`` -> anchor.

    The real-KV hash is deliberately NOT part of the chain (SPEC §2.2).
    """
    if s < 0:
        return anchor_hash()
    token, position, prev_hash = fields[s][0], fields[s][1], fields[s][2]
    return mix3(prev_hash, token, position)


def fold_source_bytes(data: bytes, nbytes: int) -> int:
    """Fold the first ``nbytes`` bytes (a multiple of 16) with the lo/hi walk of SPEC §2.3."""
    if nbytes % 16 != 0 or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative multiple of 16, got {nbytes}")
    if len(data) < nbytes:
        raise ValueError(f"need {nbytes} bytes, got {len(data)}")
    acc = 0
    for off in range(0, nbytes, 16):
        lo = int.from_bytes(data[off : off + 8], "little")
        hi = int.from_bytes(data[off + 8 : off + 16], "little")
        acc = splitmix64(acc ^ lo)
        acc = splitmix64(acc ^ hi)
    return acc


def real_kv_hash(slot: int, sources: Sequence[Source], mode: int) -> int:
    """Unsigned real-KV fingerprint of ``slot`` over ``sources`` (list order matters); 0 for NONE / none."""
    if mode == MODE_NONE or len(sources) == 0:
        # NONE never dereferences the sources, so garbage (even too-small) sources are fine here.
        return 0
    total = 0
    for source in sources:
        if isinstance(source, StridedSource):
            eff = 16 if mode == MODE_PARTIAL else source.read_bytes
            total = splitmix64(total ^ fold_source_bytes(source.logical_bytes(slot, eff), eff))
            continue
        tensor, page_size, num_bytes_per_token, read_bytes = source
        arr = np.asarray(tensor)
        if arr.dtype != np.uint8 or arr.ndim != 2:
            raise ValueError("a real-KV source must be a uint8 [rows, row_bytes] array")
        page_size, num_bytes_per_token, read_bytes = int(page_size), int(num_bytes_per_token), int(read_bytes)
        eff = 16 if mode == MODE_PARTIAL else read_bytes
        row = slot // page_size
        col = (slot % page_size) * num_bytes_per_token
        if not (0 <= row < arr.shape[0]) or col + eff > arr.shape[1]:
            # The contract makes this the caller's precondition; the oracle refuses rather than guess.
            raise IndexError(f"slot {slot} lies outside a real-KV source of shape {arr.shape}")
        data = arr[row, col : col + eff].tobytes()
        total = splitmix64(total ^ fold_source_bytes(data, eff))
    return total


# ----------------------------------------------------------------------------------------------------------
# plan (SPEC §3.3 + project rules)
# ----------------------------------------------------------------------------------------------------------
@dataclass
class PlanExpect:
    """What one plan launch must produce.

    ``entries`` holds the ``verify_num_valid`` verify entries as (slot, expected_token, position, prev_slot),
    or is None on overflow (no entry may be written). ``write_offsets`` covers indices [0, bs]; the
    ``write_offsets_tail_zeros`` entries after index bs must be zero. ``verify_offsets`` are the exclusive
    prefix sums of the per-request verify counts, each clamped to ``verify_capacity + 1``.
    """

    entries: list[tuple[int, int, int, int]] | None
    verify_num_valid: int
    enable: int
    write_offsets: list[int]
    write_offsets_tail_zeros: int
    seeds: list[int]
    write_num_valid_reqs: int
    status: int
    verify_offsets: list[int]


def plan_oracle(
    *,
    req_pool_indices: Any,
    prefix_lens: Any,
    extend_seq_lens: Any,
    req_to_token: Any,
    swa_window_size: int,
    full_to_swa_index_mapping: Any | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: Any | None,
    req_to_verify_expected_tokens_valid_lens: Any | None,
    kv_token_id_vs_position_offset: int,
    write_req_capacity: int,
) -> PlanExpect:
    """Expected outputs of ``launch_canary_plan_kernels`` for one launch, request by request."""
    rps = _ints(req_pool_indices)
    prefixes = _ints(prefix_lens)
    extends = _ints(extend_seq_lens)
    bs = len(rps)
    if len(prefixes) != bs or len(extends) != bs:
        raise ValueError("per-request inputs must all have length bs")
    table, table_rows, table_width = _rows_of(req_to_token)
    window = int(swa_window_size)
    capacity = int(verify_capacity)
    wcap = int(write_req_capacity)
    offset = int(kv_token_id_vs_position_offset)
    lut = None if full_to_swa_index_mapping is None else _ints(full_to_swa_index_mapping)
    if window > 0 and lut is None:
        raise ValueError("swa_window_size > 0 requires full_to_swa_index_mapping")
    if capacity <= 0 or wcap <= 0:
        raise ValueError("plan capacities must be positive")
    if bs > wcap:
        raise ValueError("bs > write_req_capacity")
    pool: list[list[int]] | None = None
    pool_rows = pool_width = 0
    valid_lens: list[int] = []
    if req_to_verify_expected_tokens is not None:
        if req_to_verify_expected_tokens_valid_lens is None:
            raise ValueError("req_to_verify_expected_tokens_valid_lens is required with the pool")
        pool, pool_rows, pool_width = _rows_of(req_to_verify_expected_tokens)
        valid_lens = _ints(req_to_verify_expected_tokens_valid_lens)
        if len(valid_lens) != bs:
            raise ValueError("valid lens must have length bs")

    status = 0

    def lut_ok(raw: int) -> bool:
        # Negative req_to_token values pass through T untouched, so only non-negative ones need the LUT.
        return lut is None or raw < 0 or raw < len(lut)

    def translate(raw: int) -> int:
        if lut is None or raw < 0:
            return raw
        return lut[raw]

    # Per-request window start and counts.
    window_starts: list[int] = []
    verify_counts: list[int] = []
    write_counts: list[int] = []
    for r in range(bs):
        rp, p, e = rps[r], prefixes[r], extends[r]
        if rp == 0:
            # Padding rows contribute nothing, whatever garbage their lengths hold.
            window_starts.append(0)
            verify_counts.append(0)
            write_counts.append(0)
            continue
        v = min(max(p, 0), window) if window > 0 else max(p, 0)
        # max(P, 0) - V equals max(0, P - window) but cannot overflow for P near the int64 limits.
        window_starts.append(max(p, 0) - v)
        verify_counts.append(v)
        write_counts.append(max(e, 0))

    # Saturated counting: any request above C already overflows the plan, so clamping it to C + 1 changes
    # nothing observable while keeping every partial sum small.
    verify_offsets = [0]
    for r in range(bs):
        verify_offsets.append(verify_offsets[-1] + min(verify_counts[r], capacity + 1))
    total = verify_offsets[-1]

    # Write offsets wrap like an int64 cumsum.
    write_offsets = [0]
    acc = 0
    for r in range(bs):
        acc = (acc + write_counts[r]) & U64_MASK
        write_offsets.append(to_i64(acc))

    overflow = total > capacity
    entries: list[tuple[int, int, int, int]] | None = None
    if not overflow:
        entries = []
        for r in range(bs):
            rp = rps[r]
            for j in range(verify_counts[r]):
                pos = window_starts[r] + j
                neutral = (0, -1, pos, 0)
                if not (0 <= rp < table_rows):
                    status |= PLAN_REQ_POOL_INDEX_OUT_OF_RANGE
                    entries.append(neutral)
                    continue
                if pos >= table_width:
                    status |= PLAN_PREFIX_BEYOND_REQ_TO_TOKEN_ROW
                    entries.append(neutral)
                    continue
                raw = table[rp][pos]
                raw_prev = table[rp][pos - 1] if pos > 0 else None
                if not lut_ok(raw) or (raw_prev is not None and not lut_ok(raw_prev)):
                    status |= PLAN_SWA_SLOT_OUTSIDE_LUT
                    entries.append(neutral)
                    continue
                slot = translate(raw)
                prev = translate(raw_prev) if raw_prev is not None else -1
                expected = -1
                if pool is not None:
                    sot = pos + offset
                    if 0 <= sot < valid_lens[r]:
                        if rp >= pool_rows or sot >= pool_width:
                            status |= PLAN_EXPECTED_TOKEN_BEYOND_POOL_ROW
                            entries.append(neutral)
                            continue
                        expected = pool[rp][sot]
                entries.append((slot, expected, pos, prev))

    # Seeds are produced whether or not the verify side overflowed.
    seeds: list[int] = []
    for r in range(bs):
        rp, p, e = rps[r], prefixes[r], extends[r]
        if rp == 0 or e <= 0 or p <= 0:
            seeds.append(-1)
            continue
        if not (0 <= rp < table_rows):
            status |= PLAN_REQ_POOL_INDEX_OUT_OF_RANGE
            seeds.append(-1)
            continue
        if p - 1 >= table_width:
            status |= PLAN_PREFIX_BEYOND_REQ_TO_TOKEN_ROW
            seeds.append(-1)
            continue
        raw = table[rp][p - 1]
        if not lut_ok(raw):
            status |= PLAN_SWA_SLOT_OUTSIDE_LUT
            seeds.append(-1)
            continue
        seeds.append(translate(raw))

    return PlanExpect(
        entries=entries,
        verify_num_valid=capacity if overflow else total,
        enable=0 if overflow else 1,
        write_offsets=write_offsets,
        write_offsets_tail_zeros=wcap - bs,
        seeds=seeds,
        write_num_valid_reqs=bs,
        status=status,
        verify_offsets=verify_offsets,
    )


# ----------------------------------------------------------------------------------------------------------
# canary state shared by write and verify
# ----------------------------------------------------------------------------------------------------------
@dataclass
class CanaryState:
    """Host copy of everything write/verify touch.

    ``fields[s]`` = [token, position, prev_hash, real_kv_hash] of slot s as signed int64 values.
    ``ring`` is the full violation ring (``ring_capacity`` rows of 8 ints) as it must look after the
    launches so far, rows never written keeping their initial content. ``rows`` lists EVERY row appended by
    oracle launches on this state, in the reference's order (request/entry order), including rows that
    were dropped because the ring was full; ``rows[k]`` got sequence number ``initial write_index + k``.
    """

    fields: list[list[int]]
    ring_capacity: int
    ring: list[list[int]] = field(default_factory=list)
    rows: list[list[int]] = field(default_factory=list)
    write_index: int = 0
    slot_run_counter: int = 0
    kernel_run_counter: int = 0
    status: int = 0
    # The original byte buffer, so that to_canary_array() keeps the bytes beyond the 4 fields of a slot.
    canary_template: np.ndarray | None = None

    def __post_init__(self) -> None:
        # A state built by hand without a ring starts from an all-zero one.
        if not self.ring:
            self.ring = [[0] * VIOLATION_FIELDS for _ in range(self.ring_capacity)]
        if len(self.ring) != self.ring_capacity:
            raise ValueError("ring must have ring_capacity rows")

    @classmethod
    def from_arrays(
        cls,
        canary_buf: np.ndarray,
        ring: np.ndarray,
        write_index: Any = 0,
        slot_counter: Any = 0,
        kernel_counter: Any = 0,
        status: Any = 0,
    ) -> CanaryState:
        """Build a state from a uint8 [num_slots, stride] buffer, an int64 [capacity, 8] ring and scalars."""
        buf = np.asarray(canary_buf)
        if buf.dtype != np.uint8 or buf.ndim != 2 or buf.shape[1] < FIELDS_PER_SLOT * 8:
            raise ValueError("canary buffer must be uint8 [num_slots, stride >= 32]")
        ring_arr = np.asarray(ring)
        if ring_arr.ndim != 2 or ring_arr.shape[1] != VIOLATION_FIELDS:
            raise ValueError("ring must be [capacity, 8]")
        words = np.ascontiguousarray(buf[:, : FIELDS_PER_SLOT * 8]).view("<i8")
        return cls(
            fields=[[int(v) for v in row] for row in words.tolist()],
            ring_capacity=int(ring_arr.shape[0]),
            ring=[[int(v) for v in row] for row in ring_arr.astype(np.int64).tolist()],
            rows=[],
            write_index=_scalar(write_index),
            slot_run_counter=_scalar(slot_counter),
            kernel_run_counter=_scalar(kernel_counter),
            status=_scalar(status),
            canary_template=buf.copy(),
        )

    @property
    def num_slots(self) -> int:
        return len(self.fields)

    def load_canary(self, canary_buf: np.ndarray) -> None:
        """Replace the slot fields (and template) from a buffer, e.g. after injecting a corruption."""
        other = CanaryState.from_arrays(canary_buf, np.zeros((1, VIOLATION_FIELDS), np.int64))
        self.fields = other.fields
        self.canary_template = other.canary_template

    def append_row(self, row: Sequence[int]) -> None:
        """Fill-once ring append: every row takes a sequence number; it lands only below the capacity."""
        if len(row) != VIOLATION_FIELDS:
            raise ValueError("a violation row has 8 fields")
        row = [to_i64(v) for v in row]
        seq = self.write_index
        self.write_index += 1
        self.rows.append(row)
        if 0 <= seq < self.ring_capacity:
            self.ring[seq] = row

    def to_ring_array(self) -> np.ndarray:
        """The ring as an int64 [capacity, 8] array."""
        return np.array(self.ring, dtype=np.int64).reshape(self.ring_capacity, VIOLATION_FIELDS)

    def to_canary_array(self) -> np.ndarray:
        """The canary buffer as uint8 [num_slots, stride]; bytes past the 4 fields are the original ones."""
        words = np.array(self.fields, dtype="<i8").reshape(self.num_slots, FIELDS_PER_SLOT)
        if self.canary_template is None:
            return words.view(np.uint8).reshape(self.num_slots, FIELDS_PER_SLOT * 8).copy()
        out = self.canary_template.copy()
        out[:, : FIELDS_PER_SLOT * 8] = words.view(np.uint8).reshape(self.num_slots, FIELDS_PER_SLOT * 8)
        return out

    def landed_rows(self) -> int:
        """Valid ring rows as the host derives them: min(write_index, capacity)."""
        return max(0, min(self.write_index, self.ring_capacity))


# ----------------------------------------------------------------------------------------------------------
# write (SPEC §4 + project rules)
# ----------------------------------------------------------------------------------------------------------
def write_oracle(
    state: CanaryState,
    *,
    kernel_kind: int,
    write_offsets: Any,
    write_seed_slot_indices: Any,
    write_num_valid_reqs: Any,
    input_ids: Any,
    positions: Any,
    out_cache_loc: Any,
    enable_write_input_assert: bool,
    expected_input_tokens: Any | None,
    expected_input_positions: Any | None,
    sources: Sequence[Source],
    mode: int,
    enable_chain_position_assert: Any,
) -> None:
    """Apply one write launch to ``state``, requests in batch order, entries in order."""
    offsets = _ints(write_offsets)
    seeds = _ints(write_seed_slot_indices)
    tokens = _ints(input_ids)
    pos_in = _ints(positions)
    locs = _ints(out_cache_loc)
    num_tokens = len(tokens)
    if len(pos_in) != num_tokens or len(locs) != num_tokens:
        raise ValueError("input_ids, positions and out_cache_loc must have the same length")
    if len(offsets) != len(seeds) + 1:
        raise ValueError("write_offsets must have W + 1 entries")
    exp_tokens: list[int] = []
    exp_positions: list[int] = []
    if enable_write_input_assert:
        if expected_input_tokens is None or expected_input_positions is None:
            raise ValueError("the write input assert needs both expected tensors")
        exp_tokens = _ints(expected_input_tokens)
        exp_positions = _ints(expected_input_positions)
    chain_flag = _scalar(enable_chain_position_assert)
    tag = int(kernel_kind)
    mode = int(mode)
    fields = state.fields
    num_slots = state.num_slots

    state.kernel_run_counter += 1
    active = min(max(_scalar(write_num_valid_reqs), 0), len(seeds))
    # From the first request whose offsets run backwards on, no request is written (and the status says so).
    first_backward = next((r for r in range(active) if offsets[r + 1] < offsets[r]), active)
    if first_backward < active:
        state.status |= STATUS_WRITE_OFFSETS_OUT_OF_ORDER
    for r in range(first_backward):
        lo, hi = offsets[r], offsets[r + 1]
        # Exact comparison: a request with hi <= lo owns no token, whatever the magnitudes.
        if hi <= lo:
            continue
        if lo < 0 or hi > num_tokens:
            state.status |= STATUS_TOKEN_RANGE_OUT_OF_BOUNDS
            continue
        seed = seeds[r]
        if seed >= num_slots:
            state.status |= STATUS_SLOT_OUT_OF_RANGE
            seed = -1
        running = slot_hash(fields, seed)
        chain_check = seed >= 0 and chain_flag != 0
        running_pos = fields[seed][1] if seed >= 0 else 0
        written = 0
        for i in range(lo, hi):
            slot = locs[i]
            if slot < 0:
                continue
            if slot >= num_slots:
                state.status |= STATUS_SLOT_OUT_OF_RANGE
                continue
            token, pos = tokens[i], pos_in[i]
            rkv = real_kv_hash(slot, sources, mode)
            if enable_write_input_assert:
                bits = 0
                if token != exp_tokens[i]:
                    bits |= WRITE_TOKEN_MISMATCH
                if pos != exp_positions[i]:
                    bits |= WRITE_POSITION_MISMATCH
                if bits:
                    state.append_row(
                        [tag, slot, pos, token, exp_tokens[i], to_i64(running), exp_positions[i], bits]
                    )
            if chain_check:
                # Positions are int64 on the device, so running_pos + 1 wraps at the int64 limit.
                want = to_i64(running_pos + 1)
                if pos != want:
                    state.append_row(
                        [tag, slot, pos, token, token, to_i64(running), want, WRITE_POSITION_MISMATCH]
                    )
                running_pos = pos
            fields[slot] = [token, pos, to_i64(running), to_i64(rkv)]
            # Advance on the actual values, so an input-assert mismatch never cascades.
            running = mix3(running, token, pos)
            written += 1
        state.slot_run_counter += written


# ----------------------------------------------------------------------------------------------------------
# verify (SPEC §5 + project rules)
# ----------------------------------------------------------------------------------------------------------
def verify_oracle(
    state: CanaryState,
    *,
    kernel_kind: int,
    verify_slot_indices: Any,
    verify_expected_tokens: Any,
    verify_expected_positions: Any,
    verify_prev_slot_indices: Any,
    verify_num_valid: Any,
    enable: Any,
    check_verify_expected_token: bool,
    sources: Sequence[Source],
    mode: int,
    twin: CanaryState | None = None,
) -> None:
    """Apply one verify launch to ``state`` (read-only on the slots), entries in order. ``twin``: the state a
    verify of the same plan just checked; an entry whose record (and predecessor record, when 0 < prev <
    num_slots) equals the twin's, field by field, is skipped."""
    state.kernel_run_counter += 1
    if _scalar(enable) == 0:
        return
    slots = _ints(verify_slot_indices)
    exp_positions = _ints(verify_expected_positions)
    prevs = _ints(verify_prev_slot_indices)
    capacity = len(slots)
    if len(exp_positions) != capacity or len(prevs) != capacity:
        raise ValueError("verify plan arrays must share one capacity")
    exp_tokens = _ints(verify_expected_tokens) if check_verify_expected_token else []
    tag = int(kernel_kind)
    mode = int(mode)
    fields = state.fields
    num_slots = state.num_slots

    active = min(max(_scalar(verify_num_valid), 0), capacity)
    # Every active entry counts, slot-0 and out-of-range ones included.
    state.slot_run_counter += active
    for k in range(active):
        slot = slots[k]
        if slot == 0:
            continue
        if slot < 0 or slot >= num_slots:
            state.status |= STATUS_SLOT_OUT_OF_RANGE
            continue
        stored_token, stored_pos, stored_prev, stored_rkv = fields[slot][:4]
        expected_token = exp_tokens[k] if check_verify_expected_token else -1
        prev = prevs[k]
        if (twin is not None and prev < num_slots and list(fields[slot][:4]) == list(twin.fields[slot][:4])
                and (prev <= 0 or list(fields[prev][:4]) == list(twin.fields[prev][:4]))):
            continue
        reachable = prev != 0
        if prev >= num_slots:
            state.status |= STATUS_SLOT_OUT_OF_RANGE
            reachable = False
        # prev 0 (unfilled / evicted) or out of range: no chain check, the row shows the stored hash.
        exp_chain = to_i64(slot_hash(fields, prev)) if reachable else stored_prev
        exp_rkv = to_i64(real_kv_hash(slot, sources, mode))
        bits = 0
        if reachable and stored_prev != exp_chain:
            bits |= VERIFY_CHAIN_HASH_MISMATCH
        if check_verify_expected_token and expected_token != -1 and stored_token != expected_token:
            bits |= VERIFY_TOKEN_MISMATCH
        if stored_pos != exp_positions[k]:
            bits |= VERIFY_POSITION_MISMATCH
        if stored_rkv != exp_rkv:
            bits |= VERIFY_REAL_KV_HASH_MISMATCH
        if bits:
            state.append_row(
                [tag, slot, stored_pos, stored_token, expected_token, stored_prev, exp_chain, bits]
            )


# ----------------------------------------------------------------------------------------------------------
# scatter (SPEC §6 + project rules)
# ----------------------------------------------------------------------------------------------------------
def scatter_oracle(*, flat_in: Any, offsets: Any, req_pool_indices: Any, pool_out: np.ndarray) -> int:
    """Fill ``pool_out`` (int32 2-D, in place) element by element; return the status bits raised."""
    flat = _ints(flat_in)
    offs = _ints(offsets)
    rps = _ints(req_pool_indices)
    if len(offs) != len(rps) + 1:
        raise ValueError("offsets must have bs + 1 entries")
    if pool_out.ndim != 2 or pool_out.dtype != np.int32:
        raise ValueError("pool_out must be int32 2-D")
    rows, width = int(pool_out.shape[0]), int(pool_out.shape[1])
    status = 0
    for r, rp in enumerate(rps):
        start, end = offs[r], offs[r + 1]
        if end <= start:
            continue
        if rp < 0 or rp >= rows or start < 0 or end > len(flat):
            status |= STATUS_SCATTER_OUT_OF_RANGE
            continue
        n = min(end - start, width)
        for c in range(n):
            pool_out[rp, c] = to_i32(flat[start + c])
    return status
