"""The engine runtime's own cost: a 256-request decode step on the NumPy backend, next to the raw launches it
wraps.

One group, same inputs (256 requests at prefix 512, one new token each, one FULL group with K only, write-input
and verify-token asserts off):

* ``raw bound launches`` (baseline) — plan, HEAD verify, HEAD write, TAIL verify, TAIL write through
  :mod:`kvcanary_cupy.bind`, on buffers the caller refills itself: what phases 2 and 3 run;
* ``raw public launchers`` (info) — the same five launches through the public launchers, validating and
  importing every argument on every call (a hand-written integration without binding);
* ``runtime, whole step`` (subject) — ``prepare``, ``pre_forward``, ``post_forward``, ``finish_step``;
* ``runtime, outside-graph phases`` (subject) — ``prepare`` and ``finish_step`` alone (staging the batch,
  the snapshot, the one-step-late read): the host overhead the runtime adds to a step. Phases 2 and 3 are
  skipped here, so the health check is off in this row (it would report every skipped launch); its cost is
  in the whole-step row.

Nothing here fails on a time; ``make bench`` writes the figures to bench/RESULTS.md.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.bind import bind_plan, bind_verify, bind_write
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch

BS, PREFIX, WIDTH = 256, 512, 640
NUM_SLOTS = BS * WIDTH + 1
GROUP = f"runtime step · decode bs={BS} prefix={PREFIX}, NumPy"
ENTRIES = BS * PREFIX
LOGGER = "kvcanary_cupy.bench.runtime"
logging.getLogger(LOGGER).addHandler(logging.NullHandler())


@dataclass
class DecodeStep:
    """A decode step of ``BS`` requests whose prefixes were written before (so the verify finds nothing)."""

    req_to_token: np.ndarray
    batch: StepBatch


@functools.cache
def decode_step() -> DecodeStep:
    rng = np.random.default_rng(3)
    slots = rng.permutation(np.arange(1, NUM_SLOTS, dtype=np.int32)).reshape(BS, WIDTH)
    rtt = np.zeros((BS + 1, WIDTH), np.int32)
    rtt[1:] = slots
    rows = np.arange(1, BS + 1, dtype=np.int64)
    ids = rng.integers(0, 50_000, BS, dtype=np.int64)
    batch = StepBatch(req_pool_indices=rows, prefix_lens=np.full(BS, PREFIX, np.int64),
                      extend_seq_lens=np.ones(BS, np.int64), input_ids=ids, positions=np.full(BS, PREFIX, np.int64),
                      out_cache_loc=rtt[1:, PREFIX].astype(np.int64))
    return DecodeStep(rtt, batch)


def prefilled_runtime(health_check: bool = True) -> CanaryRuntime:
    """A runtime whose canaries hold every request's prefix (one prefill step written through it)."""
    step = decode_step()
    pools = KvPools((KvGroup.full("FULL", NUM_SLOTS),), req_to_token=step.req_to_token)
    rt = CanaryRuntime.create(CanaryConfig(logger=LOGGER, health_check=health_check), pools,
                              Capacities(max_batch_size=BS, max_tokens=BS * PREFIX))
    rows = step.batch.req_pool_indices
    positions = np.tile(np.arange(PREFIX, dtype=np.int64), BS)
    prefill = StepBatch(req_pool_indices=rows, prefix_lens=np.zeros(BS, np.int64),
                        extend_seq_lens=np.full(BS, PREFIX, np.int64), input_ids=(positions * 7 + 1),
                        positions=positions, out_cache_loc=step.req_to_token[1:, :PREFIX].reshape(-1).astype(np.int64))
    rt.prepare(prefill)
    rt.pre_forward()
    rt.post_forward()
    rt.finish_step()
    return rt


def measure_step(measure: Any, fn: Any, label: str, role: str, key: str) -> None:
    measure(fn, group=GROUP, label=label, role=role, entries=ENTRIES, key=f"cpu.runtime.{key}")


def test_runtime_whole_step(measure):
    rt, batch = prefilled_runtime(), decode_step().batch

    def step() -> None:
        rt.prepare(batch)
        rt.pre_forward()
        rt.post_forward()
        rt.finish_step()
    measure_step(measure, step, "runtime, whole step (4 phases)", "subject", "whole")
    assert rt.stats()["violations"] == 0 and rt.stats()["health_failures"] == 0


def test_runtime_outside_graph_phases(measure):
    rt, batch = prefilled_runtime(health_check=False), decode_step().batch

    def outside() -> None:
        rt.prepare(batch)
        rt.finish_step()
    measure_step(measure, outside, "runtime, outside-graph phases (prepare + finish_step)", "subject", "outside")


def raw_launch_kwargs(rt: CanaryRuntime) -> tuple[dict[str, Any], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """The five launches of phases 2 and 3 on the runtime's own buffers, as public-launcher keywords."""
    group, stage = rt.groups["FULL"], rt.stages["target"]
    plan = dict(verify_plan_out=group.verify_plan, write_plan_out=group.write_plan,
                req_pool_indices=stage.owner("req_pool_indices"), prefix_lens=stage.owner("prefix_lens"),
                extend_seq_lens=stage.owner("extend_seq_lens"), req_to_token=decode_step().req_to_token,
                swa_window_size=0, full_to_swa_index_mapping=None,
                verify_capacity=int(group.verify_plan.verify_slot_indices.shape[0]))
    pairs = []
    for ep in group.endpoints["HEAD"] + group.endpoints["TAIL"]:
        pairs.append((dict(context=ep.verify_ctx, plan=group.verify_plan, check_verify_expected_token=False),
                      dict(context=ep.write_ctx, plan=group.write_plan, input_ids=stage.owner("input_ids"),
                           positions=stage.owner("positions"), out_cache_loc=stage.owner("out_cache_loc"),
                           enable_write_input_assert=False)))
    return plan, pairs


def test_raw_bound_launches(measure):
    rt = prefilled_runtime()
    rt.prepare(decode_step().batch)  # stage the decode batch once; the launches below reread it
    plan, pairs = raw_launch_kwargs(rt)
    launches = [bind_plan(**plan, backend="numpy", on_invalid="flag")]
    for verify, write in pairs:
        launches += [bind_verify(**verify, backend="numpy", on_invalid="flag"),
                     bind_write(**write, backend="numpy", on_invalid="flag")]

    def raw() -> None:
        for launch in launches:
            launch()
    measure_step(measure, raw, "raw bound launches (plan + HEAD/TAIL verify + write)", "baseline", "bound")


def test_raw_public_launchers(measure):
    rt = prefilled_runtime()
    rt.prepare(decode_step().batch)
    plan, pairs = raw_launch_kwargs(rt)

    def raw() -> None:
        kc.launch_canary_plan_kernels(**plan, backend="numpy", on_invalid="flag")
        for verify, write in pairs:
            kc.launch_canary_verify_kernel(**verify, backend="numpy", on_invalid="flag")
            kc.launch_canary_write_kernel(**write, backend="numpy", on_invalid="flag")
    measure_step(measure, raw, "raw public launchers (validated every call)", "info", "public")
