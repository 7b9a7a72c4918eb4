"""The transformers integration on a CUDA model: token-exact and clean, and a bit flip in the real cache caught
(the CPU suite's tests/test_transformers_integration.py, on the GPU; skipped with a reason without one)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvcanary_cupy.integrations.transformers import install  # noqa: E402
from kvcanary_cupy.integrations.transformers.faults import make_injector  # noqa: E402
from kvcanary_cupy.integrations.transformers.workloads import (  # noqa: E402
    build_model,
    cb_config,
    generation_config,
    workloads,
)

pytestmark = pytest.mark.gpu

# No CUDA graphs, no async batching, no decode fast path: the modes the integration refuses or cannot watch.
GPU_CB = dict(use_cuda_graph=False, use_async_batching=False, max_blocks_per_request=0, auto_switch_to_flash=False)


def _run(model, w, injector=None):
    canary = install(model)
    if injector is not None:
        canary.observers.append(injector)
    out = model.generate_batch(inputs=[list(p) for p in w.prompts], generation_config=generation_config(
        w.max_new_tokens), continuous_batching_config=cb_config(**w.cb, **GPU_CB), progress_bar=False)
    canary.finish()
    canary.remove()
    return {rid: list(r.generated_tokens) for rid, r in out.items()}, canary


@pytest.mark.parametrize("name", ["shared-prefix", "sliding-window"])
def test_cuda_generation_is_token_exact_and_clean(name):
    w = workloads()[name]
    model = build_model(w.arch).to("cuda")
    reference = {rid: list(r.generated_tokens) for rid, r in model.generate_batch(
        inputs=[list(p) for p in w.prompts], generation_config=generation_config(w.max_new_tokens),
        continuous_batching_config=cb_config(**w.cb, **GPU_CB), progress_bar=False).items()}
    tokens, canary = _run(model, w)
    assert tokens == reference
    assert canary.steps > 0 and canary.violations == []
    (state,) = canary.states.values()
    assert state.rt.space.device.kind == "cuda" and state.health_problems == []


def test_cuda_bitflip_in_the_real_cache_is_detected():
    w = workloads()["mixed-lengths"]
    model = build_model(w.arch).to("cuda")
    injector = make_injector("kv-bitflip", at=4, seed=3)
    _, canary = _run(model, w, injector)
    fault = injector.fault
    assert fault is not None
    after = [v for v in canary.violations if v.step >= fault.step]
    assert [v for v in canary.violations if v.step < fault.step] == []
    assert after and "VERIFY_REAL_KV_HASH_MISMATCH" in after[0].violation.reasons
