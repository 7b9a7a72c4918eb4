"""End-to-end simulations: clean runs stay clean on every backend here, and every fault kind is caught quickly.

The host backend runs the CUDA kernels on the CPU and is slower than the NumPy reference, so its runs are small.
"""

from __future__ import annotations

import pytest

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.sim import FAULT_KINDS, PRESETS, SimConfig, parse_inject, render_text, run_simulation

BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
SIZE = {"numpy": {"steps": 60, "requests": 16}, "host": {"steps": 30, "requests": 8},
        "cuda": {"steps": 60, "requests": 16}}
DETECTION_BOUND = 3  # steps from injection to the host reading the first violation


def _check_detected(report: dict, kinds: list[str]) -> None:
    assert report["passed"], render_text(report)
    assert report["exit_code"] == 0
    assert [k["kind"] for k in report["kinds"]] == kinds
    for k in report["kinds"]:
        assert k["status"] == "detected" and k["missed"] == 0, k
        assert k["latency_steps"]["max"] <= DETECTION_BOUND, k
        allowed = FAULT_KINDS[k["kind"]].allowed_bits
        assert k["reasons"], k
        from kvcanary_cupy.constants import FailReason

        assert all(FailReason[name] & allowed for name in k["reasons"]), k
    assert report["violations"]["false_positives"] == 0
    assert report["violations"]["explained"] == report["violations"]["total"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_clean_run_has_no_violation(preset, backend):
    report = run_simulation(SimConfig(preset=preset, seed=11, backend=backend, **SIZE[backend]))
    assert report["violations"]["total"] == 0, render_text(report)
    assert report["violations"]["status"] == []
    assert report["passed"] and report["exit_code"] == 0
    assert report["cost"]["backend"] == backend
    assert report["cost"]["verify_entries"] > 0 and report["cost"]["write_entries"] > 0
    assert report["workload"]["decode_tokens"] > 0 and report["workload"]["prefill_tokens"] > 0


def test_a_clean_run_with_v_endpoints_and_partial_hashing_has_no_violation():
    report = run_simulation(SimConfig(preset="mixed", steps=50, requests=12, seed=2, backend="numpy", with_v=True,
                                      real_kv_hash="partial", sweep_interval=3))
    assert report["violations"]["total"] == 0, render_text(report)
    assert report["workload"]["sweeps"] > 5
    assert report["workload"]["prefix_tokens_reused"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_fault_kind_is_detected_in_a_mixed_run(backend):
    size = {"numpy": {"steps": 80, "requests": 16}, "host": {"steps": 50, "requests": 10},
            "cuda": {"steps": 80, "requests": 16}}[backend]
    report = run_simulation(SimConfig(preset="mixed", seed=5, backend=backend, inject=parse_inject(["all"]), **size))
    _check_detected(report, list(FAULT_KINDS))
    assert all(f["detected"] for f in report["faults"])


@pytest.mark.parametrize("backend", BACKENDS[:2])
@pytest.mark.parametrize("kind", list(FAULT_KINDS))
def test_each_fault_kind_alone_is_detected(kind, backend):
    preset = "swa" if FAULT_KINDS[kind].needs == "swa" else "mixed"
    size = {"steps": 50, "requests": 12} if backend == "numpy" else {"steps": 40, "requests": 10}
    report = run_simulation(SimConfig(preset=preset, seed=3, backend=backend, inject={kind: 0.1}, **size))
    _check_detected(report, [kind])
    assert len(report["faults"]) >= 2
    signature = {
        "double-alloc": "VERIFY_POSITION_MISMATCH", "req-to-token": "VERIFY_POSITION_MISMATCH",
        "kv-bitflip": "VERIFY_REAL_KV_HASH_MISMATCH", "kv-misdirect": "VERIFY_REAL_KV_HASH_MISMATCH",
        "wrong-token": "WRITE_TOKEN_MISMATCH", "position-shift": "WRITE_POSITION_MISMATCH",
        "swa-early-evict": "VERIFY_POSITION_MISMATCH", "stale-expected": "VERIFY_TOKEN_MISMATCH",
    }[kind]
    assert signature in report["kinds"][0]["reasons"]


@pytest.mark.parametrize("preset", ["decode", "prefill", "swa", "eagle"])
def test_every_applicable_fault_kind_is_detected_in_each_preset(preset):
    from kvcanary_cupy.sim import applicable_kinds

    kinds = applicable_kinds(preset)
    report = run_simulation(SimConfig(preset=preset, steps=60, requests=16, seed=8, backend="numpy",
                                      inject=parse_inject(["all"], kinds)))
    _check_detected(report, kinds)


def test_a_requested_kind_that_finds_no_target_makes_the_run_inconclusive_not_failed():
    # one short request never recycles a row, so a stale expected-token row cannot be injected
    report = run_simulation(SimConfig(preset="decode", steps=12, requests=1, seed=0, backend="numpy",
                                      inject={"stale-expected": 1.0}, cooldown_steps=2))
    assert report["kinds"][0]["status"] == "not injected"
    assert not report["passed"] and report["outcome"] == "inconclusive" and report["exit_code"] == 4
    text = render_text(report)
    assert "INCONCLUSIVE: could not inject stale-expected" in text and "workload is too small" in text


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["kv-bitflip", "kv-misdirect"])
def test_kv_faults_strike_the_draft_models_kv_in_an_eagle_run_and_are_detected(kind, seed):
    # each firing picks one of the two KV groups, FULL (the target model's) and DRAFT, uniformly: in about ten
    # firings both are struck (all in one group: 1 in 500)
    report = run_simulation(SimConfig(preset="eagle", steps=30, requests=8, seed=seed, backend="numpy",
                                      inject={kind: 0.5}))
    _check_detected(report, [kind])
    groups = [f["group"] for f in report["faults"] if f["detected"]]
    assert len(groups) == len(report["faults"]) >= 6
    assert set(groups) == {"FULL", "DRAFT"}, groups
