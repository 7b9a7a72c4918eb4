"""Run ``kvcanary simulate --engine vllm``'s simulation with the given configuration and print its report as JSON on
a line starting with "RESULT " (one engine per process: vLLM keeps process-wide state).

``python sim_run.py '{"model_arch": "gemma3", "inject": ["wrong-token"], "workloads": ["mixed-lengths"]}'``: the
fields of :class:`~kvcanary_cupy.integrations.vllm.simulate.VllmSimConfig` (lists for its tuples)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package, not an installed one


def main() -> None:
    from kvcanary_cupy.integrations.vllm.simulate import VllmSimConfig, run_quietly

    fields = json.loads(sys.argv[1])
    cfg = VllmSimConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    report = run_quietly(cfg, progress=False)
    print("RESULT " + json.dumps(report, default=str), flush=True)


if __name__ == "__main__":  # vLLM may spawn workers: the module must be importable without side effects
    main()
