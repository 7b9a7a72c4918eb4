"""vLLM 0.32's packed attention caches, every KVCacheLayout, read in place byte-exact on the CPU backends.

The caches are built as vLLM 0.32 builds them (vllm/v1/kv_cache_interface.py ``create_kv_cache_views``): one
int8 buffer shared by a group's layers, strided in logical ``[L, B, H, N, C]`` order by the layout's physical
order, viewed per layer as ``[B, H, N, C]`` in the cache dtype, K the first ``head_size`` elements of C and V
the rest. The expectation is the scalar oracle's fingerprint of each slot's K (or V) bytes gathered by plain
torch indexing (``cache[b, h, n, :head_size]`` for each head), copied into one contiguous row per slot.
"""

from __future__ import annotations

import enum
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from chain_helpers import context, fields, rows, verify, write
from oracle import MODE_ALL, MODE_PARTIAL, real_kv_hash, to_i64
from vllm_caches import LAYOUTS, gathered, vllm_group_caches

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.kv_layouts import (
    flash_attn_source,
    flashinfer_hnd_source,
    vllm_attention_source,
    vllm_mla_source,
)

torch = pytest.importorskip("torch")

CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]


def oracle_hashes(values: np.ndarray, read_bytes: int, mode, slots) -> list[int]:
    """The scalar oracle's fingerprints of ``values[slot]`` (a contiguous row per slot), as stored (signed)."""
    return [to_i64(real_kv_hash(int(s), [(values, 1, values.shape[1], read_bytes)], int(mode))) for s in slots]


def stamped(source, num_slots: int, slots, backend: str, mode) -> list[int]:
    """The fingerprints a write launch over ``source`` stamps into ``slots``."""
    ctx = context(num_slots=num_slots, real_kv_sources=(source,), real_kv_hash_mode=mode)
    write(ctx, [len(slots)], [-1], list(slots), list(range(len(slots))), list(range(len(slots))), backend=backend)
    return [int(v) for v in fields(ctx)[list(slots), 3]]


def _slots(num_slots: int, seed: int) -> list[int]:
    return sorted(np.random.default_rng(seed).choice(num_slots, size=min(num_slots, 24), replace=False).tolist())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_kv_cache_layout_fingerprints_each_layers_k_and_v_byte_exact(layout, dtype, backend):
    """Three layers sharing one buffer (the BL layouts interleave them inside each block): each layer's K and V
    source stamps the oracle's fingerprints of that layer's own bytes, with the layout named and without."""
    heads, bs, d = 2, 16, 16
    caches = vllm_group_caches(layout, layers=3, blocks=3, heads=heads, block_size=bs, head_size=d, head_size_v=d,
                               dtype=dtype, seed=LAYOUTS.index(layout) * 10 + DTYPES.index(dtype))
    num_slots = 3 * bs
    for layer, cache in enumerate(caches):
        assert tuple(cache.shape) == (3, heads, bs, 2 * d)
        for which in ("k", "v"):
            values = gathered(cache, which, d)
            for mode in (MODE_ALL, MODE_PARTIAL):
                slots = _slots(num_slots, layer * 7 + mode)
                want = oracle_hashes(values, values.shape[1], mode, slots)
                named = vllm_attention_source(cache, head_size=d, which=which, read_bytes=values.shape[1],
                                              kv_cache_layout=layout)
                plain = flash_attn_source(cache, which=which, read_bytes=values.shape[1])
                assert named.page_size == bs and named.slots_covered >= num_slots
                assert stamped(named, num_slots, slots, backend, mode) == want, (layer, which, mode)
                assert stamped(plain, num_slots, slots, backend, mode) == want, (layer, which, mode)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC", "BHLNC"])
