"""The sampled mutation run of tests/mutation/run.py: the draw (seeded, uniform, without repetition) and the
Wilson interval of the score, against hand-worked values."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

RUN_PY = Path(__file__).resolve().parent / "mutation" / "run.py"


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("kvcanary_mutation_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


NAMES = [f"pkg.mod.x_f__mutmut_{i}" for i in range(1, 41)]


@pytest.mark.parametrize("seed", range(8))
def test_the_draw_is_the_same_for_a_seed_and_whatever_order_the_names_come_in(runner, seed):
    first = runner.draw_sample(NAMES, 10, seed)
    assert first == runner.draw_sample(list(reversed(NAMES)), 10, seed)
    assert len(first) == len(set(first)) == 10
    assert set(first) <= set(NAMES)


def test_different_seeds_draw_different_samples(runner):
    draws = {tuple(runner.draw_sample(NAMES, 10, seed)) for seed in range(20)}
    assert len(draws) == 20


def test_a_sample_larger_than_the_mutants_takes_each_mutant_once(runner):
    drawn = runner.draw_sample(NAMES[:5], 12, seed=3)
    assert sorted(drawn) == sorted(NAMES[:5])


def test_the_draw_is_uniform_over_the_mutants_and_the_draw_order(runner):
    # 4,000 draws of 3 of 12 names: each name is drawn with probability 1/4 (expected 1,000 times; the standard
    # deviation is sqrt(4000 * 1/4 * 3/4) = 27.4, so 5 sigma is 137), and, as the runner checks the sample in the
    # order drawn, each name comes first with probability 1/12 (333.3 times; sigma 17.5, 5 sigma 87).
    names = NAMES[:12]
    drawn, first = Counter(), Counter()
    for seed in range(4000):
        sample = runner.draw_sample(names, 3, seed)
        assert len(set(sample)) == 3
        drawn.update(sample)
        first[sample[0]] += 1
    assert set(drawn) == set(first) == set(names)
    assert all(abs(count - 1000) < 137 for count in drawn.values()), drawn
    assert all(abs(count - 4000 / 12) < 87 for count in first.values()), first


@pytest.mark.parametrize("killed, checked, low, high", [
    # z = 1.96: z^2 = 3.8416; 8 of 10: centre (0.8 + 0.19208) / 1.38416 = 0.716738, half-width
    # 1.96 / 1.38416 * sqrt(0.016 + 0.009604) = 0.226581
    (8, 10, 0.490157, 0.943319),
    # 0 of 10: the lower end is 0, the upper 2 * 0.19208 / 1.38416 = 0.277540
    (0, 10, 0.0, 0.277540),
    (10, 10, 0.722460, 1.0),
    # 270 of 300: centre (0.9 + 0.0064027) / 1.0128053 = 0.894943, half-width
    # 1.96 / 1.0128053 * sqrt(0.0003 + 0.0000106711) = 0.034110
    (270, 300, 0.860833, 0.929053),
])
def test_the_interval_is_wilsons_score_interval(runner, killed, checked, low, high):
    got = runner.wilson_interval(killed, checked, z=1.96)
    assert got == pytest.approx((low, high), abs=2e-6)


def test_the_default_interval_is_the_95_percent_one_and_none_without_trials(runner):
    assert runner.wilson_interval(0, 0) == (0.0, 1.0)
    # 1 of 2 with z = 1.959964: symmetric about 1/2, half-width z / (1 + z^2 / 2) * sqrt(1/8 + z^2 / 16) = 0.405469
    assert runner.wilson_interval(1, 2) == pytest.approx((0.094531, 0.905469), abs=2e-6)


def test_the_package_target_mutates_every_module_but_vllms_integration(runner):
    package = RUN_PY.parents[2] / "kvcanary_cupy"
    expected = {str(path.relative_to(package.parent)) for path in package.rglob("*.py")}
    expected = {path for path in expected if not path.startswith("kvcanary_cupy/integrations/vllm/")}
    modules = runner.TARGETS["package"].modules
    assert len(modules) == len(set(modules)) and set(modules) == expected
    assert "kvcanary_cupy/sim/engine.py" in modules and "kvcanary_cupy/integrations/common/state.py" in modules


def test_the_package_target_runs_the_main_suite_without_vllms_tests(runner):
    tests = runner.TARGETS["package"].tests
    assert all(name.startswith("tests/test_") and "/vllm/" not in name for name in tests)
    assert all((RUN_PY.parents[2] / name).is_file() for name in tests)
    assert {"tests/test_runtime.py", "tests/test_sim_engine.py", "tests/test_mutation_sampling.py"} <= set(tests)
    assert "tests/test_nvrtc_compile.py" not in tests


def test_the_default_targets_are_the_per_module_ones(runner):
    assert runner.DEFAULT_TARGETS == [name for name in runner.TARGETS if name != "package"]
    assert runner.TARGETS["layouts"].keywords == "not host and not cuda"
    assert runner.TARGETS["package"].keywords.startswith("not host and not cuda and ")


@pytest.mark.parametrize("args, message", [
    (["--targets", "package", "--no-kernels"], "the package target runs sampled only: give --sample N"),
    (["--targets", "layouts", "--sample", "0"], "--sample takes a positive count"),
    (["--targets", "layouts", "--sample", "5", "--mutants", "*x_f*"], "--sample takes a positive count, and no"),
    (["--targets", "nothing"], "unknown target 'nothing'"),
    (["--targets", "layouts", "--resume"], "--resume continues a sampled run: give its --sample N and --seed S"),
])
def test_bad_sampling_arguments_are_refused_before_any_run(runner, monkeypatch, capsys, args, message):
    def no_run(*args, **kwargs):
        raise AssertionError("a run started")

    # in-process, with both kinds of run replaced: a refusal that failed must not start a real run
    monkeypatch.setattr(runner, "run_python_target", no_run)
    monkeypatch.setattr(runner, "run_kernel_mutants", no_run)
    monkeypatch.setattr(sys, "argv", ["run.py", *args])
    with pytest.raises(SystemExit) as refused:
        runner.main()
    assert refused.value.code == 2 and message in capsys.readouterr().err


def _stopped_run(work: Path, verdicts: dict[str, dict[str, int | None]], drawn: list[str]) -> None:
    """A scratch folder as a stopped sampled run leaves it: mutmut's metadata per module, the draw."""
    for module, codes in verdicts.items():
        meta = work / "mutants" / f"{module}.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": codes}))
    (work / "sample.json").write_text(json.dumps(drawn))


