"""transformers' continuous batching CPU offload (``cpu_offload_space``) on CPU-only torch: pinned.

Its swap pool is allocated with ``torch.empty(..., pin_memory=True)`` (``OffloadingManager.__init__``), which
CPU-only torch refuses, during the manager's warm-up, before any request runs. So the offload/restore path
cannot be exercised here; this test notices the day it can (then the tier calls of kvcanary_cupy.tiers go around
``_offload_to_cpu`` / ``restore_scheduled_requests``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory exists with CUDA: the offload path can run")
def test_cpu_offload_space_is_refused_on_cpu_only_torch_for_its_pinned_swap_pool():
    from kvcanary_cupy.integrations.transformers.workloads import build_model, workloads

    workload = workloads()["queueing"]
    with pytest.raises(RuntimeError, match="pin_memory=True requires a CUDA or other accelerator backend") as info:
        workload.run(build_model("llama"), cpu_offload_space=0.01)
    frames = [(str(f.path).rsplit("/", 1)[-1], f.name) for f in info.traceback]
    assert ("offloading_manager.py", "__init__") in frames  # the swap pool's allocation, not a request
