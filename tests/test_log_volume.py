"""One fault that corrupts thousands of cached slots writes a bounded number of log lines per step (one per group
with rows, one summary), while every row stays in the step report, ``stats()`` and the ring totals; each line
names its runbook section and carries its structured fields."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from kvcanary_cupy import FailReason, RealKvSource
from kvcanary_cupy.constants import (
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
)
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch
from kvcanary_cupy.runtime.reporting import DEFAULT_LOG_ROWS, StepReport, publish, reason_anchor, status_anchor
from kvcanary_cupy.violations import decode_row

LOGGER = "kvcanary_cupy.test.log_volume"
ROW_BYTES = 16


class LongPrompt:
    """One request that prefills ``n`` tokens into slots 1..n of a one-group cache, then decodes one token; the
    fault overwrites the KV bytes of every prefilled slot between the two steps."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.slots = 1 + self.rng.permutation(n + 8)[: n + 1].astype(np.int64)  # scattered, never slot 0
        self.kv = np.zeros((n + 16, 1, ROW_BYTES), np.uint8)
        self.req_to_token = np.zeros((2, n + 8), np.int32)
        self.req_to_token[1, : n + 1] = self.slots
        self.tokens = self.rng.integers(1, 30000, n + 1)

    def runtime(self, **config) -> CanaryRuntime:
        group = KvGroup.full("FULL", self.n + 16, (RealKvSource(self.kv, page_size=1, num_bytes_per_token=ROW_BYTES,
                                                                read_bytes=ROW_BYTES),))
        cfg = CanaryConfig(logger=LOGGER, ring_capacity=4 * self.n, real_kv_hash_mode="all", **config)
        return CanaryRuntime.create(cfg, KvPools((group,), req_to_token=self.req_to_token),
                                    Capacities(max_batch_size=2, max_tokens=self.n))

    def step(self, rt: CanaryRuntime, start: int, count: int) -> StepReport:
        loc = self.slots[start : start + count]
        sb = StepBatch(req_pool_indices=np.array([1, 0]), prefix_lens=np.array([start, 0]),
                       extend_seq_lens=np.array([count, 0]), input_ids=self.tokens[start : start + count].copy(),
                       positions=np.arange(start, start + count), out_cache_loc=loc.copy())
        rt.prepare(sb)
        rt.pre_forward()
        self.kv[loc, 0] = self.rng.integers(0, 256, (count, ROW_BYTES), dtype=np.uint8)  # the model's write
        rt.post_forward()
        return rt.finish_step()

    def corrupt_prefix(self) -> None:
        self.kv[self.slots[: self.n], 0, 0] ^= 0x40


