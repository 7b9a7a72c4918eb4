"""Constants and enums of the canary contract: sentinels, field indices, reason bits, launch tags.

Everything here is fixed by the behaviour contract (SPEC §1) except the two status enums at the end,
which belong to this project: they report device values that a kernel refused to act on because a read
or write would have left its buffer (SPEC §0.5).
"""

from __future__ import annotations

import enum
from typing import Final

# --- sentinels -------------------------------------------------------------------------------------------
REQ_POOL_IDX_PADDING: Final[int] = 0  # a batch row whose req_pool_indices value is 0 is a padding row
TOKEN_TO_KV_SLOT_PADDING: Final[int] = 0  # slot 0 is the reserved dummy slot (and the SWA "evicted" value)
NO_SLOT: Final[int] = -1  # chain head (prev / seed slot), "skip" (write slot)
NO_EXPECTED_TOKEN: Final[int] = -1  # "skip the token check"

# --- canary slot layout ----------------------------------------------------------------------------------
CANARY_FIELD_TOKEN: Final[int] = 0
CANARY_FIELD_POSITION: Final[int] = 1
CANARY_FIELD_PREV_HASH: Final[int] = 2
CANARY_FIELD_REAL_KV_HASH: Final[int] = 3
CANARY_FIELDS_PER_SLOT: Final[int] = 4
CANARY_SLOT_BYTES: Final[int] = CANARY_FIELDS_PER_SLOT * 8

# --- violation ring row layout ---------------------------------------------------------------------------
VIOLATION_FIELD_KERNEL_KIND: Final[int] = 0
VIOLATION_FIELD_SLOT_IDX: Final[int] = 1
VIOLATION_FIELD_POSITION: Final[int] = 2
VIOLATION_FIELD_STORED_TOKEN: Final[int] = 3
VIOLATION_FIELD_EXPECTED_TOKEN: Final[int] = 4
VIOLATION_FIELD_STORED_CHAIN_HASH: Final[int] = 5
VIOLATION_FIELD_EXPECTED_AUX: Final[int] = 6
VIOLATION_FIELD_FAIL_REASON_BITS: Final[int] = 7
VIOLATION_FIELDS: Final[int] = 8

# --- chain -----------------------------------------------------------------------------------------------
CANARY_CHAIN_ANCHOR: Final[int] = 0xC0FFEE1234567890  # uint64; heads anchor on splitmix64(ANCHOR)
CANARY_CHAIN_ANCHOR_HASH: Final[int] = 0xDE7FAE23A9A1B716  # splitmix64(CANARY_CHAIN_ANCHOR), pinned in tests

# --- real-KV sources -------------------------------------------------------------------------------------
MAX_REAL_KV_SOURCES: Final[int] = 4
REAL_KV_SOURCE_FIELD_PAGE_SIZE: Final[int] = 0
REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN: Final[int] = 1
REAL_KV_SOURCE_FIELD_READ_BYTES: Final[int] = 2
REAL_KV_SOURCE_FIELDS_PER_ENTRY: Final[int] = 3
REAL_KV_ALIGN_BYTES: Final[int] = 16  # every real-KV access is one aligned 128-bit load
REAL_KV_PARTIAL_BYTES: Final[int] = 16

# --- limits ----------------------------------------------------------------------------------------------
# SGLang's plan refused batches above 4,096 requests; this project's plan kernels scan any batch in one
# launch. The limit below only keeps every per-request count comfortably inside int32 grid arithmetic.
MAX_PLAN_BATCH_SIZE: Final[int] = 1 << 24


class FailReason(enum.IntFlag):
    """Bits of violation column 7."""

    VERIFY_CHAIN_HASH_MISMATCH = 1
    VERIFY_POSITION_MISMATCH = 2
    VERIFY_REAL_KV_HASH_MISMATCH = 4
    WRITE_TOKEN_MISMATCH = 8
    WRITE_POSITION_MISMATCH = 16
    VERIFY_TOKEN_MISMATCH = 32


class RealKvHashMode(enum.IntEnum):
    NONE = 0
    PARTIAL = 1
    ALL = 2


class CanaryLaunchTag(enum.IntEnum):
    """Stamped into violation column 0; the kernels never interpret it."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


class PlanStatus(enum.IntFlag):
    """Bits of ``VerifyPlan.status``: device values the plan kernels refused to gather through.

    The plan kernels reset the word on every launch. Each affected verify entry is neutralised to
    (slot 0, expected token -1, its logical position, prev slot 0), which the verify kernel skips; an
    affected seed becomes -1. Checks run in the order of the members below and the first failing one
    names the bit, so every backend reports the same bits for the same inputs. The bits 16, 32 and 64
    concern the paged layouts (:mod:`kvcanary_cupy.layouts`) and are checked where their comments say.
    """

    REQ_POOL_INDEX_OUT_OF_RANGE = 1  # the table row of a request outside the token / block table's rows
    PAGE_INDPTR_INVALID = 64  # (2nd) kv_page_indptr[r] < 0, indptr[r+1] < indptr[r] or indptr[r+1] > nnz
    PREFIX_BEYOND_REQ_TO_TOKEN_ROW = 2  # a gathered position outside [0, req_to_token width)
    POSITION_BEYOND_BLOCKS = 32  # (3rd, paged) a gathered position beyond the row's blocks / pages
    BLOCK_ID_OUTSIDE_SLOTS = 16  # (4th) a gathered block or page id < 0 or beyond the layout's num_slots
    SWA_SLOT_OUTSIDE_LUT = 4  # a slot value >= len(full_to_swa_index_mapping)
    EXPECTED_TOKEN_BEYOND_POOL_ROW = 8  # an expected-token read outside the pool (row or column)


class CanaryStatus(enum.IntFlag):
    """Bits of ``VerifyOrWriteContext.status``, OR-accumulated by verify/write/scatter, cleared by the host.

    A slot outside ``[0, num_slots)`` is never dereferenced: verify skips the entry (still counted) or
    treats an out-of-range predecessor as unreachable; write skips the entry (not counted) or seeds an
    out-of-range seed slot from the anchor. A write request whose token range leaves the token arrays is
    skipped whole.
    """

    SLOT_OUT_OF_RANGE = 1
    TOKEN_RANGE_OUT_OF_BOUNDS = 2
    SCATTER_OUT_OF_RANGE = 4  # scatter: a request row or token segment outside its buffer
    # write: write_offsets step backwards (write_offsets[r+1] < write_offsets[r]). That request and every one
    # after it are skipped (their ranges could overlap earlier ones), so a launch writes each token at most
    # once and its work stays proportional to the tokens passed.
    WRITE_OFFSETS_OUT_OF_ORDER = 8


def reason_names(bits: int) -> list[str]:
    """Names of the FailReason bits set in ``bits`` (unknown bits as ``BIT_n``)."""
    names = [str(member.name) for member in FailReason if bits & member.value]
    known = 0
    for member in FailReason:
        known |= member.value
    unknown = bits & ~known & ((1 << 64) - 1)
    names.extend(f"BIT_{i}" for i in range(64) if unknown >> i & 1)
    return names
