"""``make mutate``: mutation testing of the Python modules with mutmut, and of the kernels with a short list of
planted edits run through the host backend's tests; prints a score per target and a total.

Each Python target is a set of modules and the fast tests that pin them (a focused selection: mutmut further
runs, per mutant, only the tests that executed the mutated function). A target runs in a scratch copy under
``build/mutate/<target>/`` whose pyproject.toml carries the target's ``[tool.mutmut]`` section, so the
repository itself is never edited. Kernel mutations (``kernel_mutants.txt``) are applied to a scratch copy of
the package and kernels; each must make its tests fail (be killed).

The ``package`` target mutates the whole package (but vLLM's integration) under the main suite: far too many
mutants to run all of them, so it is run with ``--sample N --seed S``: every mutant is generated, N of them are
drawn uniformly at random without repetition, only those run (in the order drawn, so a run stopped part-way has
still checked a uniform sample), and the score comes with its 95 % Wilson interval. ``--resume`` continues a
sampled run that was stopped, in its scratch folder as it was (its mutants, its copy of the tests, mutmut's
statistics and the verdicts so far), with the mutants of the draw that have no verdict yet.

Usage: ``python tests/mutation/run.py [--targets a,b] [--no-kernels] [--max-children N] [--mutants GLOB...]
[--sample N --seed S [--resume]]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = ROOT / "build" / "mutate"
PYTEST = ["-q", "-p", "no:cacheprovider", "--benchmark-disable", "-x"]
# The tests parametrized for the host or CUDA backend are left out: the Python modules are mutated, the NumPy
# backend runs them. ``-k`` matches any part of a test's id, so a target whose ids name "host" otherwise (the
# simulator's tier-host-page-reused fault) gives its own expression.
NOT_KERNEL_BACKENDS = "not host and not cuda"

@dataclass(frozen=True)
class Target:
    """What one target mutates (``modules``, narrowed to the mutants matching ``mutants`` globs when given) and
    the tests that pin it; ``env`` ``"vllm"``: mutmut and the tests run in vLLM's own environment (``.venv-vllm``,
    or ``KVCANARY_VLLM_PYTHON``) with its OpenMP library preloaded, as ``make test-vllm`` runs them; ``keywords``:
    the ``-k`` expression that selects the tests' NumPy runs; ``files``: what else of the repository its tests read
    (copied beside the package)."""

    modules: list[str]
    tests: list[str]
    mutants: list[str] = field(default_factory=list)
    env: str = "main"
    keywords: str = NOT_KERNEL_BACKENDS
    files: list[str] = field(default_factory=list)


# The runtime package's modules, one list for the targets below (edit here when the package's modules change).
# CanaryRuntime and the classes it is built from (one concern per module)
RUNTIME_MODULES = [f"kvcanary_cupy/runtime/{name}.py" for name in ("runtime", "base", "moves", "sweep", "monitor")]
# The bounded verify: the window selection and the latency bound (its bookkeeping lives in the runtime module).
BOUNDED_VERIFY_MODULES = ["kvcanary_cupy/runtime/groups.py", "kvcanary_cupy/runtime/config.py",
                          *RUNTIME_MODULES]
BOUNDED_VERIFY_MUTANTS = ["*x_select_window__mutmut_*", "*x_verify_latency_bound__mutmut_*",
                          "*Monitoring*verify_bound__mutmut_*", "*CanaryConfig*bounded_verify__mutmut_*"]

TARGETS: dict[str, Target] = {
    "transfer": Target(["kvcanary_cupy/transfer.py", "kvcanary_cupy/backends/numpy_transfer.py"],
                       ["tests/test_transfer.py", "tests/test_transfer_edges.py", "tests/test_tier_calls.py"]),
    # the record moves (offload, restore) are pinned by the tier tests of the runtime; the per-model sweep, shared
    # plans and the stated bound by their own runtime tests (of test_bounded_verify.py, the two that read the bound
    # back from a run: the rest of it is the bounded_verify target's)
    "runtime": Target(RUNTIME_MODULES, ["tests/test_runtime.py", "tests/test_runtime_chunks_and_order.py",
                                        "tests/test_runtime_tiers.py", "tests/test_runtime_restore_arguments.py",
                                        "tests/test_offloaded_records_checks.py", "tests/test_runtime_record_moves.py",
                                        "tests/test_runtime_monitoring.py", "tests/test_runtime_flush.py",
                                        "tests/test_runtime_creation.py", "tests/test_allocation_limits.py",
                                        "tests/test_runtime_sweep_models.py", "tests/test_runtime_shared_plan.py",
                                        "tests/test_bounded_verify_window.py",
                                        "tests/test_bounded_verify.py::test_the_bound_is_one_step_when_the_live_entries"
                                        "_equal_the_window_even_with_growth",
                                        "tests/test_bounded_verify.py::test_an_overflowed_plan_counts_neither_in_the"
                                        "_live_maximum_nor_in_the_bound"]),
    "plan": Target(["kvcanary_cupy/backends/numpy_plan.py", "kvcanary_cupy/backends/numpy_plan_entries.py"],
                   ["tests/test_plan_edge_cases.py", "tests/test_plan_validation.py",
                    "tests/test_plan_device_value_messages.py", "tests/test_plan_reference_corner_cases.py",
                    "tests/test_layouts_reference.py",
                    "tests/test_reference_vs_oracle.py::test_plan_matches_oracle_on_valid_batches",
                    "tests/test_reference_vs_oracle.py::test_plan_flags_hostile_values_like_the_oracle_and_raises_otherwise",
                    "tests/test_reference_vs_oracle.py::test_plan_matches_oracle_on_large_batches"]),
    "chain": Target(["kvcanary_cupy/backends/numpy_chain.py", "kvcanary_cupy/backends/numpy_paged.py",
                     "kvcanary_cupy/backends/numpy_backend.py"],
                    ["tests/test_chain_edge_cases.py", "tests/test_verify_write_refusals.py",
                     "tests/test_oracle_vectors.py", "tests/test_write_reference_cases.py", "tests/test_hashing.py",
                     "tests/test_reference_vs_oracle.py::test_write_and_verify_match_oracle",
                     "tests/test_reference_vs_oracle.py::test_write_and_verify_flag_hostile_values_like_the_oracle",
                     "tests/test_hardening.py::test_two_threads_verifying_on_one_context_lose_no_ring_row"]),
    # the argument checks: also the overlap, device, storage-guard and host-vector checks that the transfer,
    # tier, KV-layout, DLPack and hardening tests reach
    "validate": Target(["kvcanary_cupy/_validate.py"],
                       ["tests/test_plan_validation.py", "tests/test_context_validation.py",
                        "tests/test_layout_validation.py", "tests/test_transfer.py", "tests/test_transfer_edges.py",
                        "tests/test_offloaded_records_checks.py", "tests/test_kv_layouts.py",
                        "tests/test_hardening.py", "tests/test_dlpack_bridge.py", "tests/test_tier_calls.py",
                        "tests/test_validate_edges.py"]),
    "layouts": Target(["kvcanary_cupy/layouts.py"],
                      ["tests/test_layout_validation.py", "tests/test_layouts_reference.py",
                       "tests/test_slot_layout_edges.py"]),
    "tiers": Target(["kvcanary_cupy/tiers.py"],
                    ["tests/test_tiers.py", "tests/test_runtime_tiers.py", "tests/test_tier_calls.py",
                     "tests/test_offloaded_records_checks.py"]),
    # the tiered simulator: its fault kinds' NumPy runs (tier-host-page-reused's among them), its bookkeeping
    # (pins, locks, counts, caps, fault records), each load-back's join, taint and duplicates, the fault planner's
    # choices, the L3 directory, and (of test_sim_tiers_seeds.py, the rest too slow to rerun per mutant) a
    # classic fault's damage followed through write-back and restore
    "sim_tiers": Target(["kvcanary_cupy/sim/tiers.py"],
                        ["tests/test_sim_tiers.py", "tests/test_sim_tier_bookkeeping.py",
                         "tests/test_sim_tier_faults.py", "tests/test_sim_tier_dir.py",
                         "tests/test_sim_tiers_seeds.py::test_without_following_the_damage_through_the_tiers_the_same"
                         "_run_reports_false_positives"],
                        keywords="not cuda and (not host or numpy)"),
    "kv_bytes": Target(["kvcanary_cupy/kv_bytes.py"],
                       ["tests/test_kv_layouts.py", "tests/test_kv_layout_refusals.py",
                        "tests/test_kv_layouts_amx.py"]),
    "kv_layouts": Target(["kvcanary_cupy/kv_layouts.py"],
                         ["tests/test_kv_layouts.py", "tests/test_kv_layout_refusals.py",
                          "tests/test_kv_layout_messages.py", "tests/test_kv_layouts_amx.py",
                          "tests/test_vllm_packed_layouts.py"]),
    "bounded_verify": Target(BOUNDED_VERIFY_MODULES,
                             ["tests/test_bounded_verify.py", "tests/test_bounded_verify_window.py"],
                             mutants=BOUNDED_VERIFY_MUTANTS),
    # The step read (all of step.py), the sweep's block index (all of blocks.py) and the slot tables of the vLLM
    # integration, pinned by the tests that need no engine: the stand-in runner's steps, among them the draft
    # tokens' (``with_drafts``), the sliding-window and hybrid groups' (the index's freed and claimed blocks) and
    # the TAIL thread's (held, released, beside the forward). No test that starts an engine: an engine per mutant
    # would cost seconds each, and one started in mutmut's own process (its statistics and clean runs) binds that
    # process's threads to the worker's cores, which every forked mutant run inherits: the TAIL thread then finds
    # the other cores idle and the stand-in steps run another schedule than their tests pin (every mutant killed).
    "vllm": Target(["kvcanary_cupy/integrations/vllm/step.py", "kvcanary_cupy/integrations/vllm/blocks.py",
                    "kvcanary_cupy/integrations/vllm/canary.py"],
                   ["tests/vllm/test_vllm_step.py", "tests/vllm/test_vllm_step_read.py",
                    "tests/vllm/test_vllm_step_values.py", "tests/vllm/test_vllm_internals.py",
                    "tests/vllm/test_vllm_speculative_step.py", "tests/vllm/test_vllm_sliding_window.py",
                    "tests/vllm/test_vllm_block_index.py", "tests/vllm/test_vllm_tail_phases.py"],
                   mutants=["*vllm.step.*", "*vllm.blocks.*", "*GroupGeometry*slots_of__mutmut_*",
                            "*VllmCanaryState*_fill_table__mutmut_*", "*VllmCanaryState*forget_blocks__mutmut_*",
                            "*VllmCanaryState*_note_complete_blocks__mutmut_*",
                            "*VllmCanaryState*after_forward__mutmut_*", "*VllmCanaryState*read_step__mutmut_*",
                            "*VllmCanaryState*_cached_slots__mutmut_*", "*vllm.canary.x_sweep_blocks__*",
                            "*VllmCanaryState*before_forward__mutmut_*", "*VllmCanaryState*_stage_and_plan__mutmut_*",
                            "*VllmCanaryState*_tail_work__mutmut_*", "*VllmCanaryState*release_tail__mutmut_*",
                            "*VllmCanaryState*_stage_and_plan_beside__mutmut_*",
                            "*VllmCanaryState*_tail_work_beside__mutmut_*"],
                   env="vllm"),
}


# The whole package, sampled (``--sample``): every module but vLLM's integration, whose tests need vLLM's
# environment (the ``vllm`` target covers its step read there), under the main suite but the files that pin no
# Python module of the package or run it only from outside (the NVRTC compiles of the kernels, the wheel build, the
# browser rendering, the documentation and example scripts, each a process of its own and seconds to minutes), and
# the two longest random runs (the 14,000 bad calls of the entry points, the tiered simulator over many seeds),
# whose cases the other files pin in small: mutmut runs every selected test once with its statistics on, and each
# surviving mutant reruns every test that reached its function.
PACKAGE_EXCLUDED_MODULES = "kvcanary_cupy/integrations/vllm/*"
PACKAGE_EXCLUDED_TESTS = ["test_nvrtc_compile.py", "test_packaging.py", "test_report_in_browser.py",
                          "test_readme.py", "test_examples.py", "test_fuzz_entry_points.py", "test_sim_tiers_seeds.py"]


def package_modules() -> list[str]:
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "kvcanary_cupy").rglob("*.py")
                  if not path.match(PACKAGE_EXCLUDED_MODULES))


def package_tests() -> list[str]:
    return sorted(f"tests/{path.name}" for path in (ROOT / "tests").glob("test_*.py")
                  if path.name not in PACKAGE_EXCLUDED_TESTS)


# Copied: the documentation pages, the changelog and the cost table's renderer (bench/), which some tests check the
# code against. Left out: the runs under AddressSanitizer (the kernels' host builds, each in a process of its own),
# and the scan of the package's source for the environment variables it reads (the mutated copy it would scan holds
# every mutant's strings).
TARGETS["package"] = Target(package_modules(), package_tests(), files=["docs", "CHANGELOG.md", "bench"],
                            keywords=f"{NOT_KERNEL_BACKENDS} and not address_sanitizer"
                                     " and not every_environment_variable_the_package_reads")
# Too many mutants to run every one (tens of thousands, seconds to minutes each): the target runs sampled only.
SAMPLED_ONLY = {"package"}
# The targets ``make mutate`` runs when none are named.
DEFAULT_TARGETS = [name for name in TARGETS if name not in SAMPLED_ONLY]

# mutmut's command line. With KVCANARY_MUTANT_ORDER (a JSON list of mutant names), for a sampled run: the mutants
# run in that order instead of mutmut's fastest-first one, so a run stopped part-way has checked a uniform
# sub-sample; and its "clean" run of the selected tests is skipped: the statistics run just before it (a fresh
# scratch copy has none to reuse) ran every selected test, and stops with -x at the first that fails.
MUTMUT_MAIN = ("import json, os, sys\n"
               "import mutmut.__main__ as mutmut_main\n"
               "order_file = os.environ.get('KVCANARY_MUTANT_ORDER')\n"
               "if order_file:\n"
               "    with open(order_file) as f:\n"
               "        rank = {name: i for i, name in enumerate(json.load(f))}\n"
               "    mutmut_main.estimated_worst_case_time = lambda name: rank.get(name, len(rank))\n"
               "    make_runner = mutmut_main.get_mutant_runner\n"
               "    def runner_without_clean_run(*args, **kwargs):\n"
               "        runner = make_runner(*args, **kwargs)\n"
               "        runner.run_clean_tests = lambda tests: 0\n"
               "        return runner\n"
               "    mutmut_main.get_mutant_runner = runner_without_clean_run\n"
               "sys.exit(mutmut_main.cli())")
# Writes every mutant of the configured modules under mutants/ (what ``mutmut run`` does first; it keeps them).
MUTMUT_GENERATE = ("import os, sys\n"
                   "import mutmut.__main__ as mutmut_main\n"
                   "os.makedirs('mutants', exist_ok=True)\n"
                   "mutmut_main.copy_src_dir()\n"
                   "mutmut_main.copy_also_copy_files()\n"
                   "mutmut_main.create_mutants(int(sys.argv[1]))")


def draw_sample(names: list[str], size: int, seed: int) -> list[str]:
    """``size`` of ``names`` (all of them when fewer), drawn uniformly without repetition by ``seed``, in the
    order drawn (itself uniformly random)."""
    return random.Random(seed).sample(sorted(names), min(size, len(names)))


def wilson_interval(successes: int, trials: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % for the default ``z``); (0, 1) for no trials."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


def _mutants_by_module(work: Path) -> dict[str, str]:
    """Every generated mutant's name and the module it mutates (from mutmut's per-module metadata)."""
    out = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        module = str(meta.relative_to(work / "mutants"))[: -len(".meta")]
        out.update(dict.fromkeys(json.loads(meta.read_text())["exit_code_by_key"], module))
    return out


def _unchecked(work: Path, names: list[str]) -> list[str]:
    """Those of ``names`` (in their order) that have no verdict in the scratch folder's mutmut metadata."""
    verdicts: dict[str, int | None] = {}
    for meta in (work / "mutants").rglob("*.py.meta"):
        verdicts.update(json.loads(meta.read_text())["exit_code_by_key"])
    return [name for name in names if verdicts.get(name) is None]


