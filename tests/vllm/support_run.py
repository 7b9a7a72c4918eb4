"""Run one model kind through an in-process vLLM engine without and with the canary and print what happened as
JSON on a line starting with "RESULT " (one engine per process: vLLM keeps process-wide state).

``python support_run.py MODEL_DIR ARCH CONFIG``: ARCH a ``save_arch`` model kind, CONFIG a key of
:data:`CONFIGS` (the engine arguments beyond the model kind's own). For every clean workload: the completions
without the canary, then with it in ``log`` mode (backend numpy, sweep every 2 steps); the canary's warnings,
violations and counters; a ``position-shift`` fault run where the canary checks something; then ``raise`` mode's
install (refused or not, the runner's attributes before and after)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package, not an installed one
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.pop("KVCANARY_VLLM", None)

CONFIGS: dict[str, dict] = {
    "plain": {},
    "bf16": {"dtype": "bfloat16"},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1}},
}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def main() -> None:
    from vllm import LLM

    from kvcanary_cupy.integrations import vllm as kv
    from kvcanary_cupy.integrations.vllm.faults import injector
    from kvcanary_cupy.integrations.vllm.workloads import ENGINE_ARGS, arch_engine_args, save_arch, workloads

    model_dir, arch, config = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    save_arch(model_dir, arch)
    args = {**ENGINE_ARGS, "kv_cache_memory_bytes": 4 << 20, **arch_engine_args(arch), **CONFIGS[config]}
    llm = LLM(model=str(model_dir), **args)
    loads = workloads()
    names = ["mixed-lengths", "shared-prefix", "preemption"]
    want = {}
    for name in names:
        assert llm.reset_prefix_cache()
        want[name] = loads[name].run(llm)

    lines = Lines()
    logger = logging.getLogger("kvcanary_cupy.vllm")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    runner = kv.find_runner(llm)
    canary = kv.install(llm, backend="numpy", sweep_interval=2)
    got = {}
    for name in names:
        assert llm.reset_prefix_cache()
        got[name] = loads[name].run(llm)
    canary.finish()
    support = canary.support
    result = {
        "groups": [[g.spec, g.checked, g.real_kv] for g in support.groups],
        # the CPU attention ISA vLLM gave each group's layers (amx only where the CPU has AMX tiles)
        "isas": [sorted({str(getattr(runner.compilation_config.static_forward_context[n], "isa", None))
                         for n in g.layer_names}) for g in support.groups],
        "disabled": canary.disabled,
        "hooked": "_model_forward" in vars(runner),
        "install_lines": list(lines.lines),
        "exact": {name: got[name] == want[name] for name in names},
        "violations": [[v.step, v.group, list(v.violation.reasons)] for v in canary.violations][:20],
        "steps": canary.steps,
        "write_entries": 0 if canary.state is None else int(canary.state.counters()["write_entries"]),
        "prompt_tokens": sum(len(p) for name in names for p in loads[name].prompts),
        "canary_groups": [] if canary.state is None else list(canary.state.group_names),
        "sweep_interval": None if canary.state is None else int(canary.state.rt.config.sweep_interval),
    }
    canary.remove()

    if canary.disabled is None:  # the part it checks really detects: one token position shifted in the forward
        assert llm.reset_prefix_cache()
        canary = kv.install(llm, backend="numpy")
        fault = injector("position-shift", 2)
        canary.observers.append(fault)
        loads["mixed-lengths"].run(llm)
        canary.finish()
        canary.remove()
        result["fault"] = [fault.fault is not None and fault.fault.step,
                           sorted({r for v in canary.violations for r in v.violation.reasons}),
                           min((v.step for v in canary.violations), default=None)]

    before = set(vars(runner))
    for real_kv_hash in ("partial", "none"):
        try:
            c = kv.install(llm, mode="raise", backend="numpy", real_kv_hash=real_kv_hash)
        except ValueError as exc:
            result[f"raise_{real_kv_hash}"] = str(exc)
        else:
            assert llm.reset_prefix_cache()
            ok = loads["mixed-lengths"].run(llm) == want["mixed-lengths"]
            c.finish()
            result[f"raise_{real_kv_hash}"] = ["installed", ok, len(c.violations), c.steps]
            c.remove()
        result[f"raise_{real_kv_hash}_left_runner_as_it_was"] = set(vars(runner)) == before
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