def test_flashinfer_hnd_layouts_fingerprint_byte_exact_and_nhd_is_refused(layout, backend):
    heads, bs, d = 4, 16, 8
    cache = vllm_group_caches(layout, layers=2, blocks=2, heads=heads, block_size=bs, head_size=d, head_size_v=d,
                              dtype=torch.float16, seed=5)[1]
    slots = list(range(0, 2 * bs, 3))
    for which in ("k", "v"):
        values = gathered(cache, which, d)
        source = flashinfer_hnd_source(cache, which=which, read_bytes=64)
        assert stamped(source, 2 * bs, slots, backend, MODE_ALL) == oracle_hashes(values, 64, MODE_ALL, slots)
    nhd = vllm_group_caches("LBNHC", layers=1, blocks=2, heads=heads, block_size=bs, head_size=d, head_size_v=d,
                            dtype=torch.float16, seed=6)[0]
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache has shape .* which do not store it in "
                                                     r"the order FlashInfer's HND names \(B, H, N, C outermost"):
        flashinfer_hnd_source(nhd, which="k", read_bytes=16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC"])
def test_unequal_k_and_v_head_sizes_fingerprint_byte_exact(layout, backend):
    """head_size_v != head_size (vLLM's ``AttentionSpec.head_size_v``): K is the first head_size elements of
    the content axis and V the rest, of a different length."""
    heads, bs, d, dv = 2, 16, 8, 24
    cache = vllm_group_caches(layout, layers=2, blocks=2, heads=heads, block_size=bs, head_size=d, head_size_v=dv,
                              dtype=torch.float32, seed=7)[0]
    slots = list(range(2 * bs))
    for which, per_token in (("k", heads * d * 4), ("v", heads * dv * 4)):
        values = gathered(cache, which, d)
        assert values.shape[1] == per_token
        source = vllm_attention_source(cache, head_size=d, which=which, read_bytes=per_token, kv_cache_layout=layout)
        assert stamped(source, 2 * bs, slots, backend, MODE_ALL) == oracle_hashes(values, per_token, MODE_ALL, slots)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_padded_pages_and_kernel_block_splitting_fingerprint_byte_exact(backend):
    """A padded block stride (hybrid models' equal pages) is skipped, not hashed; a block split into kernel
    blocks keeps the slot numbering (block * block_size + offset is the same slot either way)."""
    heads, bs, d = 2, 32, 8
    padded = vllm_group_caches("LBNHC", layers=2, blocks=3, heads=heads, block_size=bs, head_size=d, head_size_v=d,
                               dtype=torch.bfloat16, seed=8, block_pad=96)[1]
    assert padded.stride(0) * 2 == bs * heads * 2 * d * 2 + 96
    split = vllm_group_caches("LBNHC", layers=1, blocks=3, heads=heads, block_size=bs, head_size=d, head_size_v=d,
                              dtype=torch.float16, seed=9, ratio=2)[0]
    assert tuple(split.shape) == (6, heads, bs // 2, 2 * d)
    slots = list(range(0, 3 * bs, 2))
    for cache in (padded, split):
        for which in ("k", "v"):
            values = gathered(cache, which, d)
            source = vllm_attention_source(cache, head_size=d, which=which, read_bytes=32, kv_cache_layout="LBNHC")
            assert stamped(source, 3 * bs, slots, backend, MODE_ALL) == oracle_hashes(values, 32, MODE_ALL, slots)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", ["k", "v"])
def test_one_flipped_byte_of_one_layers_k_or_v_is_caught_at_that_slot_only(layout, which, backend):
    """Write, verify clean, flip one byte of (layer 1, one slot, head 1, K or V) in the shared buffer: the verify
    flags that slot of that layer's source, and neither the other part nor the other layers' sources move."""
    heads, bs, d = 2, 16, 8
    caches = vllm_group_caches(layout, layers=3, blocks=2, heads=heads, block_size=bs, head_size=d, head_size_v=d,
                               dtype=torch.float32, seed=11)
    sources = {(layer, part): vllm_attention_source(cache, head_size=d, which=part, read_bytes=64,
                                                    kv_cache_layout=layout)
               for layer, cache in enumerate(caches) for part in ("k", "v")}
    slots, positions = [3, 4, 21, 22], [0, 1, 2, 3]
    contexts = {}
    for key, source in sources.items():
        ctx = context(num_slots=2 * bs, real_kv_sources=(source,), real_kv_hash_mode=MODE_ALL)
        write(ctx, [4], [-1], slots, [10, 11, 12, 13], positions, backend=backend)
        verify(ctx, slots, positions, [-1, 3, 4, 21], backend=backend)
        assert rows(ctx) == []
        contexts[key] = ctx
    b, n = divmod(21, bs)
    element = 3 if which == "k" else d + 3
    caches[1].view(torch.uint8)[b, 1, n, element * 4] ^= 0x10  # the low byte of one fp32 element
    for key, ctx in contexts.items():
        verify(ctx, slots, positions, [-1, 3, 4, 21], backend=backend)
        bad = rows(ctx)
        if key == (1, which):
            assert [(r[1], r[7]) for r in bad] == [(21, kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)], key
        else:
            assert bad == [], key


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_latent_rows_fingerprint_byte_exact(dtype, backend):
    """vLLM's MLA layer cache ``[num_blocks, block_size, 576]`` (the layer's ``[B, 1, N, C]`` view squeezed, as
    ``MLAAttention.bind_kv_cache`` does): one latent row per token is K; there is no V."""
    bs, row = 16, 576
    caches = vllm_group_caches("LBHNC", layers=2, blocks=3, heads=1, block_size=bs, head_size=row, head_size_v=0,
                               dtype=dtype, seed=12 + DTYPES.index(dtype))
    item = caches[0].element_size()
    for cache in (c.squeeze(1) for c in caches):
        assert tuple(cache.shape) == (3, bs, row)
        values = cache.reshape(3 * bs, row).contiguous().view(torch.uint8).numpy()
        slots = _slots(3 * bs, int(item))
        for mode, read in ((MODE_ALL, row * item), (MODE_PARTIAL, 16)):
            source = vllm_mla_source(cache, which="k", read_bytes=read)
            assert source.page_size == bs
            assert stamped(source, 3 * bs, slots, backend, mode) == oracle_hashes(values, read, mode, slots)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: which='v': an MLA cache holds one latent row"):
        vllm_mla_source(caches[0].squeeze(1), which="v", read_bytes=16)


def test_a_layout_whose_strides_disagree_with_the_named_layout_is_refused():
    lbnhc = vllm_group_caches("LBNHC", layers=1, blocks=2, heads=2, block_size=16, head_size=8, head_size_v=8,
                              dtype=torch.float32, seed=13)[0]
    for other in ("LBHNC", "LHBNC", "BHLNC"):
        with pytest.raises(kc.CanaryArgumentError, match=rf"^kv-canary: kv_cache has shape .* the order "
                                                         rf"kv_cache_layout='{other}' names"):
            vllm_attention_source(lbnhc, head_size=8, which="k", read_bytes=16, kv_cache_layout=other)
    for ok in ("LBNHC", "BLNHC"):  # per layer, both store a block's tokens outside its heads
        vllm_attention_source(lbnhc, head_size=8, which="k", read_bytes=16, kv_cache_layout=ok)


LAYOUT_NAMES = "LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC"  # vLLM 0.32's KVCacheLayout members, in its order
PACKED_4D = "[num_blocks, num_kv_heads, block_size, head_size + head_size_v]"


# every refusal's whole message (a prefix match would not see text changed after it); the cache is float32
# [2 blocks, 2 heads, 16 tokens, 16 elements]: 2 heads x 8 elements x 4 bytes = 64 bytes of K per token
@pytest.mark.parametrize(("call", "message"), [
    (lambda c: vllm_attention_source(c, head_size=8, which="k", read_bytes=16, kv_cache_layout="NHD"),
     f"kv_cache_layout must be one of vLLM's KV cache layouts ({LAYOUT_NAMES}), given by name or as a "
     "KVCacheLayout, got 'NHD'"),
    (lambda c: vllm_attention_source(c, head_size=8, which="k", read_bytes=16, kv_cache_layout=3),
     f"kv_cache_layout must be one of vLLM's KV cache layouts ({LAYOUT_NAMES}), given by name or as a "
     "KVCacheLayout, got 3"),
    (lambda c: vllm_attention_source(c, head_size=17, which="k", read_bytes=16),
     "head_size=17 is more than the 16 elements of kv_cache's last axis (head_size + head_size_v)"),
    (lambda c: vllm_attention_source(c, head_size=16, which="v", read_bytes=16),
     "which='v': kv_cache's last axis holds head_size=16 elements of K and no V"),
    (lambda c: vllm_attention_source(c, head_size=0, which="k", read_bytes=16), "head_size must be >= 1, got 0"),
    (lambda c: vllm_attention_source(c, head_size=8, which="kv", read_bytes=16), "which must be 'k' or 'v', got 'kv'"),
    (lambda c: vllm_attention_source(c, head_size=8, which="k", read_bytes=24),
     "read_bytes must be a positive multiple of 16 up to the 64 bytes of K (or V) of one token, got 24"),
    (lambda c: vllm_attention_source(c[0], head_size=8, which="k", read_bytes=16),
     f"kv_cache must be 4-D {PACKED_4D}, got shape (2, 16, 16)"),
    (lambda c: vllm_attention_source(np.zeros((0, 2, 16, 16), np.float32), head_size=8, which="k", read_bytes=16),
     "kv_cache must not be empty, got shape (0, 2, 16, 16)"),
    (lambda c: flash_attn_source(c[..., :15], which="k", read_bytes=16),
     "kv_cache's last axis (15 elements) is not 2 * head_size: K and V are its two halves"),
    (lambda c: flash_attn_source(c[0], which="k", read_bytes=16),
     "kv_cache must be 4-D [num_blocks, num_kv_heads, block_size, 2 * head_size], got shape (2, 16, 16)"),
    (lambda c: flashinfer_hnd_source(c, which="x", read_bytes=16), "which must be 'k' or 'v', got 'x'"),
    (lambda c: vllm_mla_source(c, which="k", read_bytes=16),
     "kv_cache must be 3-D [num_blocks, block_size, latent row], got shape (2, 2, 16, 16)"),
    (lambda c: vllm_mla_source(c[0], which="x", read_bytes=16), "which must be 'k' or 'v', got 'x'"),
    # one latent row of 16 float32 elements: 64 bytes a token, one "head"
    (lambda c: vllm_mla_source(c[0], which="k", read_bytes=128),
     "read_bytes must be a positive multiple of 16 up to the 64 bytes of K (or V) of one token, got 128"),
    (lambda c: vllm_mla_source(np.zeros((0, 16, 16), np.float32), which="k", read_bytes=16),
     "kv_cache must not be empty, got shape (0, 16, 16)"),
], ids=["layout-name", "layout-int", "head-size-over", "v-without-v", "head-size-0", "which-kv", "read-bytes-24",
        "packed-3d", "packed-empty", "flash-odd-axis", "flash-3d", "flashinfer-which", "mla-4d", "mla-which",
        "mla-read-bytes-over", "mla-empty"])
def test_refusals_name_the_callers_argument(call, message):
    cache = torch.zeros((2, 2, 16, 16))
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape(f"kv-canary: {message}") + "$"):
        call(cache)


def test_a_kv_cache_layout_is_taken_by_name_or_as_vllms_enum_member():
    """vLLM passes its ``KVCacheLayout`` member (an Enum): it is read by its name, like the string; a member of
    another name is refused with the member shown."""
    layouts = enum.Enum("KVCacheLayout", ["LBNHC", "LBHNC", "NHD"])
    lbnhc = vllm_group_caches("LBNHC", layers=1, blocks=2, heads=2, block_size=16, head_size=8, head_size_v=8,
                              dtype=torch.float32, seed=14)[0]
    by_name = vllm_attention_source(lbnhc, head_size=8, which="k", read_bytes=16, kv_cache_layout="LBNHC")
    by_member = vllm_attention_source(lbnhc, head_size=8, which="k", read_bytes=16, kv_cache_layout=layouts.LBNHC)
    assert by_member.layout == by_name.layout
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache has shape .* the order "
                                                     r"kv_cache_layout='LBHNC' names"):
        vllm_attention_source(lbnhc, head_size=8, which="k", read_bytes=16, kv_cache_layout=layouts.LBHNC)
    message = (f"kv-canary: kv_cache_layout must be one of vLLM's KV cache layouts ({LAYOUT_NAMES}), given by name "
               "or as a KVCacheLayout, got <KVCacheLayout.NHD: 3>")
    with pytest.raises(kc.CanaryArgumentError, match="^" + re.escape(message) + "$"):
        vllm_attention_source(lbnhc, head_size=8, which="k", read_bytes=16, kv_cache_layout=layouts.NHD)


