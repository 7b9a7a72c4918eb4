"""Hypothesis strategies for plan launches on the paged layouts (block tables, batch-row block tables, CSR).

A case is drawn as an engine would hold it: per request a list of distinct block ids in one slot space,
then written out as the layout under test. Valid cases also carry the token-table launch that describes the
same slots (``token_kwargs``), for the equivalence tests. ``hostile=True`` adds device values the kernels
must refuse: table rows out of range, prefixes beyond a row's blocks, block ids outside the slot space,
broken CSR offsets, slots escaping the LUT, expected-token reads outside the pool, negative pool rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

import kvcanary_cupy as kc

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
KINDS = ("block", "rows", "page")


@dataclass
class LayoutCase:
    kind: str  # "block": BlockTable via req_pool_indices; "rows": batch_rows=True; "page": PageList
    kwargs: dict[str, Any]  # launch_canary_plan_kernels keywords, with layout=
    write_req_capacity: int
    token_kwargs: dict[str, Any] | None  # the equivalent token-table launch (valid cases only)

    @property
    def bs(self) -> int:
        return int(self.kwargs["prefix_lens"].shape[0])

    def oracle_kwargs(self) -> dict[str, Any]:
        return {**self.kwargs, "write_req_capacity": self.write_req_capacity}


def _i64(values: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))


def _capacity(draw: st.DrawFn, total: int) -> int:
    kind = draw(st.sampled_from(["loose", "loose", "exact", "exact", "one_short", "one"]))
    return {"loose": total + 3, "exact": max(total, 1), "one_short": max(total - 1, 1), "one": 1}[kind]


@st.composite
def layout_cases(draw: st.DrawFn, kind: str | None = None, max_bs: int = 10, hostile: bool = False) -> LayoutCase:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = kind or draw(st.sampled_from(KINDS))
    bs = draw(st.integers(0, max_bs))
    size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    stride = size + (draw(st.sampled_from([0, 0, 1, 5])) if kind != "page" else 0)
    with_rpi = kind == "block" or draw(st.booleans())
    pad = [with_rpi and draw(st.integers(0, 3)) == 0 for _ in range(bs)]

    prefixes, extends, lists = [], [], []
    for r in range(bs):
        if pad[r]:
            prefixes.append(draw(st.sampled_from([0, 7, 99_999, -3])))
            extends.append(draw(st.sampled_from([0, 1, -2])))
            lists.append(int(rng.integers(0, 3)))  # a padding row's pages (CSR) or nothing
            continue
        p = draw(st.one_of(st.sampled_from([0, 1, size, size + 1]), st.integers(0, 40)))
        prefixes.append(p)
        extends.append(draw(st.sampled_from([0, 1, 3, 16])))
        lists.append(-(-p // size) + draw(st.integers(0, 2)))
    num_blocks = sum(lists) + draw(st.integers(0, 4))
    ids = rng.permutation(num_blocks)
    block_lists, at = [], 0
    for n in lists:
        block_lists.append([int(v) for v in ids[at:at + n]])
        at += n
    num_slots = draw(st.sampled_from([None, num_blocks * stride, num_blocks * stride + 7]))
    slot_space = num_blocks * stride

    # Table rows: request-pool rows for "block" (row 0 is the padding row), batch rows for "rows".
    n_active = bs - sum(pad)
    if kind == "block":
        table_rows = n_active + 1 + draw(st.integers(0, 2))
        free = [int(v) for v in rng.permutation(np.arange(1, table_rows))]
        rps = [0 if pad[r] else free.pop() for r in range(bs)]
        row_of = {r: rps[r] for r in range(bs) if not pad[r]}
    else:
        table_rows = bs + draw(st.integers(0, 2))
        rps = [0 if pad[r] else 1 + r + draw(st.integers(0, 1)) * bs for r in range(bs)] if with_rpi else None
        row_of = {r: r for r in range(bs) if not pad[r]}
    max_blocks = max([len(block_lists[r]) for r in row_of] + [1]) + draw(st.integers(0, 1))

    swa = draw(st.booleans())
    window = draw(st.sampled_from([1, 3, 8])) if swa else 0
    lut = None
    if swa or draw(st.integers(0, 3)) == 0:
        lut = rng.permutation(slot_space + 1).astype(np.int64) + draw(st.sampled_from([0, 100]))
    pool_rows = (max(rps) + 1 if rps else 1) if with_rpi else max(bs, 1)
    pool = lens = None
    offset = draw(st.sampled_from([-1, 0, 1]))
    if draw(st.booleans()):
        pool_width = max(1, draw(st.sampled_from([4, 12, 40])) + draw(st.integers(-3, 3)))
        pool = rng.integers(I32_MIN, I32_MAX, size=(pool_rows, pool_width), endpoint=True).astype(np.int32)
        lens = [min(max(p + draw(st.integers(-2, 2)), 0), pool_width) for p in prefixes]

    if hostile:
        for r in range(bs):
            if pad[r]:
                continue
            roll = draw(st.integers(0, 9))
            if roll == 0 and kind == "block":
                rps[r] = draw(st.sampled_from([table_rows, table_rows + 3, -1]))
            elif roll == 1:
                prefixes[r] = len(block_lists[r]) * size + draw(st.sampled_from([1, size, 1000]))
            elif roll == 2 and block_lists[r]:
                bad = [-1, I32_MIN] + ([num_blocks + 1, I32_MAX] if num_slots is not None else [])
                block_lists[r][int(rng.integers(len(block_lists[r])))] = draw(st.sampled_from(bad))
            elif roll == 3 and pool is not None:
                lens[r] = pool.shape[1] + draw(st.sampled_from([1, 5]))
            elif roll == 4 and rps is not None and kind != "block":
                rps[r] = draw(st.sampled_from([-1, pool_rows + 2]))
        if pool is not None and draw(st.integers(0, 3)) == 0:
            pool = np.ascontiguousarray(pool[: draw(st.integers(1, pool.shape[0]))])
        if lut is not None and draw(st.booleans()):
            lut = np.ascontiguousarray(lut[: max(1, int(rng.integers(1, slot_space + 2)))])

    # The layout arrays, with garbage wherever the plan must not read.
    table = rng.integers(I32_MIN, I32_MAX, size=(table_rows, max_blocks), endpoint=True).astype(np.int32)
    for r, row in row_of.items():
        if 0 <= row < table_rows:
            n = min(len(block_lists[r]), max_blocks)
            table[row, :n] = block_lists[r][:n]
    indptr = np.zeros(bs + 1, np.int64)
    indptr[1:] = np.cumsum([len(b) for b in block_lists])
    indices = np.array([v for b in block_lists for v in b] + [int(rng.integers(0, 9))] * draw(st.integers(0, 2)),
                       np.int32)
    if hostile and kind == "page" and bs and draw(st.booleans()):
        r = draw(st.integers(0, bs))
        indptr[r] = draw(st.sampled_from([-1, indptr[-1] + 5, indptr[r] + 1 if r < bs else -3]))
    if kind == "page":
        wide = draw(st.booleans())
        layout = kc.PageList(indptr if wide else indptr.astype(np.int32), indices, size, num_slots=num_slots)
    else:
        layout = kc.BlockTable(table, size, block_stride=stride if stride != size or draw(st.booleans()) else None,
                               batch_rows=kind == "rows", num_slots=num_slots)

    total = sum(min(max(p, 0), window) if window else max(p, 0)
                for r, p in enumerate(prefixes) if not pad[r])
    kwargs = {
        "req_pool_indices": _i64(rps) if with_rpi else None, "prefix_lens": _i64(prefixes),
        "extend_seq_lens": _i64(extends), "layout": layout, "swa_window_size": window,
        "full_to_swa_index_mapping": lut, "verify_capacity": _capacity(draw, total),
        "req_to_verify_expected_tokens": pool, "req_to_verify_expected_tokens_valid_lens":
            None if lens is None else _i64(lens), "kv_token_id_vs_position_offset": offset,
    }
    token = None if hostile else _token_equivalent(kwargs, block_lists, pad, size, stride, rps)
    return LayoutCase(kind, kwargs, max(1, bs + draw(st.integers(0, 3))), token)


def _token_equivalent(kwargs: dict[str, Any], block_lists: list[list[int]], pad: list[bool], size: int,
                      stride: int, rps: list[int] | None) -> dict[str, Any]:
    """The token-table launch reading the same slots: request-pool row ``rp`` (or ``r + 1`` when the paged
    launch has no req_pool_indices, with the expected-token pool shifted down one row to match)."""
    bs = len(block_lists)
    token_rps = list(rps) if rps is not None else [r + 1 for r in range(bs)]
    width = max([len(b) * size for b in block_lists] + [1])
    rtt = np.full((max([*token_rps, 0]) + 1, width), -7, np.int32)
    for r in range(bs):
        if not pad[r]:
            slots = [b * stride + k for b in block_lists[r] for k in range(size)]
            rtt[token_rps[r], : len(slots)] = slots
    out = {k: v for k, v in kwargs.items() if k != "layout"}
    out["req_pool_indices"] = _i64(token_rps)
    out["req_to_token"] = rtt
    pool = kwargs["req_to_verify_expected_tokens"]
    if rps is None and pool is not None:
        out["req_to_verify_expected_tokens"] = np.ascontiguousarray(
            np.vstack([np.zeros((1, pool.shape[1]), np.int32), pool]))
    return out
