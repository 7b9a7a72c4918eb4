"""The canary inside an in-process vLLM engine: clean workloads are token-exact with zero violations, every
fault injected into vLLM's real structures is detected with its reason and step, install/remove restores the
runner."""

from __future__ import annotations

import pytest

from kvcanary_cupy.integrations import vllm as kv
from kvcanary_cupy.integrations.vllm.faults import FAULT_KINDS, injector
from kvcanary_cupy.integrations.vllm.workloads import workloads

WORKLOADS = workloads()
_baselines: dict[str, list[list[int]]] = {}


def wipe_kv(llm) -> None:
    """Empty the shared engine's prefix cache and zero its KV caches after a fault that wrote raw bytes into
    them: the bytes a fault leaves (a half-size element copy can make NaN patterns) would otherwise stay in blocks
    a later test's requests get but never write in full, and vLLM's CPU attention reads a block's unwritten rows
    too (masked, but NaN survives the mask), so later tests would not be token-exact."""
    assert llm.reset_prefix_cache()
    for cache in kv.find_runner(llm).kv_caches:
        cache.zero_()


def baseline(llm, name: str) -> list[list[int]]:
    """The workload's completions without the canary, from an empty prefix cache."""
    if name not in _baselines:
        assert llm.reset_prefix_cache()
        _baselines[name] = WORKLOADS[name].run(llm)
    return _baselines[name]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_clean_workload_is_token_exact_with_zero_violations(llm, name):
    want = baseline(llm, name)
    canary = kv.install(llm, backend="numpy", sweep_interval=2)
    try:
        got = WORKLOADS[name].run(llm)
        canary.finish()
    finally:
        canary.remove()
    assert got == want
    assert canary.violations == []
    assert canary.state is not None and canary.state.health_problems == [] and canary.state.dropped == 0
    counters = canary.state.counters()
    assert counters["write_entries"] >= sum(len(p) for p in WORKLOADS[name].prompts)
    assert counters["verify_entries"] > 0
    if name == "preemption":
        assert canary.preemptions > 0  # the KV budget really forced vLLM to preempt
    if name == "shared-prefix":
        assert canary.state.seconds["sweep"] > 0  # the sweep walked the cached blocks


def test_remove_restores_the_runners_methods(llm):
    runner = kv.find_runner(llm)
    before = dict(vars(runner))
    canary = kv.install(llm, backend="numpy")
    assert {"_model_forward", "execute_model", "sample_tokens"} <= set(vars(runner))
    with pytest.raises(ValueError, match=r"^kv-canary: a kv-canary is already installed"):
        kv.install(llm)
    canary.remove()
    assert {k for k in vars(runner)} == set(before)
    assert type(runner)._model_forward is runner._model_forward.__func__
    assert type(runner).execute_model is runner.execute_model.__func__
    assert type(runner).sample_tokens is runner.sample_tokens.__func__
    assert WORKLOADS["mixed-lengths"].run(llm) == baseline(llm, "mixed-lengths")


@pytest.mark.parametrize(("target", "args", "kwargs", "message"), [
    ("class", (), {}, r"target must be an in-process vllm\.LLM, its engine or a model runner, got the class"),
    ("llm", ("raise",), {}, r"options must be a CanaryOptions \(or None\), got str"),
    ("llm", ({"mode": "raise"},), {}, r"options must be a CanaryOptions \(or None\), got dict"),
    ("llm", (), {"moed": "raise"}, r"install\(\) got unknown option field\(s\) moed"),
    ("llm", (kv.CanaryOptions(),), {"mode": "raise"}, r"give either options or option fields, not both"),
])
def test_install_refuses_wrong_objects_and_hooks_nothing(llm, target, args, kwargs, message):
    runner = kv.find_runner(llm)
    before = dict(vars(runner))
    with pytest.raises(ValueError, match=r"^kv-canary: " + message):
        kv.install(type(llm) if target == "class" else llm, *args, **kwargs)
    assert vars(runner) == before


def test_mode_off_launches_nothing_and_changes_nothing(llm):
    canary = kv.install(llm, mode="off")
    try:
        got = WORKLOADS["mixed-lengths"].run(llm)
    finally:
        canary.remove()
    assert got == baseline(llm, "mixed-lengths")
    assert canary.state is None and canary.steps == 0


# The workload each fault needs: a decoding request next to others, a prefix-cache hit, a preemption.
FAULT_WORKLOAD = {"kv-bitflip": "mixed-lengths", "block-table": "mixed-lengths", "slot-mapping": "mixed-lengths",
                  "prefix-unwritten": "shared-prefix", "prefix-foreign": "shared-prefix",
                  "preempt-reuse": "preemption", "wrong-token": "mixed-lengths", "position-shift": "mixed-lengths",
                  "kv-element-size": "mixed-lengths", "rank-kv-bitflip": "mixed-lengths"}