def test_an_mla_cache_not_starting_on_a_16_byte_boundary_is_refused_naming_its_k_part():
    buffer = torch.zeros(2 * 4 * 16 + 1)
    cache = buffer[1:].reshape(2, 4, 16)  # one float32 past the buffer's (aligned) start
    assert cache.data_ptr() % 16 == 4
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache's 'k' part starts at address 0x[0-9a-f]+, "
                                                     r"not 16-byte aligned \(the fingerprint loads aligned 16-byte "
                                                     r"units\)$"):
        vllm_mla_source(cache, which="k", read_bytes=16)


def test_a_one_head_cache_has_no_head_order_and_is_read_under_every_layout_name():
    """With one KV head the head axis has no place: a cache built in LBNHC order is, byte for byte, the same
    cache in every layout, so every name is accepted and reads it the same way (whatever stride torch gives the
    one-entry axis)."""
    cache = vllm_group_caches("LBNHC", layers=1, blocks=2, heads=1, block_size=16, head_size=8, head_size_v=8,
                              dtype=torch.float32, seed=15)[0]
    plain = vllm_attention_source(cache, head_size=8, which="v", read_bytes=16)
    for name in LAYOUT_NAMES.split(", "):
        named = vllm_attention_source(cache, head_size=8, which="v", read_bytes=16, kv_cache_layout=name)
        assert named.layout == plain.layout, name
    odd = cache.as_strided(cache.shape, (cache.stride(0), 1, cache.stride(2), 1))  # the one head's stride: 1
    for name in LAYOUT_NAMES.split(", "):
        vllm_attention_source(odd, head_size=8, which="k", read_bytes=16, kv_cache_layout=name)


