"""The canary never stops the engine: for every model kind and mode vLLM runs on this CPU, what it cannot check is
decided at install (one logged line each, the rest checked, or the canary disabled with one line), generate with
the canary in ``log`` mode is token-exact against the same engine without it and raises nothing, and ``raise`` mode
refuses the configuration at install, before the first request, leaving the runner as it was.

Each model kind runs in a process of its own (``support_run.py``: vLLM keeps process-wide state, one engine per
process) over a tiny random-weight model saved here; the expectations are the fact sheet's measurements of
vLLM 0.32's KV cache groups (which spec class each model's layers get)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcanary_cupy.integrations import vllm as kv
from kvcanary_cupy.integrations.vllm import support
from kvcanary_cupy.integrations.vllm.workloads import workloads

HERE = Path(__file__).parent


def _run(tmp_path_factory: pytest.TempPathFactory, arch: str, config: str) -> dict:
    model_dir = tmp_path_factory.mktemp(arch) / "model"
    run = subprocess.run([sys.executable, str(HERE / "support_run.py"), str(model_dir), arch, config],
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-4000:]
    return json.loads(result[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def mistral_sw(tmp_path_factory):
    return _run(tmp_path_factory, "mistral-sw", "plain")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _run(tmp_path_factory, "gemma3", "plain")


@pytest.fixture(scope="module")
def deepseek_mla(tmp_path_factory):
    return _run(tmp_path_factory, "deepseek-mla", "plain")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return _run(tmp_path_factory, "qwen3-next", "plain")


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    return _run(tmp_path_factory, "llama", "bf16")


@pytest.fixture(scope="module")
def llama_ngram(tmp_path_factory):
    return _run(tmp_path_factory, "llama", "ngram")


def _warnings(result: dict) -> list[str]:
    return [text for level, text in result["install_lines"] if level == "WARNING"]


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvcanary_cupy.vllm"]


def _token_exact_and_quiet(result: dict) -> None:
    assert result["exact"] == {"mixed-lengths": True, "shared-prefix": True, "preemption": True}
    assert result["violations"] == []


# -- a model the canary cannot check at all: disabled with one line, no hook, generate untouched ----------------

class ChunkedLocalAttentionSpec:
    """A KV cache spec class the canary does not know (vLLM has one of this name; only the class name is read)."""


def test_a_model_with_no_checkable_group_runs_unchecked_with_one_line(llm, caplog):
    """Every group of a model skipped (here the one group's spec made one the canary does not know): ``log`` mode
    disables the canary with one line naming the group and hooks nothing; ``raise`` mode refuses at install and
    leaves the runner as it was."""
    runner = kv.find_runner(llm)
    before = dict(vars(runner))
    groups = runner.kv_cache_config.kv_cache_groups
    real = groups[0]
    groups[0] = SimpleNamespace(kv_cache_spec=ChunkedLocalAttentionSpec(), layer_names=list(real.layer_names))
    try:
        for real_kv_hash in ("partial", "none"):
            with pytest.raises(ValueError, match=r"^kv-canary: mode='raise' refuses this engine at install: the "
                                                 r"canary cannot check this engine.*ChunkedLocalAttentionSpec"):
                kv.install(llm, mode="raise", real_kv_hash=real_kv_hash)
            assert set(vars(runner)) == set(before)
        with caplog.at_level(logging.INFO, logger="kvcanary_cupy.vllm"):
            canary = kv.install(llm, backend="numpy")
        canary.remove()
        assert canary.disabled is not None and "_model_forward" not in vars(runner)
    finally:
        groups[0] = real
    lines = [r.getMessage() for r in _ours(caplog)]
    assert len(lines) == 1 and lines[0].startswith("kv-canary disabled in CPUModelRunner, this engine runs unchecked")
    assert "KV cache group G0 (ChunkedLocalAttentionSpec;" in lines[0]
    assert set(vars(runner)) == set(before)


def test_ngram_speculative_decoding_is_checked_whole_and_raise_mode_installs(llama_ngram):
    assert [g[:3] for g in llama_ngram["groups"]] == [["FullAttentionSpec", True, True]]
    _token_exact_and_quiet(llama_ngram)
    assert _warnings(llama_ngram) == []
    assert llama_ngram["hooked"] is True and llama_ngram["steps"] > 0
    assert llama_ngram["fault"][0] is not False and "WRITE_POSITION_MISMATCH" in llama_ngram["fault"][1]
    for real_kv_hash in ("partial", "none"):
        installed, exact, violations, steps = llama_ngram[f"raise_{real_kv_hash}"]
        assert (installed, exact, violations) == ("installed", True, 0) and steps > 0
        assert llama_ngram[f"raise_{real_kv_hash}_left_runner_as_it_was"]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "suffix"])
def test_an_untested_speculative_method_disables_the_canary_at_install_with_its_own_rule(llm, caplog, method):
    """A drafter that does not run here (a trained head or an MTP model): named by its method, refused in
    ``raise`` mode, disabled with one line in ``log`` mode, generate untouched."""
    runner = kv.find_runner(llm)
    before = dict(vars(runner))
    assert before["speculative_config"] is None
    runner.speculative_config = SimpleNamespace(method=method, num_speculative_tokens=3)
    try:
        with pytest.raises(ValueError, match=rf"^kv-canary: mode='raise' refuses this engine at install: .*"
                                             rf"method={method}, num_speculative_tokens=3.*unset `speculative_config`"):
            kv.install(llm, mode="raise")
        assert set(vars(runner)) == set(before)
        with caplog.at_level(logging.INFO, logger="kvcanary_cupy.vllm"):
            canary = kv.install(llm, backend="numpy")
        canary.remove()
        assert [rule.key for rule, _ in canary.support.engine] == ["speculative-other"]
        assert canary.disabled is not None and "_model_forward" not in vars(runner)
    finally:
        runner.speculative_config = before["speculative_config"]
    assert [r.getMessage().split(",")[0] for r in _ours(caplog)] == ["kv-canary disabled in CPUModelRunner"]
    assert set(vars(runner)) == set(before)


# -- MLA: the latent-cache group checked whole (tests/vllm/test_vllm_mla.py catches a latent bit flip) ------

def test_deepseek_mla_is_checked_whole_with_its_latent_rows_and_logs_nothing_unchecked(deepseek_mla):
    assert deepseek_mla["groups"] == [["MLAAttentionSpec", True, True]]
    assert deepseek_mla["canary_groups"] == ["G0"] and deepseek_mla["hooked"] is True
    _token_exact_and_quiet(deepseek_mla)
    assert _warnings(deepseek_mla) == []
    assert deepseek_mla["steps"] > 0 and deepseek_mla["write_entries"] >= deepseek_mla["prompt_tokens"]
    assert deepseek_mla["sweep_interval"] == 2
    assert deepseek_mla["fault"] == [2, ["VERIFY_POSITION_MISMATCH", "WRITE_POSITION_MISMATCH"], 2]
    for real_kv_hash in ("partial", "none"):
        assert deepseek_mla[f"raise_{real_kv_hash}"][:3] == ["installed", True, 0]
        assert deepseek_mla[f"raise_{real_kv_hash}_left_runner_as_it_was"]


# -- hybrids: the attention group checked, the rest skipped with one line each ------------------------------

def test_mistral_sliding_window_is_checked_whole_and_logs_nothing_unchecked(mistral_sw):
    assert mistral_sw["groups"] == [["SlidingWindowSpec", True, True]]
    assert mistral_sw["canary_groups"] == ["G0"]
    _token_exact_and_quiet(mistral_sw)
    assert _warnings(mistral_sw) == []
    assert mistral_sw["sweep_interval"] == 2  # one KV cache group: the sweep stays on
    assert mistral_sw["steps"] > 0 and mistral_sw["write_entries"] >= mistral_sw["prompt_tokens"]
    assert mistral_sw["fault"] == [2, ["VERIFY_POSITION_MISMATCH", "WRITE_POSITION_MISMATCH"], 2]
    for real_kv_hash in ("partial", "none"):
        assert mistral_sw[f"raise_{real_kv_hash}"][:3] == ["installed", True, 0]
        assert mistral_sw[f"raise_{real_kv_hash}_left_runner_as_it_was"]


def test_gemma3_checks_both_its_groups_with_the_sweep_on_and_logs_nothing_unchecked(gemma3):
    assert gemma3["groups"] == [["SlidingWindowSpec", True, True], ["FullAttentionSpec", True, True]]
    assert gemma3["canary_groups"] == ["G0", "G1"]
    _token_exact_and_quiet(gemma3)
    assert _warnings(gemma3) == []
    assert gemma3["sweep_interval"] == 2  # every group checked: each sweeps its own cached blocks
    # every token was stamped in both groups (each prompt token at least once per group)
    assert gemma3["steps"] > 0 and gemma3["write_entries"] >= 2 * gemma3["prompt_tokens"]
    # and what it checks it really checks: a shifted position is caught in the step it happens
    assert gemma3["fault"] == [2, ["VERIFY_POSITION_MISMATCH", "WRITE_POSITION_MISMATCH"], 2]
    # nothing is left unchecked, so raise mode installs
    for real_kv_hash in ("partial", "none"):
        assert gemma3[f"raise_{real_kv_hash}"][:3] == ["installed", True, 0]
        assert gemma3[f"raise_{real_kv_hash}_left_runner_as_it_was"]


def test_qwen3_next_skips_its_gated_delta_net_groups_and_checks_the_attention_group(qwen3_next):
    kinds = [g[0] for g in qwen3_next["groups"]]
    assert sorted(set(kinds)) == ["FullAttentionSpec", "MambaSpec"]
    for (spec, checked, real_kv), isas in zip(qwen3_next["groups"], qwen3_next["isas"], strict=True):
        # bf16: its K/V bytes are read on the `amx` layout (AMX tiles) and on `vec` (none) alike
        assert isas in (["amx"], ["vec"]) or spec != "FullAttentionSpec"
        assert (checked, real_kv) == ((True, True) if spec == "FullAttentionSpec" else (False, False))
    _token_exact_and_quiet(qwen3_next)
    lines = _warnings(qwen3_next)
    mamba = [line for line in lines if "(MambaSpec;" in line]
    assert len(mamba) == kinds.count("MambaSpec") and all("per-request recurrent state" in m for m in mamba)
    partial = [line for line in lines if "(FullAttentionSpec;" in line]
    assert len(partial) == (0 if qwen3_next["groups"][kinds.index("FullAttentionSpec")][2] else 1)
    assert all("checked without real-KV hashes" in line for line in partial)
    # the skipped groups write the shared block pool through tables the canary does not read: the sweep is off
    sweep = [line for line in lines if line.startswith("kv-canary: prefix-cache sweep off")]
    assert len(sweep) == 1 and "skipped" in sweep[0] and qwen3_next["sweep_interval"] == 0
    assert len(lines) == len(mamba) + len(partial) + 1
    assert qwen3_next["steps"] > 0 and qwen3_next["write_entries"] >= qwen3_next["prompt_tokens"]
    assert qwen3_next["fault"] == [2, ["VERIFY_POSITION_MISMATCH", "WRITE_POSITION_MISMATCH"], 2]
    assert "MambaSpec" in qwen3_next["raise_partial"] and "MambaSpec" in qwen3_next["raise_none"]
    assert qwen3_next["raise_partial_left_runner_as_it_was"] and qwen3_next["raise_none_left_runner_as_it_was"]


# -- bf16: K/V bytes read on the `amx` and `vec` layouts; bookkeeping checked where the layout is not read -------

def test_a_bf16_model_is_checked_with_its_kv_bytes_on_either_layout_vllm_gives_it(llama_bf16):
    [[spec, checked, real_kv]], [isas] = llama_bf16["groups"], llama_bf16["isas"]
    # vLLM's CPU attention takes `amx` for bf16 where the CPU has AMX tiles, `vec` where it has not: both read
    assert spec == "FullAttentionSpec" and checked and isas in (["amx"], ["vec"]) and real_kv
    _token_exact_and_quiet(llama_bf16)
    lines = _warnings(llama_bf16)
    assert llama_bf16["sweep_interval"] == 2 and llama_bf16["write_entries"] >= llama_bf16["prompt_tokens"]
    assert llama_bf16["fault"] == [2, ["VERIFY_POSITION_MISMATCH", "WRITE_POSITION_MISMATCH"], 2]
    assert llama_bf16["raise_none"][:3] == ["installed", True, 0] and llama_bf16["raise_none"][3] > 0
    assert lines == [] and llama_bf16["raise_partial"][:3] == ["installed", True, 0]
    assert llama_bf16["raise_partial_left_runner_as_it_was"] and llama_bf16["raise_none_left_runner_as_it_was"]


def test_a_layout_the_canary_cannot_read_leaves_kv_bytes_unhashed_and_checks_the_rest(llm, caplog):
    """The ``neon`` layout vLLM gives models on ARM CPUs, read from the layers' ``isa`` at install (set on the
    layers only while the canary installs: vLLM's kernels read it too, and this engine runs ``vec``)."""
    runner = kv.find_runner(llm)
    layers = [runner.compilation_config.static_forward_context[name]
              for group in runner.kv_cache_config.kv_cache_groups for name in group.layer_names]
    before = dict(vars(runner))
    assert {layer.isa for layer in layers} == {"vec"}
    want = workloads()["mixed-lengths"]
    assert llm.reset_prefix_cache()
    baseline = want.run(llm)
    try:
        for layer in layers:
            layer.isa = "neon"
        with pytest.raises(ValueError, match=r"^kv-canary: mode='raise' refuses this engine at install: part of "
                                             r"this engine would go unchecked: KV cache group G0 .*neon.*"
                                             r"or real_kv_hash=none"):
            kv.install(llm, mode="raise")
        assert set(vars(runner)) == set(before)
        with caplog.at_level(logging.INFO, logger="kvcanary_cupy.vllm"):
            canary = kv.install(llm, backend="numpy")
        for layer in layers:
            layer.isa = "vec"
        try:
            got = want.run(llm)
            canary.finish()
        finally:
            canary.remove()
        for layer in layers:
            layer.isa = "neon"
        strict = kv.install(llm, mode="raise", real_kv_hash="none", backend="numpy")
        strict.remove()
    finally:
        for layer in layers:
            layer.isa = "vec"
    assert got == baseline and canary.violations == [] and canary.steps > 0
    assert canary.state is not None and all(not g.k_sources for g in canary.state.rt.pools.groups)
    assert [r.levelname for r in _ours(caplog)] == ["WARNING", "INFO"]
    assert "KV cache group G0 (FullAttentionSpec;" in _ours(caplog)[0].getMessage()


def test_the_layer_isa_decides_whether_kv_bytes_are_read_at_install(llm):
    """`vec16` writes the `vec` layout and `amx` is read for the caches vLLM gives it (bf16, fp8); an `amx` layer
    over this fp32 cache is no layout vLLM writes, and is not read rather than refused mid-install."""
    runner = kv.find_runner(llm)
    layers = [runner.compilation_config.static_forward_context[name]
              for group in runner.kv_cache_config.kv_cache_groups for name in group.layer_names]
    found = {}
    try:
        for isa in ("vec16", "amx", "neon"):
            for layer in layers:
                layer.isa = isa
            found[isa] = [(g.layout.key, g.real_kv, g.isa) for g in support.assess(runner).groups if g.layout]
    finally:
        for layer in layers:
            layer.isa = "vec"
    assert found == {"vec16": [("isa-vec", True, "vec16")], "amx": [("isa-other", False, "amx")],
                     "neon": [("isa-other", False, "neon")]}


def test_the_sweep_stays_on_while_every_group_is_checked_and_goes_off_beside_a_skipped_group():
    """Gemma3-style (sliding-window + full, both checked): every write into the shared block pool is in a table the
    canary reads, so the sweep runs. Qwen3-Next-style (a Mamba group skipped beside full attention): that group's
    layers write blocks through a table the canary does not read, so the sweep is off, with one line naming it."""
    def group(index: int, spec: str, rule: str) -> support.GroupDecision:
        checked = support.RULE[rule].status == support.CHECKED
        return support.GroupDecision(index, spec, (f"model.layers.{index}.attn",), support.RULE[rule],
                                     support.RULE["isa-vec"] if checked else None, "vec" if checked else "")

    hybrid = support.Support("CPUModelRunner", [group(0, "SlidingWindowSpec", "sliding-window"),
                                                group(1, "FullAttentionSpec", "full")], [])
    assert hybrid.sweep and hybrid.unchecked() == [] and hybrid.refusal("partial") is None
    gdn = support.Support("CPUModelRunner", [group(0, "MambaSpec", "mamba"), group(1, "FullAttentionSpec", "full"),
                                             group(2, "MambaSpec", "mamba")], [])
    lines = gdn.unchecked()
    assert not gdn.sweep and len(lines) == 3
    assert lines[2].startswith("kv-canary: prefix-cache sweep off (KV cache group(s) G0, G2 skipped): the groups "
                               "share vLLM's block pool")


# -- the in-process llama (fp32): everything checked; the runner's flags read at install ----------------------

def test_a_full_attention_fp32_model_is_checked_whole_and_logs_nothing_unchecked(llm, caplog):
    with caplog.at_level(logging.INFO, logger="kvcanary_cupy.vllm"):
        canary = kv.install(llm, backend="numpy")
    canary.remove()
    found = canary.support
    assert [(g.spec, g.checked, g.real_kv) for g in found.groups] == [("FullAttentionSpec", True, True)]
    assert found.engine == [] and found.disabled is None and found.sweep
    assert [r.levelname for r in _ours(caplog)] == ["INFO"]


def test_async_scheduling_is_read_from_the_runners_flag_at_install(llm, caplog):
    runner = kv.find_runner(llm)
    before = dict(vars(runner))
    assert before["use_async_scheduling"] is False
    runner.use_async_scheduling = True  # what a GPU engine's runner says (vLLM's CPU platform forces it off)
    try:
        with pytest.raises(ValueError, match=r"^kv-canary: mode='raise' refuses this engine at install: .*"
                                             r"async_scheduling=False"):
            kv.install(llm, mode="raise")
        assert set(vars(runner)) == set(before)  # nothing hooked
        with caplog.at_level(logging.WARNING, logger="kvcanary_cupy.vllm"):
            canary = kv.install(llm, backend="numpy")
        try:
            assert canary.disabled is not None and "--no-async-scheduling" in canary.disabled
            assert "_model_forward" not in vars(runner) and "execute_model" not in vars(runner)
            want = workloads()["mixed-lengths"]
            got = want.run(llm)
            assert canary.steps == 0 and canary.violations == [] and len(got) == len(want.prompts)
        finally:
            canary.remove()
    finally:
        runner.use_async_scheduling = before["use_async_scheduling"]
    assert [r.getMessage().split(",")[0] for r in _ours(caplog)] == ["kv-canary disabled in CPUModelRunner"]
    assert set(vars(runner)) == set(before) and runner.use_async_scheduling is before["use_async_scheduling"]


def test_model_runner_v2_is_recognised_by_its_class_and_left_unchecked():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    found = support.assess(object.__new__(GPUModelRunner))
    assert [rule.key for rule, _ in found.engine] == ["runner-v2"]
    assert found.disabled is not None and "VLLM_USE_V2_MODEL_RUNNER=0" in found.disabled


# -- versions: refused by default, an operator's logged override ---------------------------------------------

def test_an_untested_vllm_release_is_refused_unless_the_operator_allows_it(monkeypatch, caplog):
    monkeypatch.delenv("KVCANARY_VLLM_ALLOW_UNTESTED", raising=False)
    with pytest.raises(ValueError, match=r"^kv-canary: vllm 0\.33\.0 is not supported.*"
                                         r"KVCANARY_VLLM_ALLOW_UNTESTED=1 or CanaryOptions\(allow_untested=True\)"):
        kv.check_version("0.33.0")
    with caplog.at_level(logging.WARNING, logger="kvcanary_cupy.vllm"):
        assert kv.check_version("0.33.0", allow_untested=True) == "0.33.0"
        monkeypatch.setenv("KVCANARY_VLLM_ALLOW_UNTESTED", "1")
        assert kv.check_version("0.34.1") == "0.34.1"
    assert [r.getMessage().split(";")[0] for r in _ours(caplog)] == [
        "kv-canary: vllm 0.33.0 is outside the tested range vllm>=0.32,<0.33",
        "kv-canary: vllm 0.34.1 is outside the tested range vllm>=0.32,<0.33"]
    assert kv.CanaryOptions.from_env({"KVCANARY_VLLM": "log", "KVCANARY_VLLM_ALLOW_UNTESTED": "1"}).allow_untested


def test_the_override_still_refuses_a_release_whose_hooked_internals_are_gone(monkeypatch):
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert kv.check_version(allow_untested=True) == "0.33.0"
    monkeypatch.delattr(GPUModelRunner, "_model_forward")
    with pytest.raises(ValueError, match=r"^kv-canary: vllm 0\.33\.0 is outside the tested range .* do not fit it.*"
                                         r"GPUModelRunner\._model_forward: missing"):
        kv.check_version(allow_untested=True)
