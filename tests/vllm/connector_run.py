"""One vLLM engine with ``ExampleConnector`` behind the canary connector, in a process of its own (vLLM's KV
transfer group is one per process): the plugin turned on through the environment (``KVCANARY_VLLM=log``,
``KVCANARY_VLLM_CONNECTOR=ExampleConnector``), the prompts of the spec generated greedily, and a line starting
with "RESULT " holding the completions, the canary's ring rows and the connector's findings as JSON.

The spec (JSON, argv[1]): ``model``, ``store`` (the ExampleConnector folder), ``prompts`` (token-id lists),
``max_tokens``, ``batch`` (true: all prompts in one ``generate``), ``engine`` (engine arguments over the tests'
defaults), ``canary`` (false: no canary, no wrapper: the plain connector), ``env`` (more KVCANARY_VLLM_*
variables), ``wrap`` (KVCANARY_VLLM_CONNECTOR; "": unset), ``wrong_blocks`` (prompt indexes whose load the
connector's metadata sends one block over: a load into the wrong block ids), ``policy`` (vLLM's
kv_load_failure_policy), ``route`` (``plugin``, or ``install``: the wrapper named by ``kv_connector_module_path``
and the canary put in by ``install()``)."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    route = spec.get("route", "plugin")
    if route == "install":  # no plugin: the config names the wrapper, install() puts the canary in
        os.environ.pop("KVCANARY_VLLM", None)
    elif spec.get("canary", True):
        os.environ["KVCANARY_VLLM"] = "log"
        os.environ["KVCANARY_VLLM_CONNECTOR"] = spec.get("wrap", "ExampleConnector")
        if not os.environ["KVCANARY_VLLM_CONNECTOR"]:
            del os.environ["KVCANARY_VLLM_CONNECTOR"]
        os.environ.update(spec.get("env", {}))
    else:
        os.environ.pop("KVCANARY_VLLM", None)

    wrong = [tuple(p[:8]) for i, p in enumerate(spec["prompts"]) if i in spec.get("wrong_blocks", [])]
    if wrong:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

        original = ExampleConnector.start_load_kv

        def start_load_kv(self, forward_context, **kwargs):  # the fault: each load lands one block over
            block_size = self._block_size
            for req in self._get_connector_metadata().requests:
                if not req.is_store and tuple(req.token_ids[:8].tolist()) in wrong:
                    blocks = req.slot_mapping // block_size
                    order = list(dict.fromkeys(blocks.tolist()))
                    if len(order) > 1:
                        rotate = {b: order[(i + 1) % len(order)] for i, b in enumerate(order)}
                        req.slot_mapping = req.slot_mapping % block_size + block_size * blocks.apply_(rotate.get)
            return original(self, forward_context, **kwargs)

        ExampleConnector.start_load_kv = start_load_kv

    from vllm import SamplingParams

    from kvcanary_cupy.integrations.vllm.hooks import find_runner
    from kvcanary_cupy.integrations.vllm.workloads import engine

    transfer = {"kv_connector": "ExampleConnector", "kv_role": spec.get("role", "kv_both"),
                "kv_connector_extra_config": {"shared_storage_path": spec["store"]}}
    if route == "install":
        transfer["kv_connector"] = "CanaryConnector"
        transfer["kv_connector_module_path"] = "kvcanary_cupy.integrations.vllm.connector"
        transfer["kv_connector_extra_config"]["kvcanary_wraps"] = "ExampleConnector"
    if spec.get("policy"):
        transfer["kv_load_failure_policy"] = spec["policy"]
    llm = engine(spec["model"], kv_transfer_config=transfer, **spec.get("engine", {}))
    if route == "install":
        from kvcanary_cupy.integrations.vllm import install

        install(llm, real_kv_hash=spec.get("env", {}).get("KVCANARY_VLLM_REAL_KV_HASH", "partial"))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 4), temperature=0.0, ignore_eos=True)
    canary = getattr(find_runner(llm), "_kvcanary", None)
    seen: list[int] = []  # per forward: the connector's findings made before it began

    class Watch:
        def before_forward(self, canary, step, kwargs, metadata):
            seen.append(len(canary.connector.findings) if canary.connector is not None else 0)

        def after_forward(self, canary, step, batch):
            pass

    if canary is not None:
        canary.observers.append(Watch())
    outputs, request_ids = [], []
    batches = [spec["prompts"]] if spec.get("batch") else [[p] for p in spec["prompts"]]
    for batch in batches:  # by default one at a time: each request's load is a step of its own
        out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in out]
        request_ids += [o.request_id for o in out]
    result: dict = {"outputs": outputs, "request_ids": request_ids, "violations": [], "findings": [],
                    "findings_before_forward": seen}
    if canary is not None:
        canary.finish()
        result["violations"] = [{"step": v.step, "tag": v.violation.launch_tag, "slot": v.violation.slot,
                                 "position": v.violation.position, "reasons": list(v.violation.labels)}
                                for v in canary.violations]
        result["steps"] = canary.steps
        connector = canary.connector
        result["connector"] = None if connector is None else type(connector).__name__
        if connector is not None:
            result["findings"] = [f.fields() for f in connector.findings]
            result["saved_files"] = connector.saved_files
            result["restored_tokens"] = connector.restored_tokens
            result["internal_errors"] = connector.internal_errors
        result["unchecked"] = canary.disabled
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