def test_a_resumed_run_checks_the_drawn_mutants_without_a_verdict_in_the_order_drawn(runner, tmp_path):
    a = {f"pkg.a.x_f__mutmut_{i}": None for i in range(1, 7)}
    b = {f"pkg.b.x_g__mutmut_{i}": None for i in range(1, 7)}
    names = sorted([*a, *b])
    drawn = runner.draw_sample(names, 5, seed=2)
    # the first two drawn have verdicts (killed, survived), the third none yet; one undrawn mutant a verdict too
    for name, code in zip(drawn[:2], (1, 0), strict=True):
        (a if name in a else b)[name] = code
    undrawn = next(n for n in names if n not in drawn)
    (a if undrawn in a else b)[undrawn] = 1
    _stopped_run(tmp_path, {"pkg/a.py": a, "pkg/b.py": b}, drawn)
    sample, unchecked = runner._resumed_sample(tmp_path, 5, 2)
    assert (sample.total, sample.names) == (12, drawn)
    assert unchecked == drawn[2:]
    assert sample.module_of[drawn[0]] == ("pkg/a.py" if drawn[0] in a else "pkg/b.py")


def test_a_resume_is_refused_without_a_stopped_run_or_for_another_draw(runner, tmp_path):
    with pytest.raises(SystemExit, match=r"--resume: .* holds no sampled run to continue \(no sample\.json\)"):
        runner._resumed_sample(tmp_path, 5, 2)
    codes = {f"pkg.a.x_f__mutmut_{i}": None for i in range(1, 13)}
    _stopped_run(tmp_path, {"pkg/a.py": codes}, runner.draw_sample(list(codes), 5, seed=2))
    for size, seed in ((5, 3), (6, 2), (4, 2)):
        with pytest.raises(SystemExit, match=rf"drew another sample than --sample {size} --seed {seed}$"):
            runner._resumed_sample(tmp_path, size, seed)
