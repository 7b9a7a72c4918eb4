"""FaultTracker: which faults explain a violation at a slot, as taint spreads to slots written after corrupted ones
and as a retired fault's damage is forgotten."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvcanary_cupy.sim.faults import ALL_FAULT_KINDS, FaultTracker


def assign(tracker: FaultTracker, rid: int, slot: int, pred: int) -> None:
    """Request ``rid`` gets ``slot`` for one position, written right after ``pred`` (the engine's hook)."""
    none = np.zeros(1, np.int64)
    tracker.on_assign(SimpleNamespace(rid=rid), none, np.array([slot]), np.array([pred]), none, none)


@pytest.mark.parametrize("kind", sorted(ALL_FAULT_KINDS))
def test_a_retired_faults_corrupted_slots_seed_nothing_written_after_them(kind):
    tracker = FaultTracker(SimpleNamespace(cfg=SimpleNamespace(eagle=False), swa=False))
    fault = tracker.new(ALL_FAULT_KINDS[kind], step=1, group="FULL", detail="")
    bits = fault.allowed_bits
    tracker.taint(fault, "FULL", [5], source=True)
    assign(tracker, rid=7, slot=6, pred=5)  # seeded from the corrupted slot 5: the fault explains slot 6 too
    assert [f for f, _ in tracker.explain("FULL", 6, bits, 2)] == [fault]
    tracker.retire(fault)
    assert tracker.explain("FULL", 5, bits, 3) == [] and tracker.explain("FULL", 6, bits, 3) == []
    assign(tracker, rid=8, slot=9, pred=5)  # a later owner writes after slot 5: judged on its own
    assign(tracker, rid=8, slot=10, pred=6)
    assert tracker.explain("FULL", 9, bits, 4) == [] and tracker.explain("FULL", 10, bits, 4) == []
