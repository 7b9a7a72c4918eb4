"""Run two workloads through a tensor-parallel vLLM engine (``tensor_parallel_size`` workers, multiprocess
executor) and print each workload's completions as JSON on a line starting with "RESULT ". The plugin acts only
through the environment (``KVCANARY_VLLM``, ``KVCANARY_VLLM_FAULT``); each worker's thread binding comes from
``VLLM_CPU_OMP_THREADS_BIND``, which the caller sets.

``python tp_run.py MODEL_DIR TP WORKLOAD [WORKLOAD ...]``"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from kvcanary_cupy.integrations.vllm.workloads import engine, workloads

    model_dir, tp, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    llm = engine(model_dir, tensor_parallel_size=tp)
    loads = workloads()
    print("RESULT " + json.dumps({name: loads[name].run(llm) for name in names}), flush=True)


if __name__ == "__main__":  # vLLM spawns its workers: the module must be importable without side effects
    main()
