"""Run one workload through vLLM in its default multiprocess mode (engine core and worker in processes
of their own); print the completions as JSON on a line starting with "RESULT ". The plugin acts only
through the environment."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from kvcanary_cupy.integrations.vllm.workloads import engine, workloads

    model_dir, name = sys.argv[1], sys.argv[2]
    llm = engine(model_dir)
    print("RESULT " + json.dumps(workloads()[name].run(llm)), flush=True)


if __name__ == "__main__":
    main()
