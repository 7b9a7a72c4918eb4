"""Hypothesis strategies for the kv-canary differential tests.

Each strategy returns a plain dataclass of NumPy arrays with the exact dtypes of the contract (SPEC §3.1,
§4, §5, §6), all C-contiguous, so a test can hand the same case to the oracle (``tests/oracle.py``) and to
any backend. Structural choices (batch size, kinds of layout, per-request lengths) are drawn through
Hypothesis so that failures shrink meaningfully; bulk content (slot tables, pools, random bytes) comes from
a NumPy generator seeded by one drawn integer, which keeps large examples cheap to generate.

``hostile=True`` adds device values that the kernels must refuse to act on (SPEC §0.5): out-of-range rows
and slots, prefixes past the end of a row, LUT-escaping slot numbers, token ranges outside the token arrays,
and counts outside their capacities. Inputs that only the host could reject (wrong dtypes, shapes,
capacities) are never produced: those belong to the validation tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

if __package__:
    from . import oracle
else:  # imported as a top-level module (tests/ on sys.path)
    import oracle

I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
I32_MIN = -(1 << 31)
I32_MAX = (1 << 31) - 1

BOUNDARY_TOKENS = (0, 1, 0xFFFFFFFF, -1, 0x80000000, 0x7FFFFFFF, I64_MIN, I64_MAX)
PLAN_WIDTHS = (1, 2, 3, 5, 8, 16, 64, 128, 256)
# A verify total above this is never given a "loose" capacity: the plan would only allocate and loop.
MAX_MATERIALISED_TOTAL = 20_000


def _rng(draw: st.DrawFn) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _i64(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))


def _verify_count(rp: int, p: int, window: int) -> int:
    """V_r of SPEC §3.3, only to size the capacity; the oracle derives it on its own."""
    if rp == 0:
        return 0
    return min(max(p, 0), window) if window > 0 else max(p, 0)


def _draw_capacity(draw: st.DrawFn, total: int) -> int:
    if total > MAX_MATERIALISED_TOTAL:
        return draw(st.integers(1, 64))
    # Weighted towards capacities that hold the plan, so most examples materialise their entries.
    kind = draw(st.sampled_from(["loose", "loose", "loose", "exact", "exact", "one_short", "one"]))
    if kind == "loose":
        return total + draw(st.integers(1, 10))
    if kind == "exact":
        return max(total, 1)
    if kind == "one_short":
        return max(total - 1, 1)
    return 1


# ----------------------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------------------
@dataclass
class PlanCase:
    """One plan launch.

    ``kwargs`` holds exactly the plan inputs: ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens``
    (int64 [bs]), ``req_to_token`` (int32 [max_reqs, max_seq_len]), ``swa_window_size`` (int),
    ``full_to_swa_index_mapping`` (int64 [n] or None), ``verify_capacity`` (int),
    ``req_to_verify_expected_tokens`` (int32 [rows, width] or None),
    ``req_to_verify_expected_tokens_valid_lens`` (int64 [bs] or None, given iff the pool is) and
    ``kv_token_id_vs_position_offset`` (int). ``write_req_capacity`` is the W of the WritePlan (>= bs, >= 1).
    """

    kwargs: dict[str, Any]
    write_req_capacity: int

    @property
    def bs(self) -> int:
        return int(self.kwargs["req_pool_indices"].shape[0])

    def oracle_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``oracle.plan_oracle``."""
        return {**self.kwargs, "write_req_capacity": self.write_req_capacity}


def _make_lut(draw: st.DrawFn, rng: np.random.Generator, pool_size: int, kind: str) -> np.ndarray:
    n = pool_size + 1
    if kind == "identity":
        lut = np.arange(n, dtype=np.int64)
    elif kind == "shift":
        lut = np.arange(n, dtype=np.int64) + 100
        lut[0] = 0
    else:  # permutation of the SWA slot space (slot 0 stays the dummy)
        lut = np.concatenate([[0], rng.permutation(np.arange(1, n, dtype=np.int64))]).astype(np.int64)
    if draw(st.booleans()):
        # Evicted entries translate to 0, which verify treats as "no chain check".
        evicted = rng.random(n) < draw(st.sampled_from([0.05, 0.3, 1.0]))
        lut[evicted] = 0
    return np.ascontiguousarray(lut)


