"""vLLM 0.32's attention KV caches built as vLLM builds them, for the layout tests (CPU and GPU).

``vllm_group_caches`` follows vllm/v1/kv_cache_interface.py (``compute_layout_strides`` and
``create_kv_cache_views``) written out from the source, without importing vLLM; ``gathered`` reads each slot's
K or V by plain torch indexing: the independent expectation the sources are compared with.
"""

from __future__ import annotations

import numpy as np
import torch

# vLLM's six layouts, named by the physical order (outermost first) of the logical axes L, B, H, N, C.
LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def vllm_group_caches(layout: str, *, layers: int, blocks: int, heads: int, block_size: int, head_size: int,
                      head_size_v: int, dtype, seed: int, block_pad: int = 0, ratio: int = 1,
                      device: str = "cpu") -> list:
    """The per-layer caches of one KV cache group, allocated as vLLM 0.32 does, filled with random bytes.

    Strides are assigned innermost axis first in the layout's physical order (``compute_layout_strides``), in
    bytes; ``block_pad`` bytes of padding follow each page of the layer-outermost LB layouts (a padded
    ``block_stride``), and ``ratio`` > 1 splits each block into ``ratio`` kernel blocks the way
    ``create_kv_cache_views`` does (block stride divided, block count multiplied)."""
    item = torch.empty((), dtype=dtype).element_size()
    content = (head_size + head_size_v) * item
    shape = {"L": layers, "B": blocks, "H": heads, "N": block_size, "C": content}
    strides: dict[str, int] = {}
    step = 1
    for axis in reversed(layout):
        if axis == "B" and layout.startswith("LB") and block_pad:
            step += block_pad
        strides[axis] = step
        step *= shape[axis]
    raw = torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, size=step + 64, dtype=np.int8)).to(device)
    offset = (-raw.data_ptr()) % 16  # vLLM's allocation is page aligned; so is this view's start
    size, stride = [shape[a] for a in "LBHNC"], [strides[a] for a in "LBHNC"]
    if ratio > 1:
        assert block_size % ratio == 0 and strides["B"] == heads * block_size * content
        size[1], size[3], stride[1] = blocks * ratio, block_size // ratio, strides["B"] // ratio
    view = torch.as_strided(raw, size=size, stride=stride, storage_offset=offset)
    return [view[layer].view(dtype) for layer in range(layers)]


def gathered(cache, which: str, head_size: int) -> np.ndarray:
    """uint8 ``[slots, bytes]``: each slot's K (or V), its heads in order, gathered by torch indexing."""
    blocks, heads, bs, _ = cache.shape
    part = cache[..., :head_size] if which == "k" else cache[..., head_size:]
    out = []
    for slot in range(blocks * bs):
        b, n = divmod(slot, bs)
        out.append(b"".join(part[b, h, n].contiguous().view(torch.uint8).cpu().numpy().tobytes() for h in range(heads)))
    return np.frombuffer(b"".join(out), np.uint8).reshape(blocks * bs, -1)