# The reason each fault must raise (an independent statement of what the canary checks for it).
FAULT_REASON = {"kv-bitflip": "VERIFY_REAL_KV_HASH_MISMATCH", "block-table": "VERIFY_TOKEN_MISMATCH",
                "slot-mapping": "VERIFY_TOKEN_MISMATCH", "prefix-unwritten": "VERIFY_TOKEN_MISMATCH",
                "prefix-foreign": "VERIFY_TOKEN_MISMATCH", "preempt-reuse": "VERIFY_TOKEN_MISMATCH",
                "wrong-token": "WRITE_TOKEN_MISMATCH", "position-shift": "WRITE_POSITION_MISMATCH",
                "kv-element-size": "VERIFY_REAL_KV_HASH_MISMATCH", "rank-kv-bitflip": "VERIFY_REAL_KV_HASH_MISMATCH"}


def test_every_fault_kind_has_a_workload_and_a_reason():
    assert set(FAULT_WORKLOAD) == set(FAULT_KINDS) == set(FAULT_REASON)


@pytest.mark.parametrize("kind", sorted(FAULT_KINDS))
def test_fault_is_detected_with_its_reason_and_step(llm, kind):
    canary = kv.install(llm, backend="numpy", sweep_interval=0)
    fault = injector(kind, at=1 if kind.startswith("prefix") else 3, seed=1)
    canary.observers.append(fault)
    try:
        WORKLOADS[FAULT_WORKLOAD[kind]].run(llm)
        canary.finish()
    finally:
        canary.remove()
        wipe_kv(llm)
    assert fault.fault is not None, f"{kind} found no target"
    reasons = {r for v in canary.violations for r in v.violation.reasons}
    assert FAULT_REASON[kind] in reasons, (fault.fault, reasons)
    first = min(v.step for v in canary.violations)
    assert first >= fault.fault.step  # nothing flagged before the fault took effect: no false positive
    assert any(v.step <= fault.fault.step + 2 for v in canary.violations if FAULT_REASON[kind] in v.violation.reasons)


@pytest.mark.parametrize("seed", range(6))
def test_a_wrong_element_size_write_is_caught_on_the_token_it_overwrote_on_every_seed(llm, seed):
    """``kv-element-size`` rewrites one token's K/V at half-size element offsets: the victim (a token of a request
    with tokens still to generate, which the injector names) is reported with a real-KV mismatch at its slot, and
    no violation comes before the fault."""
    canary = kv.install(llm, backend="numpy", sweep_interval=0, real_kv_hash="all")
    fault = injector("kv-element-size", at=2 + seed, seed=seed)
    canary.observers.append(fault)
    try:
        WORKLOADS["mixed-lengths"].run(llm)
        canary.finish()
    finally:
        canary.remove()
        wipe_kv(llm)
    assert fault.fault is not None
    assert canary.violations and min(v.step for v in canary.violations) >= fault.fault.step
    hits = [v.violation for v in canary.violations if v.violation.slot == fault.fault.slot]
    assert any("VERIFY_REAL_KV_HASH_MISMATCH" in x.reasons for x in hits), (fault.fault, canary.violations[:3])
    assert {r for v in canary.violations for r in v.violation.reasons} == {"VERIFY_REAL_KV_HASH_MISMATCH"}


def _kv_dtype_run(tiny_model, kv_dtype: str) -> dict:
    import json
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, str(Path(__file__).parent / "kv_dtype_run.py"), str(tiny_model), kv_dtype,
                          "mixed-lengths"], capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-4000:]
    return json.loads(result[-1][len("RESULT "):])


def test_a_kv_cache_written_at_the_wrong_element_size_is_caught_as_real_kv_corruption(tiny_model):
    """vLLM's CPU build accepts ``kv_cache_dtype="int8_per_token_head"`` for an fp32 model, allocates an int8 cache
    and lets its kernel write fp32 elements at fp32 offsets into it: each token's K/V lands over other tokens'
    bytes. The canary, unchanged, reports it from the first steps as real-KV mismatches alone (token ids, positions
    and chain records all agree). (Whether the completions change depends on which tokens the misplaced writes
    hit, so they are not compared here.)"""
    got = _kv_dtype_run(tiny_model, "int8_per_token_head")
    assert got["cache_dtype"] == "torch.int8" and got["disabled"] is None
    assert got["violations"] > 100 and got["reasons"] == ["VERIFY_REAL_KV_HASH_MISMATCH"]
    assert got["first_step"] <= 3


def test_an_fp8_kv_cache_vllm_supports_is_checked_with_no_false_positive(tiny_model):
    """The control: fp8 (e4m3 bytes in uint8 storage), which the CPU kernel does write at 1-byte offsets, runs
    clean under the same canary, and the completions do not depend on the blocks."""
    got = _kv_dtype_run(tiny_model, "fp8")
    assert got["cache_dtype"] == "torch.uint8" and got["disabled"] is None and got["exact"]
    assert got["steps"] > 10 and got["violations"] == 0