@st.composite
def plan_cases(
    draw: st.DrawFn,
    max_bs: int = 16,
    hostile: bool = False,
    allow_large_bs: bool = False,
    lut_without_window: bool = True,
) -> PlanCase:
    """Random plan launches (SPEC §8 item 19 and more).

    ``lut_without_window`` lets a FULL-group launch (window 0) carry a LUT, which is then applied anyway.
    ``allow_large_bs`` occasionally produces a batch of thousands of rows (up to 70,000), mostly padding
    and decode rows so that it stays cheap.
    """
    if allow_large_bs and draw(st.integers(0, 19)) == 0:
        return draw(_large_plan_cases(hostile=hostile))
    rng = _rng(draw)
    bs = draw(st.integers(0, max_bs))
    width = draw(st.sampled_from(PLAN_WIDTHS))

    padding_kind = draw(st.sampled_from(["none", "trailing", "interleaved"]))
    if padding_kind == "none":
        is_pad = [False] * bs
    elif padding_kind == "trailing":
        n_pad = draw(st.integers(0, bs))
        is_pad = [False] * (bs - n_pad) + [True] * n_pad
    else:
        is_pad = [draw(st.booleans()) for _ in range(bs)]
    n_active = bs - sum(is_pad)

    rows = n_active + 1 + draw(st.integers(0, 3))  # row 0 belongs to the padding request
    pool_size = rows * width + draw(st.integers(0, 16))  # full-pool slots 1..pool_size
    rows_free = [int(v) for v in rng.permutation(np.arange(1, rows))]

    layout = draw(st.sampled_from(["linear", "sparse"]))
    if layout == "linear":
        table = (1 + np.arange(rows * width, dtype=np.int64)).reshape(rows, width)
    else:
        table = rng.permutation(np.arange(1, pool_size + 1, dtype=np.int64))[: rows * width].reshape(
            rows, width
        )
    if draw(st.booleans()):
        # Negative slot numbers pass through the LUT untouched.
        neg = rng.random((rows, width)) < 0.1
        table[neg] = rng.choice(np.array([-1, -2, I32_MIN], dtype=np.int64), size=int(neg.sum()))

    swa = draw(st.booleans())
    if swa:
        window = draw(st.sampled_from([1, 4, 16, 64, width, max(1, width // 3)]))
        lut_kind = draw(st.sampled_from(["identity", "shift", "permutation"]))
    else:
        window = 0
        kinds = (
            ["none", "none", "none", "identity", "shift", "permutation"] if lut_without_window else ["none"]
        )
        lut_kind = draw(st.sampled_from(kinds))
    lut = None if lut_kind == "none" else _make_lut(draw, rng, pool_size, lut_kind)

    rps: list[int] = []
    prefixes: list[int] = []
    extends: list[int] = []
    for pad in is_pad:
        if pad:
            rps.append(0)
            prefixes.append(draw(st.sampled_from([0, 7, 99, 99_999, -3])))
            extends.append(draw(st.sampled_from([0, 1, 5, -2])))
            continue
        rps.append(rows_free.pop())
        prefixes.append(draw(st.one_of(st.sampled_from([0, 1, width - 1, width]), st.integers(0, width))))
        extends.append(draw(st.one_of(st.integers(0, 8), st.sampled_from([0, 1, 128, 4096]))))

    # Stale garbage past each prefix: never gathered, whatever it holds.
    if draw(st.booleans()):
        for rp, p in zip(rps, prefixes, strict=True):
            if rp != 0 and p < width:
                table[rp, p:] = rng.integers(I32_MIN, I32_MAX, size=width - p, endpoint=True)

    has_pool = draw(st.booleans())
    pool = None
    offset = draw(st.sampled_from([-1, 0, 1]))
    pool_width = max(1, width + draw(st.integers(-2, 3)))
    lens: list[int] = []
    if has_pool:
        pool = rng.integers(I32_MIN, I32_MAX, size=(rows, pool_width), endpoint=True).astype(np.int32)
        for rp, p in zip(rps, prefixes, strict=True):
            if rp == 0:
                lens.append(draw(st.sampled_from([0, 99_999, -1])))
                continue
            kind = draw(st.sampled_from(["below", "at", "over", "zero", "width"]))
            k = draw(st.integers(1, 3))
            value = {"below": p - k, "at": p, "over": p + k, "zero": 0, "width": pool_width}[kind]
            lens.append(min(max(value, 0), pool_width))

    if hostile:
        for r in range(bs):
            if rps[r] == 0:
                continue
            if draw(st.integers(0, 3)) == 0:
                rps[r] = draw(st.sampled_from([rows, rows + 2, -1, -(1 << 40)]))
            if draw(st.integers(0, 3)) == 0:
                prefixes[r] = draw(st.sampled_from([width + 1, width + 3, 1 << 62, I64_MAX, -1, -(1 << 62)]))
            if draw(st.integers(0, 4)) == 0:
                extends[r] = draw(st.sampled_from([-1, -(1 << 62), 1 << 62, I64_MAX]))
        if lut is not None and draw(st.booleans()):
            escape = rng.random((rows, width)) < draw(st.sampled_from([0.02, 0.2]))
            bad = np.array([len(lut), len(lut) + 5, I32_MAX], dtype=np.int64)
            table[escape] = rng.choice(bad, size=int(escape.sum()))
        if has_pool:
            for r in range(bs):
                if rps[r] != 0 and draw(st.integers(0, 3)) == 0:
                    lens[r] = draw(st.sampled_from([pool_width + 1, pool_width + 7, 1 << 62, -5]))
            if draw(st.booleans()):
                assert pool is not None
                pool = np.ascontiguousarray(pool[: draw(st.integers(1, max(1, rows // 2)))])

    total = sum(_verify_count(rp, p, window) for rp, p in zip(rps, prefixes, strict=True))
    kwargs: dict[str, Any] = {
        "req_pool_indices": _i64(rps),
        "prefix_lens": _i64(prefixes),
        "extend_seq_lens": _i64(extends),
        "req_to_token": np.ascontiguousarray(table.astype(np.int32)),
        "swa_window_size": window,
        "full_to_swa_index_mapping": lut,
        "verify_capacity": _draw_capacity(draw, total),
        "req_to_verify_expected_tokens": pool,
        "req_to_verify_expected_tokens_valid_lens": _i64(lens) if has_pool else None,
        "kv_token_id_vs_position_offset": offset,
    }
    return PlanCase(kwargs=kwargs, write_req_capacity=max(1, bs + draw(st.integers(0, 5))))


@st.composite
def _large_plan_cases(draw: st.DrawFn, hostile: bool = False) -> PlanCase:
    """Thousands of rows, mostly padding and decode, on a small request pool (rows may repeat: the plan
    only reads the tables)."""
    rng = _rng(draw)
    bs = draw(
        st.one_of(st.sampled_from([4095, 4096, 4097, 65_536, 65_537, 70_000]), st.integers(1000, 70_000))
    )
    rows, width = 64, 16
    active_frac = draw(st.sampled_from([0.0, 0.01, 0.05]))
    active = rng.random(bs) < active_frac
    rps = np.where(active, rng.integers(1, rows, size=bs), 0).astype(np.int64)
    prefixes = np.where(active, rng.integers(0, width + 1, size=bs), 99_999).astype(np.int64)
    extends = np.where(active, rng.integers(0, 2, size=bs), 0).astype(np.int64)
    table = (1 + np.arange(rows * width, dtype=np.int64)).reshape(rows, width)
    window = draw(st.sampled_from([0, 4]))
    lut = None
    if window > 0 or draw(st.booleans()):
        lut = np.ascontiguousarray(np.arange(rows * width + 1, dtype=np.int64) + 7)
        lut[0] = 0
    pool = None
    lens = None
    if draw(st.booleans()):
        pool = rng.integers(I32_MIN, I32_MAX, size=(rows, width + 4), endpoint=True).astype(np.int32)
        lens = np.where(active, prefixes, 0).astype(np.int64)
    if hostile and active.any():
        idx = rng.choice(np.flatnonzero(active), size=min(5, int(active.sum())), replace=False)
        rps[idx[:2]] = rows + 3
        prefixes[idx[2:4]] = width + 2
        if lens is not None:
            lens[idx[4:]] = width + 100
    counts = np.where(rps != 0, np.clip(prefixes, 0, window) if window > 0 else np.maximum(prefixes, 0), 0)
    kwargs: dict[str, Any] = {
        "req_pool_indices": _i64(rps),
        "prefix_lens": _i64(prefixes),
        "extend_seq_lens": _i64(extends),
        "req_to_token": np.ascontiguousarray(table.astype(np.int32)),
        "swa_window_size": window,
        "full_to_swa_index_mapping": lut,
        "verify_capacity": _draw_capacity(draw, int(counts.sum())),
        "req_to_verify_expected_tokens": pool,
        "req_to_verify_expected_tokens_valid_lens": None if lens is None else _i64(lens),
        "kv_token_id_vs_position_offset": draw(st.sampled_from([0, 1])),
    }
    return PlanCase(kwargs=kwargs, write_req_capacity=bs + draw(st.integers(0, 5)))


# ----------------------------------------------------------------------------------------------------------
# write + verify
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ChainCase:
    """A write launch followed by a verify launch on the same canary context.

    Context (state before the write): ``canary_buf`` uint8 [num_slots, stride] (garbage except the stamped
    seed slots), ``ring`` int64 [ring_capacity, 8] (garbage: rows never written must keep it),
    ``write_index`` / ``slot_run_counter`` / ``kernel_run_counter`` / ``status`` initial scalars, ``tag`` (the
    launch tag), ``sources`` (list of (uint8 [rows, row_bytes], page_size, num_bytes_per_token, read_bytes)),
    ``mode`` (0 NONE / 1 PARTIAL / 2 ALL), ``enable_chain_position_assert`` (0/1, the device flag).

    Write launch: ``write_offsets`` int64 [W+1], ``write_seed_slot_indices`` int64 [W],
    ``write_num_valid_reqs`` (int), ``input_ids`` / ``positions`` / ``out_cache_loc`` int64 [num_tokens],
    ``enable_write_input_assert`` and ``expected_input_tokens`` / ``expected_input_positions`` (int64
    [num_tokens], None iff the assert is off).

    Between the launches, ``corruptions`` ((slot, field index, new int64 value)) are meant to be applied to
    the canary buffer and ``source_flips`` ((source index, row, byte column, xor mask)) to the source bytes;
    ``apply_corruptions`` does both, in place (use ``copy_sources`` first to keep the case intact).

    Verify launch: ``verify_slot_indices`` / ``verify_expected_tokens`` / ``verify_expected_positions`` /
    ``verify_prev_slot_indices`` int64 [C], ``verify_num_valid`` (int), ``enable`` (int),
    ``check_verify_expected_token`` (bool).
    """

    canary_buf: np.ndarray
    ring: np.ndarray
    write_index: int
    slot_run_counter: int
    kernel_run_counter: int
    status: int
    tag: int
    sources: list[tuple[np.ndarray, int, int, int]]
    mode: int
    enable_chain_position_assert: int
    write_offsets: np.ndarray
    write_seed_slot_indices: np.ndarray
    write_num_valid_reqs: int
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    enable_write_input_assert: bool
    expected_input_tokens: np.ndarray | None
    expected_input_positions: np.ndarray | None
    verify_slot_indices: np.ndarray
    verify_expected_tokens: np.ndarray
    verify_expected_positions: np.ndarray
    verify_prev_slot_indices: np.ndarray
    verify_num_valid: int
    enable: int
    check_verify_expected_token: bool
    corruptions: list[tuple[int, int, int]] = field(default_factory=list)
    source_flips: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return int(self.canary_buf.shape[0])

    def initial_state(self) -> oracle.CanaryState:
        """The oracle state before the write launch."""
        return oracle.CanaryState.from_arrays(
            self.canary_buf,
            self.ring,
            self.write_index,
            self.slot_run_counter,
            self.kernel_run_counter,
            self.status,
        )

    def write_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``oracle.write_oracle`` (besides the state)."""
        return {
            "kernel_kind": self.tag,
            "write_offsets": self.write_offsets,
            "write_seed_slot_indices": self.write_seed_slot_indices,
            "write_num_valid_reqs": self.write_num_valid_reqs,
            "input_ids": self.input_ids,
            "positions": self.positions,
            "out_cache_loc": self.out_cache_loc,
            "enable_write_input_assert": self.enable_write_input_assert,
            "expected_input_tokens": self.expected_input_tokens,
            "expected_input_positions": self.expected_input_positions,
            "sources": self.sources,
            "mode": self.mode,
            "enable_chain_position_assert": self.enable_chain_position_assert,
        }

    def verify_kwargs(self, sources: list[tuple[np.ndarray, int, int, int]] | None = None) -> dict[str, Any]:
        """Keyword arguments of ``oracle.verify_oracle`` (besides the state); ``sources`` overrides."""
        return {
            "kernel_kind": self.tag,
            "verify_slot_indices": self.verify_slot_indices,
            "verify_expected_tokens": self.verify_expected_tokens,
            "verify_expected_positions": self.verify_expected_positions,
            "verify_prev_slot_indices": self.verify_prev_slot_indices,
            "verify_num_valid": self.verify_num_valid,
            "enable": self.enable,
            "check_verify_expected_token": self.check_verify_expected_token,
            "sources": self.sources if sources is None else sources,
            "mode": self.mode,
        }

    def copy_sources(self) -> list[tuple[np.ndarray, int, int, int]]:
        # a strided source carries its KvByteLayout as a fifth entry (see strided_chain_cases)
        return [(src[0].copy(), *src[1:]) for src in self.sources]  # type: ignore[misc]

    def apply_corruptions(
        self, canary_buf: np.ndarray, sources: list[tuple[np.ndarray, int, int, int]]
    ) -> None:
        """Inject ``corruptions`` into ``canary_buf`` and ``source_flips`` into ``sources``, in place."""
        words = canary_buf[:, : oracle.FIELDS_PER_SLOT * 8]
        for slot, index, value in self.corruptions:
            words[slot, index * 8 : index * 8 + 8] = np.frombuffer(
                int(value).to_bytes(8, "little", signed=True), dtype=np.uint8
            )
        for src, row, col, mask in self.source_flips:
            sources[src][0][row, col] ^= np.uint8(mask)


def _token(draw: st.DrawFn) -> int:
    return draw(
        st.one_of(
            st.sampled_from(BOUNDARY_TOKENS),
            st.integers(I64_MIN, I64_MAX),
            st.integers(I32_MIN, I32_MAX),
            st.integers(0, 200_000),
        )
    )


@st.composite
def chain_cases(
    draw: st.DrawFn, hostile: bool = False, max_reqs: int = 6, max_tokens: int = 8, perturb: bool = True
) -> ChainCase:
    """Random write + verify scenarios built from linear chains (SPEC §8 items 21-38).

    Each request writes up to ``max_tokens`` tokens at sequential positions into distinct slots, seeded
    either from the anchor (-1) or from a stamped slot holding position start-1. Slot 0 may be written once
    per case, and -1 write slots are skipped. The verify plan re-checks the same chains (optionally the seed
    slots too, with an unreachable predecessor), so a clean run produces no violation; perturbations
    (input-assert expectations, actual positions, expected tokens, stale seed fingerprints, a shrunken
    ``write_num_valid_reqs``, ``enable`` 0, corruptions) are sprinkled on top unless ``perturb=False``,
    in which case the write and the verify launch must both report nothing.
    """
    rng = _rng(draw)
    # Per-case switches, so that many cases are clean and the others carry one or two kinds of fault.
    bad_positions = perturb and draw(st.integers(0, 3)) == 0
    bad_expected_tokens = perturb and draw(st.integers(0, 3)) == 0
    n_req = draw(st.integers(1, max_reqs))
    lens = [draw(st.integers(0, max_tokens)) for _ in range(n_req)]
    need = n_req + sum(lens)  # seeds + written slots, all distinct and nonzero
    num_slots = draw(st.integers(max(8, need + 1), max(64, need + 1)))
    stride = draw(st.sampled_from([32, 48, 64]))
    free = [int(v) for v in rng.permutation(np.arange(1, num_slots))]

    # Real-KV sources covering every slot of the buffer.
    sources: list[tuple[np.ndarray, int, int, int]] = []
    for _ in range(draw(st.integers(0, 4))):
        page_size = draw(st.sampled_from([1, 2, 4, 16]))
        nbpt = 16 * draw(st.integers(1, 6))
        read_bytes = 16 * draw(st.integers(1, nbpt // 16))
        n_rows = -(-num_slots // page_size) + draw(st.integers(0, 1))
        hole = draw(st.sampled_from([0, 16, 32]))  # bytes past page_size * nbpt are never read
        arr = rng.integers(0, 256, size=(n_rows, page_size * nbpt + hole), dtype=np.uint8)
        sources.append((np.ascontiguousarray(arr), page_size, nbpt, read_bytes))
    mode = draw(st.sampled_from([oracle.MODE_NONE, oracle.MODE_PARTIAL, oracle.MODE_ALL]))

    buf = rng.integers(0, 256, size=(num_slots, stride), dtype=np.uint8)
    words = buf[:, :32].copy().view("<i8")

    def stamp(slot: int, token: int, pos: int, prev_hash: int, rkv: int) -> None:
        words[slot] = [token, pos, prev_hash, rkv]

    slot0_used = False
    tokens: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    offsets = [0]
    seeds: list[int] = []
    # Per request: (seed, seed token, seed position, [(slot, token, planned position)])
    chains: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []
    for r in range(n_req):
        seed = -1 if draw(st.booleans()) else free.pop()
        if seed >= 0:
            start = draw(
                st.one_of(st.sampled_from([1, 2, 128, 129, 0x7FFFFFFF, I64_MIN]), st.integers(1, 10_000))
            )
            seed_pos = oracle.to_i64(start - 1)
            seed_token = _token(draw)
            rkv = oracle.to_i64(oracle.real_kv_hash(seed, sources, mode))
            if perturb and draw(st.integers(0, 9)) == 0:
                rkv = oracle.to_i64(rkv ^ 1)  # a stale fingerprint: verify of the seed must flag REAL_KV
            stamp(seed, seed_token, seed_pos, int(rng.integers(I64_MIN, I64_MAX, endpoint=True)), rkv)
        else:
            start = draw(st.sampled_from([0, 0, 0, 5, 0x7FFFFFFF]))
            seed_pos, seed_token = -1, -1
        seeds.append(seed)
        entries: list[tuple[int, int, int]] = []
        for j in range(lens[r]):
            kind = draw(st.integers(0, 19))
            # A skipped entry leaves a position gap, which the chain assert reports on the next entry.
            if kind == 0 and (perturb or j == lens[r] - 1):
                slot = -1
            elif kind == 1 and not slot0_used:
                slot, slot0_used = 0, True
            else:
                slot = free.pop()
            token = _token(draw)
            planned = oracle.to_i64(start + j)
            actual = planned
            if bad_positions and draw(st.integers(0, 7)) == 0:
                actual = oracle.to_i64(planned + draw(st.sampled_from([-1, 1, 2, 1 << 40])))
            tokens.append(token)
            positions.append(actual)
            locs.append(slot)
            entries.append((slot, token, planned))
        offsets.append(offsets[-1] + lens[r])
        chains.append((seed, seed_token, seed_pos, entries))
    buf[:, :32] = words.view(np.uint8).reshape(num_slots, 32)

    num_real_tokens = len(tokens)
    for _ in range(draw(st.integers(0, 3))):  # padded tail tokens, owned by no request
        tokens.append(_token(draw))
        positions.append(int(rng.integers(0, 1000)))
        locs.append(int(rng.integers(-1, num_slots)))
    num_tokens = len(tokens)

    # Write plan: W >= n_req, offsets tail zeroed as the plan leaves it, seeds past n_req left as garbage.
    w_cap = n_req + draw(st.integers(0, 3))
    write_offsets = offsets + [0] * (w_cap - n_req)
    seed_arr = seeds + [int(v) for v in rng.integers(-1, num_slots, size=w_cap - n_req)]
    write_num_valid_reqs = n_req if not perturb or draw(st.integers(0, 7)) else draw(st.integers(0, n_req))

    enable_input_assert = draw(st.booleans())
    exp_tokens = exp_positions = None
    if enable_input_assert:
        exp_t = list(tokens)
        exp_p = list(positions)
        rate = draw(st.sampled_from([0.0, 0.1, 1.0])) if perturb else 0.0
        for i in range(num_real_tokens):
            if rng.random() < rate:
                which = int(rng.integers(0, 3))
                if which != 1:
                    exp_t[i] = oracle.to_i64(exp_t[i] ^ int(rng.integers(1, 1 << 62)))
                if which != 0:
                    exp_p[i] = oracle.to_i64(exp_p[i] + int(rng.integers(1, 5)))
        exp_tokens, exp_positions = _i64(exp_t), _i64(exp_p)

    # Verify plan over the same chains.
    check_token = draw(st.booleans())
    v_slots: list[int] = []
    v_tokens: list[int] = []
    v_positions: list[int] = []
    v_prevs: list[int] = []

    def expected_token(token: int) -> int:
        roll = int(rng.integers(0, 10 if bad_expected_tokens else 20))
        if roll == 0:
            return -1
        if roll == 1 and bad_expected_tokens:
            return oracle.to_i64(token + 1)
        return token

    for seed, seed_token, seed_pos, entries in chains:
        if seed >= 0 and draw(st.booleans()):
            v_slots.append(seed)
            v_tokens.append(expected_token(seed_token))
            v_positions.append(seed_pos)
            v_prevs.append(0)  # the seed's own predecessor is not part of the case
        prev = seed
        for slot, token, planned in entries:
            if slot < 0:
                continue
            v_slots.append(slot)
            v_tokens.append(expected_token(token))
            v_positions.append(planned)
            v_prevs.append(prev)
            prev = slot
        if draw(st.integers(0, 4)) == 0:
            v_slots.append(0)  # a padding entry: skipped but counted
            v_tokens.append(-1)
            v_positions.append(0)
            v_prevs.append(0)
    n_entries = len(v_slots)
    v_cap = max(1, n_entries + draw(st.integers(0, 3)))
    for _ in range(v_cap - n_entries):  # garbage past num_valid: never read
        v_slots.append(int(rng.integers(-3, num_slots + 5)))
        v_tokens.append(int(rng.integers(-5, 5)))
        v_positions.append(int(rng.integers(-5, 5)))
        v_prevs.append(int(rng.integers(-3, num_slots + 5)))
    verify_num_valid = n_entries
    enable = 0 if perturb and draw(st.integers(0, 9)) == 0 else 1

    corruptions: list[tuple[int, int, int]] = []
    written = [slot for _, _, _, entries in chains for slot, _, _ in entries if slot > 0]
    if perturb and written and draw(st.integers(0, 3)) == 0:
        for _ in range(draw(st.integers(1, 2))):
            slot = draw(st.sampled_from(written))
            corruptions.append((slot, draw(st.integers(0, 3)), _token(draw)))
    source_flips: list[tuple[int, int, int, int]] = []
    if perturb and sources and draw(st.integers(0, 3)) == 0:
        src = draw(st.integers(0, len(sources) - 1))
        arr = sources[src][0]
        source_flips.append(
            (
                src,
                int(rng.integers(0, arr.shape[0])),
                int(rng.integers(0, arr.shape[1])),
                1 << int(rng.integers(0, 8)),
            )
        )

    if hostile:
        for i in range(num_real_tokens):
            if locs[i] >= 0 and draw(st.integers(0, 7)) == 0:
                locs[i] = num_slots + draw(st.sampled_from([0, 1, 5, 1 << 40]))
        for r in range(n_req):
            if draw(st.integers(0, 5)) == 0:
                seed_arr[r] = num_slots + draw(st.sampled_from([0, 3]))
        if n_req >= 1 and draw(st.integers(0, 3)) == 0:
            r = draw(st.integers(0, n_req - 1))
            if draw(st.booleans()) and r >= 1:
                # The request before runs backwards (flagged), request r starts below 0 (flagged).
                write_offsets[r] = -draw(st.integers(1, 3))
            else:
                # Request r ends past the token arrays (flagged); request r+1 then runs backwards (flagged).
                write_offsets[r + 1] = num_tokens + draw(st.integers(1, 3))
        if n_req >= 2 and draw(st.integers(0, 3)) == 0:
            # Offsets out of order: one inner offset moved anywhere in the token range, so that a request may run
            # backwards (flagged; it and every later request skipped).
            write_offsets[draw(st.integers(1, n_req - 1))] = draw(st.integers(0, num_tokens))
        if draw(st.integers(0, 4)) == 0:
            write_num_valid_reqs = draw(st.sampled_from([w_cap + 1, w_cap + 100, -1, I32_MIN]))
        for k in range(n_entries):
            roll = draw(st.integers(0, 11))
            if roll == 0:
                v_slots[k] = draw(st.sampled_from([-1, -5, num_slots, num_slots + 9]))
            elif roll == 1:
                v_prevs[k] = num_slots + draw(st.sampled_from([0, 2, 1 << 40]))
        if draw(st.integers(0, 4)) == 0:
            verify_num_valid = draw(st.sampled_from([v_cap + 1, v_cap + 1000, -1, I32_MIN]))

    ring_capacity = draw(st.sampled_from([1, 4, 16, 64]))
    ring = rng.integers(I64_MIN, I64_MAX, size=(ring_capacity, 8), endpoint=True, dtype=np.int64)
    write_index = draw(st.sampled_from([0, 0, 0, 1, ring_capacity, ring_capacity + 5]))

    return ChainCase(
        canary_buf=np.ascontiguousarray(buf),
        ring=np.ascontiguousarray(ring),
        write_index=write_index,
        slot_run_counter=draw(st.integers(0, 1_000_000)),
        kernel_run_counter=draw(st.integers(0, 1_000_000)),
        status=draw(st.sampled_from([0, 0, 0, 1, 2, 7])),
        tag=draw(st.integers(0, 11)),
        sources=sources,
        mode=mode,
        enable_chain_position_assert=draw(st.sampled_from([0, 1])),
        write_offsets=_i64(write_offsets),
        write_seed_slot_indices=_i64(seed_arr),
        write_num_valid_reqs=write_num_valid_reqs,
        input_ids=_i64(tokens),
        positions=_i64(positions),
        out_cache_loc=_i64(locs),
        enable_write_input_assert=enable_input_assert,
        expected_input_tokens=exp_tokens,
        expected_input_positions=exp_positions,
        verify_slot_indices=_i64(v_slots),
        verify_expected_tokens=_i64(v_tokens),
        verify_expected_positions=_i64(v_positions),
        verify_prev_slot_indices=_i64(v_prevs),
        verify_num_valid=verify_num_valid,
        enable=enable,
        check_verify_expected_token=check_token,
        corruptions=corruptions,
        source_flips=source_flips,
    )


# ----------------------------------------------------------------------------------------------------------
# scatter
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ScatterCase:
    """One scatter launch: ``flat_in`` int64 [total], ``offsets`` int64 [bs+1], ``req_pool_indices`` int64
    [bs] and ``pool_out`` int32 [rows, width] (its initial, stale content; copy it before each run)."""

    flat_in: np.ndarray
    offsets: np.ndarray
    req_pool_indices: np.ndarray
    pool_out: np.ndarray

    def oracle_kwargs(self, pool_out: np.ndarray) -> dict[str, Any]:
        """Keyword arguments of ``oracle.scatter_oracle`` writing into ``pool_out``."""
        return {
            "flat_in": self.flat_in,
            "offsets": self.offsets,
            "req_pool_indices": self.req_pool_indices,
            "pool_out": pool_out,
        }


@st.composite
def scatter_cases(draw: st.DrawFn, hostile: bool = False) -> ScatterCase:
    """Random scatters (SPEC §8 item 39): distinct rows (row 0 included), segments shorter than, equal
    to and longer than the pool width, empty segments; hostile adds rows outside the pool and segments
    leaving ``flat_in`` or running backwards."""
    rng = _rng(draw)
    rows = draw(st.integers(1, 8))
    width = draw(st.sampled_from([1, 3, 8, 33, 64]))
    bs = draw(st.integers(0, rows))
    rps = [int(v) for v in rng.permutation(rows)[:bs]]
    lens = [
        draw(st.one_of(st.integers(0, width + 3), st.sampled_from([0, width, width + 1]))) for _ in range(bs)
    ]
    base = draw(st.sampled_from([0, 0, 0, 2]))
    offsets = [base]
    for n in lens:
        offsets.append(offsets[-1] + n)
    total = offsets[-1] + draw(st.integers(0, 2))
    flat = [
        _token(draw) if draw(st.integers(0, 3)) == 0 else int(v)
        for v in rng.integers(-50, 200_000, size=total)
    ]
    if hostile:
        for r in range(bs):
            if draw(st.integers(0, 3)) == 0:
                rps[r] = draw(st.sampled_from([rows, rows + 4, -1, -(1 << 40)]))
        if bs >= 1 and draw(st.booleans()):
            r = draw(st.integers(0, bs))
            offsets[r] = draw(st.sampled_from([-3, -1, total + 1, total + 50, I64_MAX]))
    pool = rng.integers(I32_MIN, I32_MAX, size=(rows, width), endpoint=True).astype(np.int32)
    return ScatterCase(
        flat_in=_i64(flat),
        offsets=_i64(offsets),
        req_pool_indices=_i64(rps),
        pool_out=np.ascontiguousarray(pool),
    )


def _strided_source(draw: st.DrawFn, rng: np.random.Generator, num_slots: int) -> tuple[Any, ...]:
    """A source with a KvByteLayout covering ``num_slots`` slots: ``(uint8 [1, span], page_size,
    num_bytes_per_token, read_bytes, layout)``. The strides are drawn to reach every access kind the kernels
    have (one contiguous run per token, one run per head, element by element), overlaps and holes included."""
    from kvcanary_cupy import KvByteLayout

    eb = draw(st.sampled_from([1, 2, 4, 8, 16]))
    heads = draw(st.integers(1, 3))
    per_head = draw(st.integers(1, 5))
    while (heads * per_head * eb) % 16:
        per_head += 1
    head_bytes = per_head * eb
    element_stride = draw(st.sampled_from([eb, eb, 2 * eb, 0, 5 * eb]))
    head_stride = draw(st.sampled_from([head_bytes, head_bytes + 16, 3 * head_bytes, eb, 0]))
    token_extent = max(heads * max(head_stride, 1), per_head * max(element_stride, eb))
    token_stride = draw(st.sampled_from([heads * head_bytes, -(-token_extent // 16) * 16, eb, 0]))
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    page_stride = draw(st.sampled_from([page_size * max(token_stride, token_extent), 0, 16 * eb]))
    # digit splits (tiled tokens, grouped elements, as in vLLM's CPU amx layout), or none
    tiles = draw(st.sampled_from([0, 0, 2, 3, 16]))
    tile_stride = draw(st.sampled_from([tiles * token_stride, 16 * eb, 0, eb])) if tiles else 0
    groups = draw(st.sampled_from([0, 0, 2, 3]))
    group_stride = draw(st.sampled_from([groups * element_stride, 32 * eb, 0])) if groups else 0
    layout = KvByteLayout(page_stride=page_stride, token_stride=token_stride, head_stride=head_stride,
                          element_stride=element_stride, num_heads=heads, elements_per_head=per_head, element_bytes=eb,
                          tokens_per_tile=tiles, tile_stride=tile_stride, elements_per_group=groups,
                          group_stride=group_stride)
    last = max((s // page_size) * page_stride + layout.token_term(s % page_size) for s in range(num_slots))
    per_token = layout.bytes_per_token
    # at least one token's stream long (a source refuses a stream longer than its tensor), overlaps included
    span = max(last + layout.last_byte_in_token() + 1, per_token) + draw(st.sampled_from([0, 1, 16, 40]))
    read_bytes = 16 * draw(st.integers(1, per_token // 16))
    return (rng.integers(0, 256, size=(1, span), dtype=np.uint8), page_size, per_token, read_bytes, layout)


@st.composite
def strided_chain_cases(draw: st.DrawFn, *, hostile: bool = False) -> ChainCase:
    """A chain case whose real-KV sources are strided (KvByteLayout) and whose source flips land inside them."""
    import dataclasses

    case = draw(chain_cases(hostile=hostile))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_slots = int(case.canary_buf.shape[0])
    sources = [_strided_source(draw, rng, num_slots) for _ in range(draw(st.integers(1, 4)))]
    flips = [(k, 0, int(rng.integers(0, sources[k][0].shape[1])), int(rng.integers(1, 256)))
             for k in rng.integers(0, len(sources), size=draw(st.integers(0, 6))).tolist()]
    mode = draw(st.sampled_from([oracle.MODE_PARTIAL, oracle.MODE_ALL]))
    return dataclasses.replace(case, sources=sources, source_flips=flips, mode=mode)
