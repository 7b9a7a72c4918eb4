"""The runtime's step protocol, one scalar launch at a time on the oracle (SPEC §7.2, §7.3): what every group's
ring must receive per step. Built only from ``tests/oracle.py`` (no ``kvcanary_cupy`` code), so the runtime's
wiring (which buffer, which plan, which sources, which LUT, in which order) is checked independently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import oracle as o

ROLES_TAGS = {"FULL": {"HEAD": {"K": 0, "V": 1}, "TAIL": {"K": 2, "V": 3}, "SWEEP": {"K": 4, "V": 5}},
              "SWA": {"HEAD": {"K": 6, "V": 7}, "TAIL": {"K": 8, "V": 9}, "SWEEP": {"K": 10, "V": 11}}}


@dataclass
class OracleGroup:
    name: str
    num_slots: int
    kvs: tuple[str, ...]
    sources: dict[str, list[Any]]  # kv -> [(uint8 rows, page, bytes per token, read bytes)]
    window: int = 0
    lut: np.ndarray | None = None
    offset: int = 0
    model: str = "target"
    head: dict[str, o.CanaryState] = field(default_factory=dict)
    tail: dict[str, o.CanaryState] = field(default_factory=dict)
    plan: o.PlanExpect | None = None

    def __post_init__(self) -> None:
        for kv in self.kvs:
            self.head[kv] = o.CanaryState(fields=[[0, 0, 0, 0] for _ in range(self.num_slots)], ring_capacity=1)
            self.tail[kv] = o.CanaryState(fields=[[0, 0, 0, 0] for _ in range(self.num_slots)], ring_capacity=1)

    def tag(self, role: str, kv: str) -> int:
        return ROLES_TAGS["SWA" if self.window else "FULL"][role][kv]

    def translate(self, slots: list[int]) -> list[int]:
        if self.lut is None:
            return slots
        return [s if s < 0 else int(self.lut[s]) for s in slots]


class ProtocolOracle:
    """Rows per (group, launch step), in launch order, from scalar launches."""

    def __init__(self, groups: list[OracleGroup], *, mode: int, check_tokens: bool, write_assert: bool,
                 req_to_token: np.ndarray, pool_shape: tuple[int, int] | None = None) -> None:
        self.groups = groups
        self.mode, self.check_tokens, self.write_assert = mode, check_tokens, write_assert
        self.req_to_token = req_to_token
        self.pool = np.zeros(pool_shape, np.int32) if pool_shape else None
        self.chain_assert = 0
        self.rows: dict[tuple[str, int], list[list[int]]] = {}
        self.batches: dict[str, dict[str, np.ndarray]] = {}

    def _collect(self, group: OracleGroup, state: o.CanaryState, step: int, before: int) -> None:
        self.rows.setdefault((group.name, step), []).extend(state.rows[before:])

    def prepare(self, batch: dict[str, np.ndarray], model: str = "target") -> None:
        self.batches[model] = batch
        if self.pool is not None and "history_ids" in batch:
            o.scatter_oracle(flat_in=batch["history_ids"], offsets=batch["history_offsets"],
                             req_pool_indices=batch["history_req_pool_indices"], pool_out=self.pool)

    def _verify(self, g: OracleGroup, state: o.CanaryState, role: str, kv: str, step: int, entries: list[Any],
                check: bool, sources: list[Any], mode: int, twin: o.CanaryState | None = None) -> None:
        before = len(state.rows)
        n = len(entries)
        o.verify_oracle(
            state, kernel_kind=g.tag(role, kv), verify_slot_indices=[e[0] for e in entries] or [0],
            verify_expected_tokens=[e[1] for e in entries] or [0],
            verify_expected_positions=[e[2] for e in entries] or [0],
            verify_prev_slot_indices=[e[3] for e in entries] or [0], verify_num_valid=n,
            enable=1 if g.plan is None or role == "SWEEP" else g.plan.enable, check_verify_expected_token=check,
            sources=sources, mode=mode, twin=twin)
        self._collect(g, state, step, before)

    def _write(self, g: OracleGroup, state: o.CanaryState, role: str, kv: str, step: int, sources: list[Any],
               mode: int, out_cache_loc: Any = None) -> None:
        b, plan = self.batches[g.model], g.plan
        assert plan is not None
        before = len(state.rows)
        locs = g.translate([int(x) for x in (b["out_cache_loc"] if out_cache_loc is None else out_cache_loc)])
        o.write_oracle(
            state, kernel_kind=g.tag(role, kv), write_offsets=plan.write_offsets, write_seed_slot_indices=plan.seeds,
            write_num_valid_reqs=plan.write_num_valid_reqs, input_ids=b["input_ids"], positions=b["positions"],
            out_cache_loc=locs, enable_write_input_assert=self.write_assert,
            expected_input_tokens=b.get("expected_input_ids") if self.write_assert else None,
            expected_input_positions=b.get("expected_positions") if self.write_assert else None,
            sources=sources, mode=mode, enable_chain_position_assert=self.chain_assert)
        self._collect(g, state, step, before)

    def pre_forward(self, step: int, model: str = "target") -> None:
        b = self.batches[model]
        for g in (g for g in self.groups if g.model == model):
            g.plan = o.plan_oracle(
                req_pool_indices=b["req_pool_indices"], prefix_lens=b["prefix_lens"],
                extend_seq_lens=b["extend_seq_lens"], req_to_token=self.req_to_token, swa_window_size=g.window,
                full_to_swa_index_mapping=g.lut, verify_capacity=3 * g.num_slots,
                req_to_verify_expected_tokens=self.pool if self.check_tokens else None,
                req_to_verify_expected_tokens_valid_lens=b.get("valid_lens") if self.check_tokens else None,
                kv_token_id_vs_position_offset=g.offset, write_req_capacity=len(b["req_pool_indices"]))
            for kv in g.kvs:  # HEAD V's twin is HEAD K's buffer; both verifies run before the writes
                twin = g.head["K"] if kv == "V" else None
                self._verify(g, g.head[kv], "HEAD", kv, step, g.plan.entries or [], self.check_tokens, [], o.MODE_NONE,
                             twin=twin)
            for kv in g.kvs:
                self._write(g, g.head[kv], "HEAD", kv, step, [], o.MODE_NONE)

    def post_forward(self, step: int, model: str = "target", out_cache_loc: Any = None) -> None:
        """``out_cache_loc``: the slots the forward really wrote, which the TAIL writes stamp (default: the
        batch's)."""
        for g in (g for g in self.groups if g.model == model):
            assert g.plan is not None
            for kv in g.kvs:
                self._verify(g, g.tail[kv], "TAIL", kv, step, g.plan.entries or [], self.check_tokens,
                             g.sources[kv], self.mode)
                self._write(g, g.tail[kv], "TAIL", kv, step, g.sources[kv], self.mode, out_cache_loc)

    def copy_slots(self, src: list[int], dst: list[int], model: str = "target") -> None:
        """Every HEAD and TAIL record of ``src[i]`` copied to ``dst[i]`` (all read before any is written)."""
        for g in (g for g in self.groups if g.model == model):
            pairs = list(zip(g.translate(list(src)), g.translate(list(dst)), strict=True))
            for states in (g.head, g.tail):
                for kv in g.kvs:
                    fields = states[kv].fields
                    records = [list(fields[s]) for s, _ in pairs]
                    for (_, d), record in zip(pairs, records, strict=True):
                        fields[d] = record

    def sweep(self, step: int, held: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        slots, positions, prevs = ([int(x) for x in a] for a in held)
        if not slots:
            return
        for g in self.groups:
            entries = list(zip(g.translate(slots), [-1] * len(slots), positions, g.translate(prevs), strict=True))
            for kv in g.kvs:
                self._verify(g, g.tail[kv], "SWEEP", kv, step, entries, False, g.sources[kv], self.mode)

    def step_rows(self, group: str, step: int) -> list[list[int]]:
        return self.rows.get((group, step), [])