def test_a_cache_storing_each_tokens_elements_apart_is_refused_under_every_layout_name():
    """Tokens innermost (the element axis steps over every token of a block): no KVCacheLayout stores a cache so,
    and each named layout refuses it by its name."""
    blocks, heads, bs, content = 2, 2, 16, 16
    cache = torch.zeros(blocks, heads, content, bs).transpose(2, 3)  # [B, H, N, C], N of stride 1
    assert cache.stride() == (heads * content * bs, content * bs, 1, bs)
    for name in LAYOUT_NAMES.split(", "):
        with pytest.raises(kc.CanaryArgumentError, match=rf"^kv-canary: kv_cache has shape \(2, 2, 16, 16\) and "
                                                         rf"strides \(512, 256, 1, 16\) .* the order "
                                                         rf"kv_cache_layout='{name}' names"):
            vllm_attention_source(cache, head_size=8, which="k", read_bytes=16, kv_cache_layout=name)


def test_host_backend_reads_every_packed_layout_under_address_sanitizer_with_zero_reports():
    """This file's host-backend cases again, the kernels built with AddressSanitizer + UBSan (each report a hard
    error): no layout makes the kernels read outside the caches."""
    reason = unavailable_reason("host")
    if reason is not None:
        pytest.skip(f"host backend: {reason}")
    from kvcanary_cupy.hostcuda import sanitizer_preload

    preload = sanitizer_preload()
    if not Path(preload).is_file():
        pytest.skip(f"g++ has no AddressSanitizer runtime ({preload})")
    env = {**os.environ, "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "KVCANARY_HOST_SANITIZE": "1",
           "PYTHONFAULTHANDLER": "1"}
    tests_dir = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark", str(Path(__file__)),
         "-k", "host and not sanitizer", "--rootdir", str(tests_dir.parent)],
        env=env, cwd=tests_dir.parent, capture_output=True, text=True, timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output, output[-6000:]
    assert " passed" in output and "skipped" not in output, output[-2000:]
