"""The KV layout presets' refusals that need an unusual cache to reach: a cache whose start in memory is not
16-byte aligned (the message names the K or V part it would read) and a cache of elements no fingerprint
load reads (a 3- or 32-byte element). Every expected message is written out by hand."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.kv_layouts import flash_attn_source, vllm_cpu_source

SHAPE = (2, 1, 4, 16)  # vLLM CPU: [num_blocks, num_kv_heads, block_size, 2 * head_size]


def misaligned_cache(shift: int) -> np.ndarray:
    """A float32 vLLM CPU cache whose first byte sits ``shift`` bytes past a 16-byte boundary."""
    nbytes = int(np.prod(SHAPE)) * 4
    raw = np.zeros(nbytes + 32, np.uint8)
    start = (-raw.ctypes.data) % 16 + shift
    cache = raw[start:start + nbytes].view(np.float32).reshape(SHAPE)
    assert cache.ctypes.data % 16 == shift
    return cache


@pytest.mark.parametrize("shift", [4, 8, 12])
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_vllm_cpu_cache_off_a_16_byte_boundary_is_refused_naming_the_part_it_would_read(which, shift):
    cache = misaligned_cache(shift)
    # the V half of a block starts 4 * 8 float32 = 128 bytes after its K half: the same shift off the boundary
    with pytest.raises(kc.CanaryArgumentError,
                       match=rf"^kv-canary: kv_cache's '{which}' part starts at address 0x[0-9a-f]+, not 16-byte "
                             r"aligned \(the fingerprint loads aligned 16-byte units\)$"):
        vllm_cpu_source(cache, block_size=4, num_kv_heads=1, head_size=8, which=which, read_bytes=16, isa="vec")


@pytest.mark.parametrize("dtype", ["V3", "S3", "V32"])
def test_a_cache_of_elements_no_fingerprint_load_reads_is_refused_by_their_size(dtype):
    size = np.dtype(dtype).itemsize
    message = re.escape(f"kv-canary: kv_cache has {size}-byte elements; a KV layout is read in elements of "
                        "1, 2, 4, 8, 16 bytes")
    with pytest.raises(kc.CanaryArgumentError, match=f"^{message}$"):
        vllm_cpu_source(np.zeros(SHAPE, dtype), block_size=4, num_kv_heads=1, head_size=8, which="k",
                        read_bytes=16, isa="vec")
    with pytest.raises(kc.CanaryArgumentError, match=f"^{message}$"):
        flash_attn_source(np.zeros((2, 1, 16, 16), dtype), which="v", read_bytes=16)
