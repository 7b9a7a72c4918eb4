"""The KV byte layout descriptor and the engine presets refuse bad input with the exact message naming the
argument, at the exact bounds, and accept the values just inside them; the access kind and the contiguous
layout are pinned field by field. Every expected message and layout is written out by hand."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.kv_bytes import ACCESS_ELEMENTS, contiguous_layout
from kvcanary_cupy.kv_layouts import flash_attn_source, flashinfer_hnd_source, vllm_cpu_source

BASE = dict(page_stride=0, token_stride=0, head_stride=0, element_stride=2, num_heads=1, elements_per_head=8,
            element_bytes=2)


def refused(message: str):
    return pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$")


# --- KvByteLayout -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "message"), [
    ("element_bytes", "2", "KvByteLayout.element_bytes must be an int, got str"),
    ("element_bytes", 3, "KvByteLayout.element_bytes must be one of 1, 2, 4, 8, 16, got 3"),
    ("num_heads", (1 << 31) + 1, "KvByteLayout.num_heads must be <= 2147483648, got 2147483649"),
    ("elements_per_head", (1 << 31) + 1, "KvByteLayout.elements_per_head must be <= 2147483648, got 2147483649"),
    ("page_stride", (1 << 48) + 2, "KvByteLayout.page_stride must be <= 281474976710656, got 281474976710658"),
    ("token_stride", (1 << 48) + 2, "KvByteLayout.token_stride must be <= 281474976710656, got 281474976710658"),
    ("head_stride", (1 << 48) + 2, "KvByteLayout.head_stride must be <= 281474976710656, got 281474976710658"),
    ("element_stride", (1 << 48) + 2,
     "KvByteLayout.element_stride must be <= 281474976710656, got 281474976710658"),
], ids=["element_bytes-str", "element_bytes-3", "num_heads", "elements_per_head", "page_stride", "token_stride",
        "head_stride", "element_stride"])
def test_layout_refuses_each_field_past_its_bound_with_the_exact_message(field, value, message):
    with refused(message):
        kc.KvByteLayout(**{**BASE, field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("num_heads", 1 << 31), ("elements_per_head", 1 << 31), ("page_stride", 1 << 48), ("token_stride", 1 << 48),
    ("head_stride", 1 << 48), ("element_stride", 1 << 48),
])
def test_layout_accepts_each_field_at_its_bound(field, value):
    assert getattr(kc.KvByteLayout(**{**BASE, field: value}), field) == value


def test_a_single_head_token_run_not_a_multiple_of_16_bytes_is_read_element_by_element():
    # one head of 4 two-byte elements (8 bytes), every stride 16-byte aligned: no 128-bit load fits the run
    lay = kc.KvByteLayout(page_stride=64, token_stride=16, head_stride=0, element_stride=2, num_heads=1,
                          elements_per_head=4, element_bytes=2)
    assert lay.access_kind() == ACCESS_ELEMENTS


def test_the_contiguous_layout_is_one_16_byte_element_run_per_token():
    assert contiguous_layout(96, 48) == kc.KvByteLayout(page_stride=96, token_stride=48, head_stride=0,
                                                        element_stride=16, num_heads=1, elements_per_head=3,
                                                        element_bytes=16)


# --- presets ------------------------------------------------------------------------------------------------

def vllm(cache, bs=4, heads=1, d=8, which="k", isa="vec"):
    return vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which, read_bytes=16,
                           isa=isa)


CACHE = np.zeros((2, 1, 4, 16), np.float32)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: vllm(CACHE, isa="neon"), "isa='neon': the vLLM CPU KV layout of that ISA is not implemented (only "
                                      "'vec', 'vec16', 'amx' are); it is refused rather than fingerprinted wrongly"),
    (lambda: vllm(CACHE, bs=4.0), "block_size must be an int, got float"),
    (lambda: vllm(CACHE, bs=0), "block_size must be >= 1, got 0"),
    (lambda: vllm(CACHE, heads=1.0), "num_kv_heads must be an int, got float"),
    (lambda: vllm(CACHE, heads=0), "num_kv_heads must be >= 1, got 0"),
    (lambda: vllm(CACHE, d=8.0), "head_size must be an int, got float"),
    (lambda: vllm(CACHE, d=0), "head_size must be >= 1, got 0"),
    (lambda: vllm("cache"), "kv_cache must be an array (NumPy, CuPy, or any DLPack producer such as a torch "
                            "tensor), got str"),
    (lambda: vllm(CACHE[0]), "kv_cache must be 4-D [num_blocks, num_kv_heads, block_size, 2 * head_size], got "
                             "shape (1, 4, 16)"),
    (lambda: vllm(CACHE[:0]), "kv_cache must not be empty, got shape (0, 1, 4, 16)"),
    (lambda: vllm(CACHE, d=4), "kv_cache must have shape [num_blocks, num_kv_heads=1, block_size=4, 2 * "
                               "head_size=8], got (2, 1, 4, 16)"),
    (lambda: vllm(CACHE[::-1]), "kv_cache has a negative stride (-256, 256, 64, 4); only non-negative strides are "
                                "read in place"),
    (lambda: vllm(np.ndarray((2, 1, 4, 16), np.float32, buffer=bytearray(4096), strides=(1026, 256, 64, 4))),
     "kv_cache has strides (1026, 256, 64, 4) that are not whole elements"),
    # rows of a (block, head) plane padded apart: the plane is not one run
    (lambda: vllm(np.zeros((2, 1, 2, 20), np.float32)[..., :16], bs=2),
     "kv_cache must be contiguous within each (block, head) plane of block_size * 2 * head_size elements, got "
     "strides (40, 40, 20, 1) (in elements)"),
    (lambda: flash_attn_source(np.zeros((2, 1, 16, 16), np.float32), which="K", read_bytes=16),
     "which must be 'k' or 'v', got 'K'"),
    (lambda: flash_attn_source("cache", which="k", read_bytes=16),
     "kv_cache must be an array (NumPy, CuPy, or any DLPack producer such as a torch tensor), got str"),
    (lambda: flash_attn_source(np.zeros((2, 2, 16, 1, 8), np.float32), which="k", read_bytes=16),
     "kv_cache must be 4-D [num_blocks, num_kv_heads, block_size, 2 * head_size], got shape (2, 2, 16, 1, 8)"),
    (lambda: flash_attn_source(np.zeros((2, 2, 16, 16), np.float32)[:, ::-1], which="k", read_bytes=16),
     "kv_cache has a negative stride (2048, -1024, 64, 4); only non-negative strides are read in place"),
    (lambda: flashinfer_hnd_source(np.zeros((2, 1, 16, 16), np.float32), which="", read_bytes=16),
     "which must be 'k' or 'v', got ''"),
    (lambda: flashinfer_hnd_source("cache", which="k", read_bytes=16),
     "kv_cache must be an array (NumPy, CuPy, or any DLPack producer such as a torch tensor), got str"),
    (lambda: flashinfer_hnd_source(np.zeros((2, 16, 16), np.float32), which="k", read_bytes=16),
     "kv_cache must be 4-D [num_blocks, num_kv_heads, block_size, 2 * head_size], got shape (2, 16, 16)"),
    (lambda: flashinfer_hnd_source(np.zeros((2, 2, 16, 16), np.float32)[::-1], which="k", read_bytes=16),
     "kv_cache has a negative stride (-2048, 1024, 64, 4); only non-negative strides are read in place"),
], ids=["isa", "block_size-type", "block_size-0", "heads-type", "heads-0", "head_size-type", "head_size-0",
        "vllm-not-array", "vllm-rank", "vllm-empty", "vllm-shape", "vllm-negative-stride", "vllm-partial-element",
        "vllm-padded-plane", "flash-which", "flash-not-array", "flash-rank", "flash-negative-stride",
        "flashinfer-which", "flashinfer-not-array", "flashinfer-rank", "flashinfer-negative-stride"])
def test_presets_refuse_bad_input_with_the_exact_message(call, message):
    with refused(message):
        call()


def test_vllm_preset_reads_block_size_1_whatever_the_stride_of_its_token_axis():
    # one token per block: axis 2 has length 1, so its stride never addresses anything
    buf = np.zeros(2 * 1 * 16, np.float32)
    cache = np.lib.stride_tricks.as_strided(buf, shape=(2, 1, 1, 16), strides=(64, 64, 0, 4))
    for which, token_stride, element_stride in (("k", 4, 4), ("v", 32, 4)):
        source = vllm(cache, bs=1, which=which)
        assert (source.layout.page_stride, source.layout.token_stride, source.layout.element_stride) == (
            64, token_stride, element_stride)


def test_presets_read_a_cache_broadcast_over_blocks_with_page_stride_0():
    one = np.arange(16 * 2 * 16, dtype=np.float32).reshape(16, 2, 16)  # one block, tokens outside heads
    flash = flash_attn_source(np.broadcast_to(one.transpose(1, 0, 2), (3, 2, 16, 16)), which="v", read_bytes=16)
    assert (flash.layout.page_stride, flash.layout.token_stride, flash.layout.head_stride) == (0, 128, 64)
    hnd = np.broadcast_to(np.ascontiguousarray(one.transpose(1, 0, 2)), (3, 2, 16, 16))  # heads outside tokens
    infer = flashinfer_hnd_source(hnd, which="k", read_bytes=16)
    assert (infer.layout.page_stride, infer.layout.token_stride, infer.layout.head_stride) == (0, 64, 1024)
