"""CPU benchmarks of the slot layouts: the token table, the block table and CSR page lists side by side.

One group per (backend, batch). The three rows plan the very same entries (bench/workloads.py's
``layout_plan_kwargs``: one pool of 16-token blocks, described three ways), through the public launcher
(validation included). The token table is each group's baseline, so ``ratio_to_baseline`` of the block
table row is the figure issue 12 bounds (NumPy block table <= 1.2x the token table). Nothing here fails on
a time; run ``make bench``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import workloads as wl
from workloads import Batch

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason

LAYOUT_BATCHES = [Batch(8, 512), Batch(32, 1024), Batch(256, 2048), Batch(32, 4096, window=1024)]
LABELS = {"token": "token table (req_to_token)", "block": "block table (16 tokens / block)",
          "csr": "CSR page lists (16 tokens / page)"}
HOST_REASON = unavailable_reason("host")
BACKENDS = ["numpy", pytest.param("host", marks=pytest.mark.skipif(HOST_REASON is not None,
                                                                   reason=f"host backend: {HOST_REASON}"))]


@functools.cache
def setup(batch: Batch, kind: str) -> dict:
    vp = kc.VerifyPlan.allocate(verify_capacity=batch.verify_entries)
    wp = kc.WritePlan.allocate(write_req_capacity=batch.bs)
    kwargs = {"verify_plan_out": vp, "write_plan_out": wp, **wl.layout_plan_kwargs(batch, kind)}
    kc.launch_canary_plan_kernels(**kwargs, backend="numpy")
    assert int(vp.enable[0]) == 1 and int(vp.verify_num_valid[0]) == batch.verify_entries
    return kwargs


@functools.cache
def check_same_plans(batch: Batch) -> None:
    """The three layouts must plan identical entries, seeds and offsets before any of them is timed."""
    plans = {kind: setup(batch, kind) for kind in wl.LAYOUT_KINDS}
    want = plans["token"]
    for kind, got in plans.items():
        for name in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                     "verify_prev_slot_indices"):
            np.testing.assert_array_equal(getattr(got["verify_plan_out"], name),
                                          getattr(want["verify_plan_out"], name), err_msg=f"{kind}: {name}")
        np.testing.assert_array_equal(got["write_plan_out"].write_seed_slot_indices,
                                      want["write_plan_out"].write_seed_slot_indices, err_msg=kind)


@pytest.mark.parametrize("kind", wl.LAYOUT_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", LAYOUT_BATCHES, ids=[b.id for b in LAYOUT_BATCHES])
def test_plan_layout(measure, batch, backend, kind):
    check_same_plans(batch)
    kwargs = setup(batch, kind)
    measure(lambda: kc.launch_canary_plan_kernels(**kwargs, backend=backend),
            group=f"plan layouts · {backend} · {batch.describe()}", label=f"{backend}: {LABELS[kind]}",
            role="baseline" if kind == "token" else "subject", entries=batch.verify_entries,
            key=f"cpu.plan-layout.{backend}.{kind}.{batch.id}")
