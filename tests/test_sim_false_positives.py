"""The simulator's false-positive accounting: a violation that no injected fault explains (an untainted slot,
or a reason bit no tainting fault allows) counts as a false positive, is listed in the report and fails the
run; the attribution of a row to a fault follows the fault's slot, step and allowed reasons."""

from __future__ import annotations

from kvcanary_cupy.constants import FailReason
from kvcanary_cupy.sim import FAULT_KINDS, SimConfig, Simulation, render_text, validate

CLEAN = SimConfig(preset="mixed", steps=16, requests=6, seed=3, backend="numpy", sweep_interval=0)
CORRUPT_STEP = 6


def test_a_corruption_no_fault_injected_is_a_false_positive_that_fails_the_run():
    """A K bit of a live request's first slot flips behind the injector's back (nothing tainted): every row
    it causes is a false positive naming that slot and the real-KV reason, and the run fails."""
    sim = Simulation(CLEAN)
    forward = sim.engine.forward
    flipped: list[tuple[int, int]] = []  # (step, slot)
    calls = [0]

    def forward_then_flip(batch, redirect=None):
        forward(batch, redirect)
        if calls[0] == CORRUPT_STEP:
            req = next(r for r, p in zip(batch.reqs, batch.prefix_h.tolist(), strict=False) if p > 1)
            slot = int(req.slots[0])
            sim.engine.kv["FULL"].flip_bit("K", 0, slot, 0, 0)
            flipped.append((calls[0], slot))
        calls[0] += 1

    sim.engine.forward = forward_then_flip
    report = sim.run()
    assert flipped, "the workload gave no request with a prefix to corrupt"
    step, slot = flipped[0]
    v = report["violations"]
    assert v["total"] >= 1 and v["false_positives"] == v["total"] and v["explained"] == 0
    assert sum(report["timeline"]["false_positives"]) == v["total"]
    assert sum(report["timeline"]["explained"]) == 0
    assert len(report["false_positives"]) == v["total"]
    for fp in report["false_positives"]:
        assert (fp["group"], fp["slot"], fp["position"]) == ("FULL", slot, 0), fp
        assert fp["reasons"] == ["VERIFY_REAL_KV_HASH_MISMATCH"], fp
        assert fp["launch_step"] >= step and fp["read_step"] == fp["launch_step"] + 1, fp
    assert not report["passed"] and report["outcome"] == "failed" and report["exit_code"] != 0
    validate(report)
    assert f"{v['total']} false positive(s)" in render_text(report)


def test_a_row_is_explained_only_by_faults_on_its_slot_before_its_launch_allowing_all_its_reasons():
    tracker = Simulation(CLEAN).tracker
    flip, token = FAULT_KINDS["kv-bitflip"], FAULT_KINDS["wrong-token"]
    real_kv, chain = int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH), int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    assert flip.allowed_bits == real_kv and not token.allowed_bits & real_kv
    fault = tracker.new(flip, 3, "FULL", "a flipped bit", slot=5)
    tracker.taint(fault, "FULL", [5])
    assert tracker.explain("FULL", 5, real_kv, 3) == [(fault, real_kv)]
    assert tracker.explain("FULL", 5, real_kv, 9) == [(fault, real_kv)]
    # a reason the tainting fault does not allow, another slot, another group, a launch before the fault
    assert tracker.explain("FULL", 5, real_kv | chain, 3) == []
    assert tracker.explain("FULL", 5, chain, 3) == []
    assert tracker.explain("FULL", 6, real_kv, 3) == []
    assert tracker.explain("SWA", 5, real_kv, 3) == []
    assert tracker.explain("FULL", 5, real_kv, 2) == []
    # two faults on one slot: together they explain both reasons, each bit going to the fault allowing it
    other = tracker.new(token, 4, "FULL", "a wrong token", slot=5)
    tracker.taint(other, "FULL", [5])
    both = real_kv | (token.allowed_bits & -token.allowed_bits)
    assert sorted((f.fid, bits) for f, bits in tracker.explain("FULL", 5, both, 4)) == [
        (fault.fid, real_kv), (other.fid, both & ~real_kv)]
    assert tracker.explain("FULL", 5, both, 3) == []  # the second fault came after that launch
