"""``make mutate``: mutation testing of the Python modules with mutmut, and of the kernels with a short list of
planted edits run through the host backend's tests; prints a score per target and a total.

Each Python target is a set of modules and the fast tests that pin them (a focused selection: mutmut further
runs, per mutant, only the tests that executed the mutated function). A target runs in a scratch copy under
``build/mutate/<target>/`` whose pyproject.toml carries the target's ``[tool.mutmut]`` section, so the
repository itself is never edited. Kernel mutations (``kernel_mutants.txt``) are applied to a scratch copy of
the package and kernels; each must make its tests fail (be killed).

Usage: ``python tests/mutation/run.py [--targets a,b] [--no-kernels] [--max-children N] [--mutants GLOB...]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
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
    the ``-k`` expression that selects the tests' NumPy runs."""

    modules: list[str]
    tests: list[str]
    mutants: list[str] = field(default_factory=list)
    env: str = "main"
    keywords: str = NOT_KERNEL_BACKENDS


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
    # integration, pinned by the tests that need no engine (an engine per mutant would cost seconds each): the
    # stand-in runner's steps, among them the draft tokens' (``with_drafts``) and the sliding-window and hybrid
    # groups' (the index's freed and claimed blocks).
    "vllm": Target(["kvcanary_cupy/integrations/vllm/step.py", "kvcanary_cupy/integrations/vllm/blocks.py",
                    "kvcanary_cupy/integrations/vllm/canary.py"],
                   ["tests/vllm/test_vllm_step.py", "tests/vllm/test_vllm_step_read.py",
                    "tests/vllm/test_vllm_step_values.py", "tests/vllm/test_vllm_internals.py",
                    "tests/vllm/test_vllm_speculative_step.py", "tests/vllm/test_vllm_sliding_window.py",
                    "tests/vllm/test_vllm_block_index.py"],
                   mutants=["*vllm.step.*", "*vllm.blocks.*", "*GroupGeometry*slots_of__mutmut_*",
                            "*VllmCanaryState*_fill_table__mutmut_*", "*VllmCanaryState*forget_blocks__mutmut_*",
                            "*VllmCanaryState*_note_complete_blocks__mutmut_*",
                            "*VllmCanaryState*after_forward__mutmut_*", "*VllmCanaryState*read_step__mutmut_*",
                            "*VllmCanaryState*_cached_slots__mutmut_*", "*vllm.canary.x_sweep_blocks__*"],
                   env="vllm"),
}


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


def _scratch_copy(dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "mutants")
    for name in ("kvcanary_cupy", "kernels", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("setup.py", "README.md", "pyproject.toml"):
        shutil.copy2(ROOT / name, dest / name)


def run_python_target(name: str, max_children: int, mutants: list[str]) -> tuple[int, int, list[str]]:
    """mutmut over one target (only the mutants matching the ``mutants`` globs, when given); (killed, total,
    survivors as 'mutant: status')."""
    target = TARGETS[name]
    modules, tests = target.modules, target.tests
    mutants = mutants or target.mutants
    python, extra_env = _python(target)
    work = SCRATCH / name
    _scratch_copy(work)
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n[tool.mutmut]\n"
                f'source_paths = ["kvcanary_cupy"]\n'
                f"only_mutate = {_toml_list(modules)}\n"
                f'also_copy = ["kernels", "setup.py", "README.md"]\n'
                f"pytest_add_cli_args = {_toml_list([*PYTEST, '-k', target.keywords])}\n"
                f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
                "use_git_change_detection = false\n")
    mutmut = [python, "-c", "import sys; from mutmut.__main__ import cli; sys.exit(cli())"]
    # The differential tests' random examples cut to a tenth: each survivor reruns them.
    env = dict(os.environ, KVCANARY_CACHE_DIR=str(SCRATCH / "cache"), HYPOTHESIS_PROFILE="ci",
               KVCANARY_DIFFERENTIAL_SCALE="0.1", **extra_env)
    with open(work / "mutmut.log", "w") as log:  # its progress spinner, kept out of the summary
        rc = subprocess.run([*mutmut, "run", "--max-children", str(max_children), *mutants], cwd=work, env=env,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"mutmut run failed for {name} (exit {rc}): see {work / 'mutmut.log'}")
    out = subprocess.run([*mutmut, "results", "--all", "true"], cwd=work, env=env, check=True,
                         capture_output=True, text=True).stdout
    statuses = dict(re.findall(r"^\s+(\S+): (.+)$", out, flags=re.M))
    if mutants:
        statuses = {k: v for k, v in statuses.items() if v != "not checked"}
    killed = sum(s in ("killed", "timeout") for s in statuses.values())
    survivors = sorted(f"{k}: {s}" for k, s in statuses.items() if s not in ("killed", "timeout"))
    return killed, len(statuses), survivors


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument("--no-kernels", action="store_true", help="skip the planted kernel mutations")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--mutants", nargs="*", default=[],
                        help="only the mutants matching these globs, e.g. '*CanaryRuntime*sweep*' (in place of "
                             "a target's own globs)")
    args = parser.parse_args()
    results: dict[str, tuple[int, int, list[str], float]] = {}
    for name in [t for t in args.targets.split(",") if t]:
        if name not in TARGETS:
            parser.error(f"unknown target {name!r}")
        start = time.perf_counter()
        killed, total, survivors = run_python_target(name, args.max_children, args.mutants)
        results[name] = (killed, total, survivors, time.perf_counter() - start)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