def _resumed_sample(work: Path, size: int, seed: int) -> tuple[Sample, list[str]]:
    """The draw of the sampled run stopped in ``work`` and its mutants still to check; refused when the folder
    holds no sampled run, or one whose draw is not ``size`` and ``seed``'s over the same mutants."""
    if not (work / "sample.json").is_file():
        raise SystemExit(f"--resume: {work} holds no sampled run to continue (no sample.json)")
    module_of = _mutants_by_module(work)
    names = json.loads((work / "sample.json").read_text())
    if names != draw_sample(list(module_of), size, seed):
        raise SystemExit(f"--resume: the run in {work} drew another sample than --sample {size} --seed {seed}")
    return Sample(len(module_of), names, module_of), _unchecked(work, names)


def _python(target: Target) -> tuple[str, dict[str, str]]:
    """The interpreter a target's mutmut runs under, and the environment additions it needs."""
    if target.env == "main":
        return sys.executable, {}
    python = Path(os.environ.get("KVCANARY_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        raise SystemExit(f"the vllm target needs vLLM's environment: {python} is missing (make test-vllm builds "
                         "it; KVCANARY_VLLM_PYTHON names another)")
    extra = {}
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():  # vLLM's CPU build needs its OpenMP first (the Makefile's VLLM_RUN)
        extra["LD_PRELOAD"] = str(iomp)
    return str(python), extra


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


def _scratch_copy(dest: Path, files: tuple[str, ...] = (), keep_mutants: bool = False) -> None:
    """A fresh copy of the repository's package, kernels and tests (and ``files``) at ``dest``. ``keep_mutants``:
    the package's mutants generated there before are kept (generating the whole package's takes minutes);
    mutmut generates a module's again when its source is newer, and everything else under ``mutants/`` (tests,
    statistics, verdicts) is dropped."""
    kept = dest / "mutants" / "kvcanary_cupy"
    parked = dest.parent / f"{dest.name}.mutants"
    if keep_mutants and kept.exists():
        shutil.rmtree(parked, ignore_errors=True)
        kept.rename(parked)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "mutants")
    for name in ("kvcanary_cupy", "kernels", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("setup.py", "README.md", "pyproject.toml", *files):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, dest / name)
    if parked.exists():
        (dest / "mutants").mkdir()
        parked.rename(kept)
        for meta in kept.rglob("*.meta"):  # verdicts of an earlier run: this one checks its own draw
            data = json.loads(meta.read_text())
            data["exit_code_by_key"] = dict.fromkeys(data["exit_code_by_key"])
            meta.write_text(json.dumps(data))


