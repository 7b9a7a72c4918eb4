"""The tiered main job on consecutive seeds: ``kvcanary simulate --tiers host,disk --inject all`` with the default
preset, steps and requests, per seed and backend, must pass (no false positive, every requested kind injected
and detected) with every tier fault kind injected. Too long for ``make test`` (about 6 to 15 s a run on one core
of the reference machine); ``tests/test_sim_tiers_seeds.py`` runs the small version.

Usage: ``python bench/tiered_seeds.py [--seeds 20] [--first 0] [--backends numpy,host]``; prints one line per run
and the total time, exits 1 if any run fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.sim.config import SimConfig, applicable_kinds
from kvcanary_cupy.sim.faults import TIER_FAULT_KINDS, parse_inject
from kvcanary_cupy.sim.runner import Simulation

TIERS = ("host", "disk")


def run_one(seed: int, backend: str, preset: str) -> tuple[bool, str]:
    """One main job; (passed, its line)."""
    inject = parse_inject(["all"], applicable_kinds(preset, TIERS))
    with tempfile.TemporaryDirectory(prefix="kvcanary-seeds-") as tier_dir:
        start = time.perf_counter()
        report = Simulation(SimConfig(preset=preset, seed=seed, backend=backend, tiers=TIERS, inject=inject,
                                      tier_dir=tier_dir)).run()
        took = time.perf_counter() - start
    kinds = {k["kind"]: k for k in report["kinds"]}
    missing = [k for k in TIER_FAULT_KINDS if kinds.get(k, {}).get("injected", 0) == 0]
    t = report["tiers"]
    ok = report["outcome"] == "passed" and report["violations"]["false_positives"] == 0 and not missing
    line = (f"seed {seed:3d} {backend:5s} {report['outcome']:12s} false positives "
            f"{report['violations']['false_positives']:5d}  load-backs L2 {t['l2_hits']:2d} L3 {t['l3_hits']:2d}  "
            f"tier kinds not injected {missing or 'none'}  {took:6.1f} s")
    return ok, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--backends", default="numpy,host")
    parser.add_argument("--preset", default="mixed")
    args = parser.parse_args(argv)
    failed = 0
    start = time.perf_counter()
    for backend in args.backends.split(","):
        reason = unavailable_reason(backend)
        if reason is not None:
            print(f"backend {backend} skipped: {reason}")
            continue
        for seed in range(args.first, args.first + args.seeds):
            ok, line = run_one(seed, backend, args.preset)
            failed += not ok
            print(line, flush=True)
    print(f"{failed} failed; {time.perf_counter() - start:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