def run(n: int, seed: int, caplog, **config) -> tuple[CanaryRuntime, list[StepReport], list[logging.LogRecord]]:
    engine = LongPrompt(n, seed)
    rt = engine.runtime(**config)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        reports = [engine.step(rt, 0, n)]
        engine.corrupt_prefix()
        reports.append(engine.step(rt, n, 1))
        reports.append(rt.flush())
    return rt, reports, [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("seed", range(4))
def test_thousands_of_rows_in_a_step_log_one_line_per_group_and_count_every_row(seed, caplog):
    n = 2000 + 700 * seed
    rt, reports, records = run(n, seed, caplog)
    rows = [v for rep in reports for _, v in rep.new_violations]
    # the real-KV hash of the decode step's TAIL verify sees every corrupted prefix slot, once
    assert len(rows) == n
    assert {s for v in rows for s in [v.slot]} == {int(s) for s in LongPrompt(n, seed).slots[:n]}
    assert all(v.reasons == ("VERIFY_REAL_KV_HASH_MISMATCH",) and v.launch_tag == "TAIL_K_FULL" for v in rows)
    # nothing dropped from the counters or totals
    stats = rt.stats()
    assert stats["violations"] == stats["violations_by_group"]["FULL"] == n and stats["dropped"] == 0
    assert sum(rep.reports["FULL"].total for rep in reports if "FULL" in rep.reports) == n
    # a bounded number of records: one line for the group, one summary, in the step that read the rows
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, [r.getMessage()[:120] for r in warnings]
    line, summary = warnings
    fields = line.kv_canary
    step = next(rep.launch_step for rep in reports if rep.new_violations)
    assert (fields["step"], fields["group"], fields["rows"]) == (step, "FULL", n)
    assert fields["reasons"] == {"VERIFY_REAL_KV_HASH_MISMATCH": n}
    assert fields["unlogged_rows"] == n - DEFAULT_LOG_ROWS
    first = rows[:DEFAULT_LOG_ROWS]
    assert [(f["slot"], f["position"], f["tag"]) for f in fields["first_rows"]] == [
        (v.slot, v.position, v.launch_tag) for v in first]
    text = line.getMessage()
    assert f"{n} violation row(s) (VERIFY_REAL_KV_HASH_MISMATCH {n})" in text
    assert f"{n - DEFAULT_LOG_ROWS} more row(s) counted, not logged" in text
    assert text.endswith("runbook: docs/violations.md#reason-verify-real-kv-hash-mismatch")
    assert len(text) < 1000
    assert f"step {step}: {n} new violation(s)" in summary.getMessage()
    assert summary.kv_canary["rows"] == n
    assert "docs/violations.md#reason-verify-real-kv-hash-mismatch" in summary.getMessage()


@pytest.mark.parametrize("log_rows", [0, 1, 12])
def test_the_rows_a_line_spells_out_are_configurable(log_rows, caplog):
    n = 400
    engine = LongPrompt(n, log_rows)
    rt = engine.runtime(log_rows=log_rows)
    assert rt.config.log_rows == log_rows
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reports = [engine.step(rt, 0, n)]
        engine.corrupt_prefix()
        reports += [engine.step(rt, n, 1), rt.flush()]
    rows_read = [row for report in reports for row in report.new_violations]
    # the lines the runtime itself logged, with the bound it was configured with
    lines = [r for r in caplog.records if r.name == LOGGER and " violation row(s) (" in r.getMessage()]
    assert len(lines) == 1 and lines[0].kv_canary["rows"] == len(rows_read) == n
    shown = lines[0].kv_canary["first_rows"]
    assert [f["slot"] for f in shown] == [v.slot for _, v in rows_read[:log_rows]]
    assert len(re.findall(r" slot=\d+ position=\d+ \[", lines[0].getMessage())) == log_rows
    assert lines[0].kv_canary["unlogged_rows"] == n - log_rows


def test_a_bound_outside_its_range_is_refused_naming_the_field():
    for bad in (-1, 1.5, True, "5", 10**6):
        with pytest.raises(ValueError, match=r"^kv-canary: CanaryConfig\.log_rows"):
            CanaryConfig(log_rows=bad)


def _row(index: int, reasons: FailReason, slot: int) -> np.ndarray:
    raw = np.zeros(8, np.int64)
    raw[VIOLATION_FIELD_KERNEL_KIND], raw[VIOLATION_FIELD_SLOT_IDX] = 2, slot  # TAIL_K_FULL
    raw[VIOLATION_FIELD_POSITION], raw[VIOLATION_FIELD_FAIL_REASON_BITS] = index, int(reasons)
    return raw


def test_each_line_names_the_runbook_section_of_every_reason_and_status_flag_it_reports(caplog):
    write = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH
    decoded = [decode_row(i, _row(i, write, 10 + i)) for i in range(3)]
    decoded.append(decode_row(3, _row(3, FailReason.VERIFY_CHAIN_HASH_MISMATCH, 20)))
    report = StepReport(step=8, launch_step=7, new_violations=[("FULL", v) for v in decoded[:3]]
                        + [("SWA", decoded[3])], plan_status={"FULL": 1})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        publish(report, "log", logging.getLogger(LOGGER), overflow_counts={}, log_rows=2)
    full, swa, summary = [r.getMessage() for r in caplog.records]
    assert full.startswith("kv-canary: step 7 group FULL: 3 violation row(s) (WRITE_TOKEN_MISMATCH 3, "
                           "WRITE_POSITION_MISMATCH 3); first: ")
    assert "1 more row(s) counted, not logged" in full
    assert full.endswith("runbook: docs/violations.md#reason-write-token-mismatch "
                         "docs/violations.md#reason-write-position-mismatch")
    assert swa.endswith("runbook: docs/violations.md#reason-verify-chain-hash-mismatch")
    assert "more row(s)" not in swa
    assert status_anchor("REQ_POOL_INDEX_OUT_OF_RANGE") in summary
    assert reason_anchor("VERIFY_CHAIN_HASH_MISMATCH") == "docs/violations.md#reason-verify-chain-hash-mismatch"