@dataclass
class Sample:
    """A sampled run's draw: how many mutants the target has in all, the names drawn (in the order drawn) and the
    module of each."""

    total: int
    names: list[str]
    module_of: dict[str, str]


def run_python_target(name: str, max_children: int, mutants: list[str], sample: tuple[int, int] | None = None,
                      resume: bool = False) -> tuple[int, int, list[str], dict[str, str], Sample | None]:
    """mutmut over one target (only the mutants matching the ``mutants`` globs, when given, or a uniform random
    ``sample`` of (size, seed) of all its mutants; ``resume``: the rest of a stopped sampled run); (killed,
    checked, survivors as 'mutant: status', every checked mutant's status, the sample). Stopped (Ctrl-C,
    SIGTERM), it reports the mutants checked so far."""
    target = TARGETS[name]
    modules, tests = target.modules, target.tests
    mutants = mutants or target.mutants
    python, extra_env = _python(target)
    work = SCRATCH / name
    if not resume:
        _scratch_copy(work, tuple(target.files), keep_mutants=sample is not None)
        with open(work / "pyproject.toml", "a") as f:
            f.write("\n[tool.mutmut]\n"
                    f'source_paths = ["kvcanary_cupy"]\n'
                    f"only_mutate = {_toml_list(modules)}\n"
                    f"also_copy = {_toml_list(['kernels', 'setup.py', 'README.md', *target.files])}\n"
                    f"pytest_add_cli_args = {_toml_list([*PYTEST, '-k', target.keywords])}\n"
                    f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
                    "use_git_change_detection = false\n")
    mutmut = [python, "-c", MUTMUT_MAIN]
    # The differential tests' random examples cut to a tenth: each survivor reruns them.
    env = dict(os.environ, KVCANARY_CACHE_DIR=str(SCRATCH / "cache"), HYPOTHESIS_PROFILE="ci",
               KVCANARY_DIFFERENTIAL_SCALE="0.1", **extra_env)
    drawn = None
    if sample is not None and resume:
        # mutmut loads its statistics from the earlier run (collecting them only for tests it has not seen)
        drawn, mutants = _resumed_sample(work, *sample)
        env["KVCANARY_MUTANT_ORDER"] = str(work / "sample.json")
        print(f"  {name}: {drawn.total} mutants, {len(drawn.names)} drawn (seed {sample[1]}), "
              f"{len(drawn.names) - len(mutants)} checked before, resumed", flush=True)
    elif sample is not None:
        subprocess.run([python, "-c", MUTMUT_GENERATE, str(max_children)], cwd=work, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        module_of = _mutants_by_module(work)
        drawn = Sample(len(module_of), draw_sample(list(module_of), *sample), module_of)
        (work / "sample.json").write_text(json.dumps(drawn.names, indent=0))
        env["KVCANARY_MUTANT_ORDER"] = str(work / "sample.json")
        mutants = drawn.names
        print(f"  {name}: {drawn.total} mutants, {len(drawn.names)} drawn (seed {sample[1]})", flush=True)
    stopped = False
    rc = 0
    # (a resumed run with nothing left starts no mutmut run: one without mutant names would run every mutant)
    with open(work / "mutmut.log", "a" if resume else "w") as log:  # its progress spinner, out of the summary
        if mutants or not resume:
            # SIGINT restored in mutmut: a background job inherits it ignored, and the stop below sends it
            proc = subprocess.Popen([*mutmut, "run", "--max-children", str(max_children), *mutants], cwd=work,
                                    env=env, stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            try:
                rc = proc.wait()
            except KeyboardInterrupt:  # mutmut stops its workers on SIGINT and keeps the verdicts it has
                stopped = True
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                rc = proc.wait()
    if rc != 0 and not stopped:
        raise SystemExit(f"mutmut run failed for {name} (exit {rc}): see {work / 'mutmut.log'}")
    out = subprocess.run([*mutmut, "results", "--all", "true"], cwd=work, env=env, check=True,
                         capture_output=True, text=True).stdout
    statuses = dict(re.findall(r"^\s+(\S+): (.+)$", out, flags=re.M))
    if drawn is not None:
        statuses = {k: statuses.get(k, "not checked") for k in drawn.names}
    if mutants or stopped:
        statuses = {k: v for k, v in statuses.items() if v != "not checked"}
    if stopped:
        print(f"  {name}: stopped; {len(statuses)} mutants checked", flush=True)
    killed = sum(s in ("killed", "timeout") for s in statuses.values())
    survivors = sorted(f"{k}: {s}" for k, s in statuses.items() if s not in ("killed", "timeout"))
    return killed, len(statuses), survivors, statuses, drawn


def print_sample_report(name: str, drawn: Sample, statuses: dict[str, str]) -> None:
    """The sampled score with its 95 % Wilson interval, and the sample per module."""
    checked = [k for k in drawn.names if k in statuses]
    killed = sum(statuses[k] in ("killed", "timeout") for k in checked)
    low, high = wilson_interval(killed, len(checked))
    print(f"\n{name}: {drawn.total} mutants in all, {len(drawn.names)} drawn, {len(checked)} checked, "
          f"{killed} killed: {100 * killed / max(len(checked), 1):.1f}% "
          f"(95% Wilson interval {100 * low:.1f}% to {100 * high:.1f}%)")
    per_module: dict[str, list[int]] = {}
    for k in checked:
        counts = per_module.setdefault(drawn.module_of[k], [0, 0, 0])
        counts[0] += 1
        counts[1] += statuses[k] in ("killed", "timeout")
        counts[2] += statuses[k] == "no tests"
    print(f"  {'module':50s} {'checked':>7s} {'killed':>6s} {'no tests':>8s}")
    for module, (n, k, no_tests) in sorted(per_module.items()):
        print(f"  {module:50s} {n:7d} {k:6d} {no_tests:8d}")


def kernel_mutants() -> list[tuple[str, str, str, list[str]]]:
    """(label, kernel file, sed-style s|old|new| edit, tests) per line of kernel_mutants.txt."""
    out = []
    for line in (Path(__file__).parent / "kernel_mutants.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        label, file, edit, tests = (part.strip() for part in line.split("\t"))
        out.append((label, file, edit, tests.split()))
    return out


def _apply(text: str, edit: str) -> str:
    sep = edit[1]
    _, old, new, _ = (part.replace("\\n", "\n") for part in edit.split(sep))
    if text.count(old) != 1:
        raise SystemExit(f"kernel mutation {edit!r} must match exactly once (matched {text.count(old)} times)")
    return text.replace(old, new)


def run_kernel_mutants() -> tuple[int, int, list[str]]:
    work = SCRATCH / "kernels"
    _scratch_copy(work)
    env = dict(os.environ, KVCANARY_CACHE_DIR=str(SCRATCH / "cache"), PYTHONPATH=str(work))
    killed, survivors, mutants = 0, [], kernel_mutants()
    for label, file, edit, tests in mutants:
        path = work / file
        original = path.read_text()
        path.write_text(_apply(original, edit))
        try:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable", "-x",
                   "-k", "host", *tests]
            rc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True).returncode
        finally:
            path.write_text(original)
        # 1: a test failed; a crash (a signal, negative) kills too; 0 survived; 2-5: not a verdict (usage, no tests)
        status = ("killed" if rc == 1 or rc < 0 else "survived" if rc == 0
                  else f"not run (pytest exit {rc})")
        print(f"    kernel {label}: {status}", flush=True)
        if status == "killed":
            killed += 1
        else:
            survivors.append(f"{label}: {status}")
    return killed, len(mutants), survivors


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a run stopped by SIGTERM still reports what it checked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help=f"comma-separated, of {', '.join(TARGETS)} (default: all but "
                             f"{', '.join(SAMPLED_ONLY)}, which runs with --sample only)")
    parser.add_argument("--no-kernels", action="store_true", help="skip the planted kernel mutations")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--mutants", nargs="*", default=[],
                        help="only the mutants matching these globs, e.g. '*CanaryRuntime*sweep*' (in place of "
                             "a target's own globs)")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="run N of each target's mutants, drawn uniformly at random (with --seed), and print "
                             "the score's 95%% Wilson interval")
    parser.add_argument("--seed", type=int, default=0, help="the seed of --sample's draw (default 0)")
    parser.add_argument("--resume", action="store_true",
                        help="continue a stopped sampled run (the same --sample and --seed) in its scratch folder "
                             "as it was: no new copy, no generation, mutmut's statistics and verdicts kept")
    args = parser.parse_args()
    names = [t for t in args.targets.split(",") if t]
    for name in names:
        if name not in TARGETS:
            parser.error(f"unknown target {name!r}")
        if name in SAMPLED_ONLY and args.sample is None:
            parser.error(f"the {name} target runs sampled only: give --sample N")
    if args.sample is not None and (args.sample < 1 or args.mutants):
        parser.error("--sample takes a positive count, and no --mutants")
    if args.resume and args.sample is None:
        parser.error("--resume continues a sampled run: give its --sample N and --seed S")
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    results: dict[str, tuple[int, int, list[str], float]] = {}
    samples: dict[str, tuple[Sample, dict[str, str]]] = {}
    for name in names:
        start = time.perf_counter()
        sample = None if args.sample is None else (args.sample, args.seed)
        killed, total, survivors, statuses, drawn = run_python_target(name, args.max_children, args.mutants,
                                                                      sample, args.resume)
        results[name] = (killed, total, survivors, time.perf_counter() - start)
        if drawn is not None:
            samples[name] = (drawn, statuses)
        print(f"  {name}: {killed} / {total} killed in {results[name][3]:.0f} s", flush=True)
    if not args.no_kernels:
        start = time.perf_counter()
        killed, total, survivors = run_kernel_mutants()
        results["kernels"] = (killed, total, survivors, time.perf_counter() - start)
    print("\nmutation score (killed / mutants):")
    for name, (killed, total, survivors, secs) in results.items():
        print(f"  {name:10s} {killed:5d} / {total:5d}  {100 * killed / max(total, 1):5.1f}%  {secs:6.0f} s")
        for s in survivors:
            print(f"      survived {s}")
    killed = sum(r[0] for r in results.values())
    total = sum(r[1] for r in results.values())
    print(f"  {'total':10s} {killed:5d} / {total:5d}  {100 * killed / max(total, 1):5.1f}%")
    for name, (drawn, statuses) in samples.items():
        print_sample_report(name, drawn, statuses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
