"""Slot layouts through the SGLang-compatible torch layer: the launcher takes torch layouts as they are, and
the torch reference converts their arrays the way it converts every other plan input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from differential import run_plan
from hypothesis import given, settings
from layout_strategies import layout_cases

torch = pytest.importorskip("torch")
sg = pytest.importorskip("kvcanary_cupy.compat.sglang")
from test_compat_sglang import plan_dict, sentinel_plans, tensor  # noqa: E402

import kvcanary_cupy as kc  # noqa: E402


def torch_layout(layout, widen: bool):
    """The layout with torch arrays; ``widen`` makes every array int64 (the reference must narrow them)."""
    def conv(a):
        t = tensor(a)
        return t.to(torch.int64) if widen else t
    if isinstance(layout, kc.BlockTable):
        return dataclasses.replace(layout, block_table=conv(layout.block_table))
    return dataclasses.replace(layout, kv_page_indptr=conv(layout.kv_page_indptr),
                               kv_page_indices=conv(layout.kv_page_indices))


@settings(max_examples=60)
@given(layout_cases(max_bs=6))
def test_compat_launchers_plan_torch_layouts_like_the_core(case):
    want = run_plan("numpy", case)
    kwargs = {k: (tensor(v) if isinstance(v, np.ndarray) else v) for k, v in case.kwargs.items()}
    launchers = ((sg.launch_canary_plan_kernels, False), (sg.launch_canary_plan_kernels_torch_reference, True))
    for launcher, widen in launchers:
        vp, wp = sentinel_plans(case.kwargs["verify_capacity"], case.write_req_capacity)
        kwargs["layout"] = torch_layout(case.kwargs["layout"], widen)
        launcher(verify_plan_out=vp, write_plan_out=wp, **kwargs)
        got = plan_dict(vp, wp)
        for name in want:
            g, w = got[name], want[name]
            if name == "write.verify_offsets":
                g, w = g[: case.bs + 1], w[: case.bs + 1]
            np.testing.assert_array_equal(g, w, err_msg=f"{launcher.__name__}: {name}")
