"""Real-KV fingerprints over strided KV layouts (KvByteLayout) and the vLLM presets, on every CPU backend.

Expectations come from two independent places: the scalar oracle's StridedSource (byte-by-byte walk of
the layout's definition) and the fingerprint of the same K/V values laid out contiguously (the source
without a layout, whose hash is pinned by published vectors elsewhere).
"""

from __future__ import annotations

import numpy as np
import pytest
from chain_helpers import context, fields, rows, verify, verify_plan, write, write_plan
from oracle import MODE_ALL, MODE_PARTIAL, StridedSource, real_kv_hash, to_i64

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.hashing import fold_real_kv
from kvcanary_cupy.kv_layouts import (
    ACCESS_ELEMENTS,
    ACCESS_HEAD_RUNS,
    ACCESS_TOKEN_RUN,
    UNBOUNDED_SLOTS,
    flash_attn_source,
    flashinfer_hnd_source,
    vllm_attention_source,
    vllm_cpu_source,
    vllm_mla_source,
)

CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]
MODES = [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL]


def layout(**kw) -> kc.KvByteLayout:
    base = dict(page_stride=0, token_stride=0, head_stride=0, element_stride=2, num_heads=1, elements_per_head=8,
                element_bytes=2)
    base.update(kw)
    return kc.KvByteLayout(**base)


def oracle_source(source: kc.RealKvSource) -> StridedSource:
    """The oracle's view of a layout source: the tensor's bytes from its first, and the layout's numbers."""
    lay = source.layout
    return StridedSource(bytes(np.asarray(source.byte_rows).reshape(-1).tobytes()), source.page_size,
                         lay.page_stride, lay.token_stride, lay.head_stride, lay.element_stride, lay.num_heads,
                         lay.elements_per_head, lay.element_bytes, source.read_bytes)


def fingerprints(sources, slots, mode) -> list[int]:
    """The vectorized reference's fingerprints (as the backends read sources: through ``view()``)."""
    return fold_real_kv(np.asarray(slots, np.int64), [s.view() for s in sources], int(mode)).tolist()


def random_layout_source(rng: np.random.Generator) -> tuple[kc.RealKvSource, int]:
    """A source over random bytes with a random (possibly overlapping, interleaved) layout; its coverage."""
    eb = int(rng.choice([1, 2, 4, 8, 16]))
    heads = int(rng.integers(1, 4))
    per_head = int(rng.integers(1, 6))
    while (heads * per_head * eb) % 16:
        per_head += 1
    strides = [int(rng.integers(0, 9)) * eb for _ in range(4)]
    lay = kc.KvByteLayout(page_stride=strides[0], token_stride=strides[1], head_stride=strides[2],
                          element_stride=strides[3], num_heads=heads, elements_per_head=per_head, element_bytes=eb)
    per_token = lay.bytes_per_token
    # at least one token's stream long (a source refuses a stream longer than its tensor), overlaps included
    extent = max(int(lay.last_byte_in_token()) + 1, per_token)
    data = rng.integers(0, 256, size=extent + int(rng.integers(0, 400)), dtype=np.uint8)
    read = 16 * int(rng.integers(1, per_token // 16 + 1))
    source = kc.RealKvSource(data, page_size=int(rng.integers(1, 5)), num_bytes_per_token=per_token, read_bytes=read,
                             layout=lay)
    return source, source.slots_covered


# --- the descriptor ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "words"), [
    ("element_bytes", 3, "KvByteLayout.element_bytes must be one of"),
    ("element_bytes", 32, "KvByteLayout.element_bytes must be one of"),
    ("num_heads", 0, "KvByteLayout.num_heads must be >= 1"),
    ("elements_per_head", 0, "KvByteLayout.elements_per_head must be >= 1"),
    ("page_stride", -2, "KvByteLayout.page_stride must be >= 0"),
    ("token_stride", 3, "KvByteLayout.token_stride must be a multiple of element_bytes=2"),
    ("head_stride", 1.0, "KvByteLayout.head_stride must be an int"),
    ("element_stride", 5, "KvByteLayout.element_stride must be a multiple of element_bytes=2"),
])
def test_layout_fields_are_validated_by_name(field, value, words):
    with pytest.raises(kc.CanaryArgumentError, match="^kv-canary: " + words):
        layout(**{field: value})


def test_source_refuses_a_layout_whose_length_differs_from_num_bytes_per_token():
    with pytest.raises(kc.CanaryArgumentError, match="num_bytes_per_token must equal the layout's"):
        kc.RealKvSource(np.zeros(256, np.uint8), page_size=1, num_bytes_per_token=32, read_bytes=16,
                        layout=layout(elements_per_head=8))


def test_source_refuses_a_layout_reaching_past_the_tensor_for_slot_0():
    with pytest.raises(kc.CanaryArgumentError, match=r"RealKvSource\.layout addresses bytes beyond"):
        kc.RealKvSource(np.zeros(64, np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16,
                        layout=layout(element_stride=16))  # last element at 7 * 16 = 112 > 63


def test_source_refuses_a_layout_that_is_not_a_kv_byte_layout():
    with pytest.raises(kc.CanaryArgumentError, match=r"RealKvSource\.layout must be a KvByteLayout"):
        kc.RealKvSource(np.zeros(64, np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16,
                        layout={"page_stride": 16})


def test_source_with_a_layout_refuses_a_misaligned_tensor():
    buf = np.zeros(80, np.uint8)
    with pytest.raises(kc.CanaryArgumentError, match="16-byte aligned"):
        kc.RealKvSource(buf[1:65], page_size=1, num_bytes_per_token=16, read_bytes=16, layout=layout())


def test_launch_refuses_a_layout_covering_fewer_slots_than_the_canary_buffer():
    data = np.zeros(64 * 16 - 1, np.uint8)  # 63 whole tokens of 16 bytes, and 15 bytes of a 64th
    source = kc.RealKvSource(data, page_size=1, num_bytes_per_token=16, read_bytes=16,
                             layout=layout(page_stride=16))
    assert source.slots_covered == 63
    ctx = context(num_slots=64, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    before = ctx.canary_buf.copy()
    with pytest.raises(kc.CanaryArgumentError, match=r"real_kv_sources\[0\] covers 63 slots"):
        write(ctx, [1], [-1], [0], [5], [0])
    assert np.array_equal(ctx.canary_buf, before)


def test_slots_covered_matches_a_slot_by_slot_count():
    rng = np.random.default_rng(7)
    for _ in range(300):
        lay = kc.KvByteLayout(page_stride=int(rng.integers(0, 6)) * 4, token_stride=int(rng.integers(0, 6)) * 4,
                              head_stride=int(rng.integers(0, 6)) * 4, element_stride=int(rng.integers(0, 6)) * 4,
                              num_heads=int(rng.integers(1, 3)), elements_per_head=int(rng.integers(1, 3)),
                              element_bytes=4)
        page_size, span = int(rng.integers(1, 5)), int(rng.integers(1, 120))

        def fits(s, lay=lay, page_size=page_size, span=span):
            start = (s // page_size) * lay.page_stride + (s % page_size) * lay.token_stride
            return start + lay.last_byte_in_token() < span

        got = lay.slots_covered(page_size, span)
        if got == UNBOUNDED_SLOTS:
            assert lay.page_stride == 0 and all(fits(s) for s in range(4 * page_size))
        else:
            assert all(fits(s) for s in range(got)) and not fits(got)


def test_access_kind_picks_the_widest_loads_the_alignment_allows():
    assert layout(num_heads=2, head_stride=16, page_stride=64, token_stride=32).access_kind() == ACCESS_TOKEN_RUN
    assert layout(num_heads=2, head_stride=48, page_stride=64, token_stride=16).access_kind() == ACCESS_HEAD_RUNS
    assert layout(num_heads=2, head_stride=40, token_stride=16).access_kind() == ACCESS_ELEMENTS
    assert layout(element_stride=4).access_kind() == ACCESS_ELEMENTS
    assert layout(token_stride=2).access_kind() == ACCESS_ELEMENTS


# --- the reference against the oracle ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_reference_matches_the_oracle_on_random_layouts(mode):
    rng = np.random.default_rng(1234 + int(mode))
    for _ in range(60):
        sources = [random_layout_source(rng) for _ in range(int(rng.integers(1, 3)))]
        covered = min(min(c for _, c in sources), 40)
        if covered == 0:
            continue
        slots = rng.integers(0, covered, size=12)
        srcs = [s for s, _ in sources]
        want = [real_kv_hash(int(s), [oracle_source(x) for x in srcs], int(mode)) for s in slots]
        assert fingerprints(srcs, slots, mode) == want


def test_layout_of_the_contiguous_case_hashes_like_the_source_without_one():
    rng = np.random.default_rng(3)
    pool = rng.integers(0, 256, size=(6, 256), dtype=np.uint8)  # 6 pages, 128 used bytes of 256 per row
    rows_view = pool[:, :128]
    plain = kc.RealKvSource(rows_view, page_size=4, num_bytes_per_token=32, read_bytes=32)
    slots = np.arange(24)
    for eb in (1, 2, 4, 8, 16):
        lay = kc.KvByteLayout(page_stride=256, token_stride=32, head_stride=16, element_stride=eb, num_heads=2,
                              elements_per_head=16 // eb, element_bytes=eb)
        strided = kc.RealKvSource(rows_view, page_size=4, num_bytes_per_token=32, read_bytes=32, layout=lay)
        for mode in MODES:
            assert fingerprints([strided], slots, mode) == fingerprints([plain], slots, mode)


# --- the vLLM presets -------------------------------------------------------------------------------------

def per_token_kv(num_slots: int, heads: int, d: int, dtype, seed: int) -> np.ndarray:
    """Known K (or V) values: ``[slot, head, d]``, distinct per slot."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_slots, heads, d)).astype(dtype)


def contiguous_fingerprints(values: np.ndarray, read_bytes: int, mode, slots) -> list[int]:
    """Fingerprints of ``values[slot]`` laid out as one contiguous row per slot (the independent expectation)."""
    flat = np.ascontiguousarray(values.reshape(values.shape[0], -1))
    source = kc.RealKvSource(flat, page_size=1, num_bytes_per_token=flat.nbytes // flat.shape[0],
                             read_bytes=read_bytes)
    return fingerprints([source], slots, mode)


def vllm_cpu_cache(k: np.ndarray, v: np.ndarray, block_size: int) -> np.ndarray:
    """vLLM's CPU "vec" cache ``[blocks, heads, block_size, 2 * D]`` built from per-slot K/V, element by element."""
    slots, heads, d = k.shape
    blocks = slots // block_size
    cache = np.zeros((blocks, heads, block_size * 2 * d), k.dtype)
    for s in range(slots):
        b, t = divmod(s, block_size)
        for h in range(heads):
            for e in range(d):
                cache[b, h, e * block_size + t] = k[s, h, e]  # K column-major [D, block_size]
                cache[b, h, block_size * d + t * d + e] = v[s, h, e]  # V row-major [block_size, D]
    return cache.reshape(blocks, heads, block_size, 2 * d)


@pytest.mark.parametrize(("dtype", "bs"), [(np.float32, 32), (np.float16, 32), (np.float32, 3)])
@pytest.mark.parametrize("mode", MODES)
def test_vllm_cpu_preset_hashes_like_contiguous_kv(dtype, bs, mode):
    heads, d = 2, 16
    k, v = per_token_kv(3 * bs, heads, d, dtype, 1), per_token_kv(3 * bs, heads, d, dtype, 2)
    cache = vllm_cpu_cache(k, v, bs)
    slots = np.arange(3 * bs)
    read = heads * d * np.dtype(dtype).itemsize
    for which, values in (("k", k), ("v", v)):
        source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                                 read_bytes=read, isa="vec")
        assert source.page_size == bs and source.slots_covered == 3 * bs
        assert fingerprints([source], slots, mode) == contiguous_fingerprints(values, read, mode, slots)


def test_vllm_cpu_preset_reads_a_torch_cache_in_place():
    torch = pytest.importorskip("torch")
    bs, heads, d = 32, 2, 8
    k = per_token_kv(2 * bs, heads, d, np.float32, 3)
    v = per_token_kv(2 * bs, heads, d, np.float32, 4)
    cache = torch.from_numpy(vllm_cpu_cache(k, v, bs)).to(torch.bfloat16)
    k16 = cache.reshape(2, heads, 2, d, bs)[:, :, 0].permute(0, 3, 1, 2).reshape(2 * bs, heads, d)
    source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which="k", read_bytes=32,
                             isa="vec")
    slots = np.arange(2 * bs)
    want = contiguous_fingerprints(k16.contiguous().view(torch.int16).numpy(), 32, MODE_ALL, slots)
    assert fingerprints([source], slots, MODE_ALL) == want
    cache[1, 0, 0, 5] += 1  # K element 0 of head 0 for token 5 of block 1 (column-major: plane index 0 * bs + 5)
    after = fingerprints([source], slots, MODE_ALL)
    assert [i for i in range(2 * bs) if after[i] != want[i]] == [bs + 5]


@pytest.mark.parametrize("isa", ["neon", "vsx", ""])
def test_vllm_cpu_preset_refuses_an_isa_whose_layout_is_not_implemented(isa):
    cache = np.zeros((2, 1, 32, 32), np.float32)
    with pytest.raises(kc.CanaryArgumentError, match=f"isa={isa!r}: the vLLM CPU KV layout of that ISA is not "
                                                     "implemented"):
        vllm_cpu_source(cache, block_size=32, num_kv_heads=1, head_size=16, which="k", read_bytes=16, isa=isa)


def test_vllm_cpu_preset_checks_the_shape_and_which():
    cache = np.zeros((2, 1, 32, 32), np.float32)
    with pytest.raises(kc.CanaryArgumentError, match="kv_cache must have shape"):
        vllm_cpu_source(cache, block_size=32, num_kv_heads=2, head_size=16, which="k", read_bytes=16, isa="vec")
    with pytest.raises(kc.CanaryArgumentError, match="which must be 'k' or 'v'"):
        vllm_cpu_source(cache, block_size=32, num_kv_heads=1, head_size=16, which="kv", read_bytes=16, isa="vec")
    with pytest.raises(kc.CanaryArgumentError, match="must be 4-D"):
        vllm_cpu_source(cache[0], block_size=32, num_kv_heads=1, head_size=16, which="v", read_bytes=16, isa="vec")


def packed_cache(k: np.ndarray, v: np.ndarray, block_size: int, order: str) -> np.ndarray:
    """vLLM 0.32's packed attention cache ``[blocks, heads, block_size, 2 * D]`` (K then V in the last axis) from
    per-slot K/V, stored with a block's tokens outside its heads (``order="NH"``, LBNHC) or inside (``"HN"``,
    LBHNC), element by element."""
    slots, heads, d = k.shape
    blocks = slots // block_size
    storage = np.zeros((blocks, block_size, heads, 2 * d) if order == "NH" else (blocks, heads, block_size, 2 * d),
                       k.dtype)
    for s in range(slots):
        b, t = divmod(s, block_size)
        for h in range(heads):
            at = (b, t, h) if order == "NH" else (b, h, t)
            storage[at][:d] = k[s, h]
            storage[at][d:] = v[s, h]
    return storage.transpose(0, 2, 1, 3) if order == "NH" else storage


@pytest.mark.parametrize("mode", MODES)
def test_flash_attn_preset_hashes_like_contiguous_kv(mode):
    blocks, bs, heads, d = 3, 16, 4, 8
    k, v = per_token_kv(blocks * bs, heads, d, np.float16, 5), per_token_kv(blocks * bs, heads, d, np.float16, 6)
    cache = packed_cache(k, v, bs, "NH")
    slots = np.arange(blocks * bs)
    for which, values in (("k", k), ("v", v)):
        source = flash_attn_source(cache, which=which, read_bytes=64)
        assert source.layout.access_kind() == ACCESS_HEAD_RUNS
        assert fingerprints([source], slots, mode) == contiguous_fingerprints(values, 64, mode, slots)


def test_flash_attn_preset_follows_a_heads_outside_tokens_allocation():
    # The same logical [blocks, heads, bs, 2d] cache stored heads outside tokens (LBHNC): the preset reads its
    # strides.
    blocks, bs, heads, d = 2, 16, 2, 8
    k, v = per_token_kv(blocks * bs, heads, d, np.float32, 7), per_token_kv(blocks * bs, heads, d, np.float32, 8)
    cache = packed_cache(k, v, bs, "HN")
    slots = np.arange(blocks * bs)
    source = flash_attn_source(cache, which="v", read_bytes=64)
    assert fingerprints([source], slots, MODE_ALL) == contiguous_fingerprints(v, 64, MODE_ALL, slots)


@pytest.mark.parametrize("mode", MODES)
def test_flashinfer_hnd_preset_hashes_like_contiguous_kv(mode):
    blocks, bs, heads, d = 3, 16, 2, 8
    k, v = per_token_kv(blocks * bs, heads, d, np.float32, 9), per_token_kv(blocks * bs, heads, d, np.float32, 10)
    cache = packed_cache(k, v, bs, "HN")
    slots = np.arange(blocks * bs)
    for which, values in (("k", k), ("v", v)):
        source = flashinfer_hnd_source(cache, which=which, read_bytes=64)
        assert source.layout.access_kind() == ACCESS_HEAD_RUNS
        assert fingerprints([source], slots, mode) == contiguous_fingerprints(values, 64, mode, slots)


def test_presets_refuse_the_wrong_rank_or_an_odd_content_axis():
    with pytest.raises(kc.CanaryArgumentError, match=r"kv_cache's last axis \(15 elements\) is not 2 \* head_size"):
        flash_attn_source(np.zeros((3, 2, 16, 15), np.float32), which="k", read_bytes=16)
    with pytest.raises(kc.CanaryArgumentError, match="must be 4-D"):
        flashinfer_hnd_source(np.zeros((2, 3, 2, 16, 8), np.float32), which="k", read_bytes=16)
    with pytest.raises(kc.CanaryArgumentError, match="must be 4-D"):
        flash_attn_source(np.zeros((2, 2, 16, 8, 1), np.float32), which="k", read_bytes=16)


def _padded_last_axis(bs: int, heads: int, d: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """A vLLM CPU cache viewed out of a buffer whose last axis is ``pad`` elements longer: each (block, head)
    plane's rows are ``2 * d + pad`` apart, so the plane is not one run. Returns (the view, the buffer)."""
    buf = np.zeros((2, heads, bs, 2 * d + pad), np.float32)
    return buf[..., : 2 * d], buf


@pytest.mark.parametrize("bs", [2, 3, 32])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("pad", [1, 4, 16])
def test_vllm_cpu_preset_refuses_planes_that_are_not_contiguous(bs, which, pad):
    """K column-major and V row-major are read as one run per (block, head) plane; a slice of a padded last axis
    breaks the run (the layout would hash padding as K or V): refused by the cache's name."""
    view, buf = _padded_last_axis(bs, 2, 8, pad)
    caches = [view]
    torch = pytest.importorskip("torch") if bs == 32 else None
    if torch is not None:
        caches.append(torch.zeros(buf.shape)[..., :16])
    for cache in caches:
        with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache must be contiguous within each "
                                                         r"\(block, head\) plane"):
            vllm_cpu_source(cache, block_size=bs, num_kv_heads=2, head_size=8, which=which, read_bytes=16,
                            isa="vec")


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_vllm_cpu_preset_reads_a_cache_padded_between_planes_like_contiguous_kv(axis):
    """Padding between blocks, between heads, or after a block's tokens (planes still one run each) is read in
    place: the fingerprints equal those of the same K/V laid out contiguously."""
    bs, heads, d = 4, 2, 8
    k, v = per_token_kv(2 * bs, heads, d, np.float32, 21), per_token_kv(2 * bs, heads, d, np.float32, 22)
    cache = vllm_cpu_cache(k, v, bs)  # [2, heads, bs, 2d]
    shape = list(cache.shape)
    shape[axis] += 1
    padded = np.full(shape, np.float32(7.5))
    view = padded[tuple(slice(0, n) for n in cache.shape)]
    view[...] = cache
    slots = np.arange(2 * bs)
    for which, values in (("k", k), ("v", v)):
        source = vllm_cpu_source(view, block_size=bs, num_kv_heads=heads, head_size=d, which=which, read_bytes=64,
                                 isa="vec")
        assert fingerprints([source], slots, MODE_ALL) == contiguous_fingerprints(values, 64, MODE_ALL, slots)


def _preset_cases():
    """(label, preset call, words): each cause of a preset refusal, which must name the caller's argument."""
    cpu = dict(block_size=32, num_kv_heads=2, head_size=8, isa="vec")
    raw = np.zeros(2 * 2 * 32 * 2 * 8 * 4 + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + 4  # 4 bytes past a 16-byte boundary
    misaligned = raw[start : start + 2 * 2 * 32 * 2 * 8 * 4].view(np.float32).reshape(2, 2, 32, 16)
    yield "read_bytes not whole units", lambda: flash_attn_source(np.zeros((2, 2, 32, 16), np.float32),
                                                                   which="k", read_bytes=24), "read_bytes must be"
    yield "read_bytes past a token", lambda: flashinfer_hnd_source(np.zeros((2, 2, 32, 16), np.float32),
                                                                    which="v", read_bytes=128), "read_bytes must be"
    yield "read_bytes a str", lambda: vllm_cpu_source(np.zeros((2, 2, 32, 16), np.float32), which="k",
                                                      read_bytes="16", **cpu), "read_bytes must be an int"
    yield "read_bytes 0", lambda: vllm_cpu_source(np.zeros((2, 2, 32, 16), np.float32), which="v", read_bytes=0,
                                                  **cpu), "read_bytes must be"
    yield "token not whole units", lambda: flash_attn_source(np.zeros((2, 1, 4, 4), np.float16), which="k",
                                                             read_bytes=16), "kv_cache holds 4 bytes"
    yield "cpu token not whole units", lambda: vllm_cpu_source(np.zeros((2, 1, 32, 4), np.float16), block_size=32,
                                                               num_kv_heads=1, head_size=2, which="k", read_bytes=16,
                                                               isa="vec"), "kv_cache holds 4 bytes"
    yield "misaligned", lambda: flash_attn_source(misaligned, which="k", read_bytes=16), "kv_cache's 'k' part starts"
    yield "broadcast heads", lambda: flash_attn_source(np.broadcast_to(np.zeros((1, 1, 1, 16), np.float32),
                                                                       (2, 2, 4, 16)), which="k", read_bytes=16), \
        "kv_cache's 'k' part, by its strides, reads 64 bytes per token"
    torch = pytest.importorskip("torch")
    dense = torch.zeros((2, 2, 4, 16))
    yield "torch sparse", lambda: flash_attn_source(dense.to_sparse(), which="k", read_bytes=16), "kv_cache"
    yield "torch meta", lambda: flash_attn_source(dense.to("meta"), which="k", read_bytes=16), "kv_cache"
    yield "torch expanded", lambda: flash_attn_source(torch.zeros((1, 1, 1, 16)).expand(2, 2, 4, 16),
                                                          which="v", read_bytes=16), "kv_cache's 'v' part, by"


@pytest.mark.parametrize(("label", "call", "words"), list(_preset_cases()), ids=lambda x: x if isinstance(x, str)
                         and " " in x else None)
def test_presets_name_the_callers_arguments_never_the_fields_of_the_source(label, call, words):
    with pytest.raises(kc.CanaryArgumentError, match=f"^kv-canary: {words}") as info:
        call()
    assert "RealKvSource" not in str(info.value), label


def _torch_preset(name: str, torch):
    """(a torch cache, a source over it) for each preset, small, with nonzero K/V."""
    if name == "cpu":
        cache = torch.arange(2 * 2 * 4 * 16, dtype=torch.float32).reshape(2, 2, 4, 16)
        return cache, vllm_cpu_source(cache, block_size=4, num_kv_heads=2, head_size=8, which="v", read_bytes=64,
                                      isa="vec")
    if name == "flash":
        cache = torch.arange(2 * 4 * 2 * 16, dtype=torch.float32).reshape(2, 4, 2, 16).transpose(1, 2)
        return cache, flash_attn_source(cache, which="v", read_bytes=64)
    if name == "hnd":
        cache = torch.arange(2 * 2 * 4 * 16, dtype=torch.float32).reshape(2, 2, 4, 16)
        return cache, flashinfer_hnd_source(cache, which="v", read_bytes=64)
    if name == "packed":  # unequal K and V head sizes, the layout named
        cache = torch.arange(2 * 2 * 4 * 16, dtype=torch.float32).reshape(2, 2, 4, 16)
        return cache, vllm_attention_source(cache, head_size=4, which="v", read_bytes=64, kv_cache_layout="LBHNC")
    cache = torch.arange(2 * 4 * 16, dtype=torch.float32).reshape(2, 4, 16)  # MLA: the source reads it whole
    return cache, vllm_mla_source(cache, which="k", read_bytes=64)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("preset", ["cpu", "flash", "hnd", "packed", "mla"])
@pytest.mark.parametrize("move", ["set_", "resize_"])
def test_a_preset_source_over_a_torch_cache_moved_later_is_refused_like_a_plain_source(backend, preset, move):
    """A preset reads K or V through a view of the cache; re-pointing the cache itself (``set_``) or growing it
    into new memory (``resize_``) leaves that view on the old storage. The next launch is refused naming
    kv_cache, as a plain RealKvSource over the tensor is, and writes nothing."""
    torch = pytest.importorskip("torch")
    cache, source = _torch_preset(preset, torch)
    ctx = context(num_slots=8, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    write(ctx, [2], [-1], [1, 2], [10, 11], [0, 1], backend=backend)  # accepted while the cache is in place
    if move == "set_":
        cache.set_(torch.zeros_like(cache).untyped_storage(), 0, cache.shape, cache.stride())
    else:
        cache.resize_(cache.numel() * 64)  # larger than its storage: torch moves it to new memory
    before = ctx.canary_buf.copy(), ctx.violation_ring.copy(), ctx.status.copy()
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache: the torch tensor's storage moved"):
        write(ctx, [2], [-1], [3, 4], [12, 13], [2, 3], backend=backend)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache: the torch tensor's storage moved"):
        verify(ctx, [1, 2], [0, 1], [-1, 1], backend=backend)
    after = ctx.canary_buf, ctx.violation_ring, ctx.status
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("preset", ["flash", "mla"])
def test_a_bound_launch_over_a_preset_source_refuses_once_the_torch_cache_is_re_pointed(backend, preset):
    """A bound launch checks only what it was bound over; the engine's cache a preset's view was taken from
    must be among those checks, or a bound launch keeps fingerprinting the old storage after ``set_``."""
    torch = pytest.importorskip("torch")
    cache, source = _torch_preset(preset, torch)
    ctx = context(num_slots=8, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    bound_write = kc.bind_write(context=ctx, plan=write_plan([2], [-1]), input_ids=np.array([10, 11], np.int64),
                                positions=np.array([0, 1], np.int64), out_cache_loc=np.array([1, 2], np.int64),
                                enable_write_input_assert=False, backend=backend)
    bound_verify = kc.bind_verify(context=ctx, plan=verify_plan([1, 2], [0, 1], [-1, 1]),
                                  check_verify_expected_token=False, backend=backend)
    bound_write()
    bound_verify()
    assert rows(ctx) == []
    cache.set_(torch.zeros_like(cache).untyped_storage(), 0, cache.shape, cache.stride())
    before = ctx.canary_buf.copy(), ctx.violation_ring.copy(), ctx.status.copy()
    for bound in (bound_write, bound_verify):
        with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache: the torch tensor's storage moved"):
            bound()
    after = ctx.canary_buf, ctx.violation_ring, ctx.status
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after, strict=True))


def test_a_layout_reading_more_bytes_per_token_than_its_tensor_holds_is_refused_before_any_allocation():
    """Zero strides let a token's stream alias the same bytes; one longer than the whole tensor would make
    read_bytes (work per slot, the reference's gather) unbounded: 2**40 bytes per token over 4 KiB is refused at
    construction, and the boundary is the tensor's length."""
    huge = kc.KvByteLayout(page_stride=0, token_stride=0, head_stride=0, element_stride=0, num_heads=1 << 20,
                           elements_per_head=1 << 16, element_bytes=16)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: RealKvSource\.layout reads 1099511627776 bytes "
                                                     r"per token .* more than the 4096 bytes RealKvSource\.tensor"):
        kc.RealKvSource(np.zeros(4096, np.uint8), page_size=1, num_bytes_per_token=1 << 40, read_bytes=1 << 40,
                        layout=huge)
    aliased = layout(element_stride=0, elements_per_head=16)  # 16 two-byte elements, all at offset 0: 32 bytes
    buf = np.zeros(64, np.uint8)
    assert kc.RealKvSource(buf[:32], page_size=1, num_bytes_per_token=32, read_bytes=32,
                           layout=aliased).slots_covered == UNBOUNDED_SLOTS
    with pytest.raises(kc.CanaryArgumentError, match="more than the 31 bytes"):
        kc.RealKvSource(buf[:31], page_size=1, num_bytes_per_token=32, read_bytes=32, layout=aliased)


# --- through write and verify -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["k", "v"])
def test_write_then_verify_with_a_strided_source_catches_one_flipped_kv_element(backend, mode, which):
    bs, heads, d = 32, 2, 8
    k, v = per_token_kv(2 * bs, heads, d, np.float32, 11), per_token_kv(2 * bs, heads, d, np.float32, 12)
    cache = vllm_cpu_cache(k, v, bs)
    source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which, read_bytes=64,
                             isa="vec")
    assert source.layout.access_kind() == (ACCESS_ELEMENTS if which == "k" else ACCESS_HEAD_RUNS)
    ctx = context(num_slots=2 * bs, real_kv_sources=(source,), real_kv_hash_mode=mode)
    slots = [3, 4, 40, 41]
    write(ctx, [4], [-1], slots, [10, 11, 12, 13], [0, 1, 2, 3], backend=backend)
    oracle = oracle_source(source)
    assert [int(v) for v in fields(ctx)[slots, 3]] == [to_i64(real_kv_hash(s, [oracle], int(mode))) for s in slots]
    verify(ctx, slots, [0, 1, 2, 3], [-1, 3, 4, 40], backend=backend)
    assert rows(ctx) == []
    token = 40 - bs  # slot 40: token 8 of block 1; flip element 0 of head 0
    plane_index = token if which == "k" else bs * d + token * d
    cache.reshape(2, heads, -1).view(np.uint32)[1, 0, plane_index] ^= 1 << 20
    verify(ctx, slots, [0, 1, 2, 3], [-1, 3, 4, 40], backend=backend)
    bad = rows(ctx)
    assert len(bad) == 1 and bad[0][1] == 40 and bad[0][7] == kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("dtype", "d"), [(np.uint8, 16), (np.float16, 8), (np.float32, 4)])
def test_write_fingerprints_narrow_strided_elements_across_heads_like_the_oracle(backend, mode, dtype, d):
    # K column-major: every element on its own stride; 16 bytes a head, so a 16-byte read word pair ends on
    # a head boundary and the full read crosses three of them. Seeds 0..5: any element out of place shows.
    bs, heads = 4, 4
    for seed in range(6):
        if dtype == np.uint8:
            k = np.random.default_rng(seed).integers(0, 256, (2 * bs, heads, d), dtype=np.uint8)
        else:
            k = per_token_kv(2 * bs, heads, d, dtype, seed)
        cache = vllm_cpu_cache(k, k, bs)
        read = heads * d * np.dtype(dtype).itemsize
        source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which="k", read_bytes=read,
                                 isa="vec")
        assert source.layout.access_kind() == ACCESS_ELEMENTS
        ctx = context(num_slots=2 * bs, real_kv_sources=(source,), real_kv_hash_mode=mode)
        slots = [1, 2, 5, 7]
        write(ctx, [4], [-1], slots, [10, 11, 12, 13], [0, 1, 2, 3], backend=backend)
        oracle = oracle_source(source)
        assert [int(v) for v in fields(ctx)[slots, 3]] == [to_i64(real_kv_hash(s, [oracle], int(mode)))
                                                          for s in slots], seed


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("mode", "read_heads"), [(kc.RealKvHashMode.PARTIAL, 2), (kc.RealKvHashMode.ALL, 1),
                                                  (kc.RealKvHashMode.ALL, 2)])
def test_one_write_fingerprints_fp32_k_columns_and_sources_of_other_page_sizes_like_the_oracle(backend, mode,
                                                                                                read_heads):
    # fp32 K stored column-major (each 4-byte element a block's width apart), read inside one head (PARTIAL's 16
    # bytes; ALL over one head) or across both, next to sources whose pages hold another number of slots: one
    # launch, each source's words and pages its own. Seeds 0..7: a word built from the wrong elements, or a page
    # taken from another source's page size, shows.
    heads, d = 2, 8
    for seed in range(8):
        k4, v4 = per_token_kv(12, heads, d, np.float32, seed), per_token_kv(12, heads, d, np.float32, seed + 100)
        k3 = per_token_kv(12, heads, d, np.float32, seed + 200)
        read = read_heads * d * 4
        sources = (vllm_cpu_source(vllm_cpu_cache(k4, v4, 4), block_size=4, num_kv_heads=heads, head_size=d,
                                   which="k", read_bytes=read, isa="vec"),
                   vllm_cpu_source(vllm_cpu_cache(k3, k3, 3), block_size=3, num_kv_heads=heads, head_size=d,
                                   which="k", read_bytes=read, isa="vec"),
                   vllm_cpu_source(vllm_cpu_cache(k4, v4, 4), block_size=4, num_kv_heads=heads, head_size=d,
                                   which="v", read_bytes=read, isa="vec"))
        assert [s.page_size for s in sources] == [4, 3, 4]
        ctx = context(num_slots=12, real_kv_sources=sources, real_kv_hash_mode=mode)
        slots = [1, 3, 4, 5, 7, 8, 10, 11]
        write(ctx, [len(slots)], [-1], slots, [10 + i for i in range(len(slots))], list(range(len(slots))),
              backend=backend)
        oracles = [oracle_source(s) for s in sources]
        assert [int(v) for v in fields(ctx)[slots, 3]] == [to_i64(real_kv_hash(s, oracles, int(mode)))
                                                          for s in slots], seed


def test_public_names():
    assert kc.KvByteLayout.__module__ == "kvcanary_cupy.kv_bytes"
    assert kc.kv_layouts.KvByteLayout is kc.KvByteLayout  # the presets module re-exports it
    assert kc.RealKvSource(np.zeros((1, 16), np.uint8), 1, 16, 16).layout is None
    with pytest.raises(TypeError):
        kc.RealKvSource(np.zeros(64, np.uint8), 1, 16, 16, layout())  # layout is keyword-only
    assert MODE_PARTIAL == int(kc.RealKvHashMode.PARTIAL)


# --- through the engine runtime -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("flip", [False, True])
def test_runtime_over_a_vllm_cpu_cache_is_clean_and_catches_a_flipped_k_bit(backend, flip):
    from kvcanary_cupy.runtime import (
        CanaryConfig,
        CanaryRuntime,
        CanaryViolationError,
        Capacities,
        KvGroup,
        KvPools,
        StepBatch,
    )

    bs, heads, d = 32, 2, 4
    cache = np.zeros((2, heads, bs, 2 * d), np.float32)  # 64 slots, slot 0 reserved
    planes = cache.reshape(2, heads, 2 * bs * d)
    src = {which: vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                                  read_bytes=heads * d * 4, isa="vec") for which in ("k", "v")}
    req_to_token = np.zeros((4, 16), np.int32)
    rt = CanaryRuntime.create(CanaryConfig(mode="raise", backend=backend),
                              KvPools((KvGroup.full("FULL", 2 * bs, src["k"], src["v"]),), req_to_token=req_to_token),
                              Capacities(max_batch_size=4, max_tokens=16))
    rt.mark_init_finished()

    def forward(ids, positions, slots):  # K column-major, V row-major, per (block, head)
        for token, pos, slot in zip(ids, positions, slots, strict=True):
            values = np.random.default_rng([token, pos]).standard_normal((2, heads, d)).astype(np.float32)
            b, t = divmod(slot, bs)
            for h in range(heads):
                planes[b, h, t : bs * d : bs] = values[0, h]
                planes[b, h, bs * d + t * d : bs * d + (t + 1) * d] = values[1, h]

    lengths, next_slot, raised = {1: 0, 2: 0}, 30, None  # slots 30.. cross from block 0 into block 1
    for step in range(6):
        rows, prefix, extend, ids, pos, loc = [], [], [], [], [], []
        for rp, n in ((1, 4), (2, 3)) if step == 0 else ((1, 1), (2, 1)):
            slots = list(range(next_slot, next_slot + n))
            next_slot += n
            req_to_token[rp, lengths[rp] : lengths[rp] + n] = slots
            rows, prefix, extend = [*rows, rp], [*prefix, lengths[rp]], [*extend, n]
            ids += [100 * rp + p for p in range(lengths[rp], lengths[rp] + n)]
            pos += list(range(lengths[rp], lengths[rp] + n))
            loc += slots
            lengths[rp] += n
        rt.prepare(StepBatch(*(np.array(a, np.int64) for a in (rows, prefix, extend, ids, pos, loc))))
        rt.pre_forward()
        forward(ids, pos, loc)
        if flip and step == 3:
            planes.view(np.uint32)[1, 1, 1] ^= 1 << 7  # K of slot 33 (block 1, token 1), head 1, element 0
        rt.post_forward()
        try:
            rt.finish_step()
        except CanaryViolationError as err:
            raised = (step, [(v.slot, v.launch_tag, v.labels) for _, v in err.violations])
            break
    if not flip:
        assert raised is None
    else:
        assert raised == (4, [(33, "TAIL_K_FULL", ["verify_real_kv_hash"])])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_runtime_over_a_preset_source_refuses_the_tail_phase_once_the_torch_cache_is_re_pointed(backend):
    """The runtime binds its launches once; a preset source's cache re-pointed with ``set_`` after some steps
    stops the next TAIL phase (the one that reads the KV) by the cache's name, with nothing written."""
    torch = pytest.importorskip("torch")
    from test_runtime import runtime_arrays

    from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch

    bs, heads, d = 8, 2, 4
    cache = torch.zeros((4, heads, bs, 2 * d))
    src = {w: vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=w, read_bytes=32,
                              isa="vec") for w in ("k", "v")}
    req_to_token = np.zeros((2, 16), np.int32)
    rt = CanaryRuntime.create(CanaryConfig(mode="raise", backend=backend),
                              KvPools((KvGroup.full("FULL", 4 * bs, src["k"], src["v"]),), req_to_token=req_to_token),
                              Capacities(max_batch_size=2, max_tokens=8))
    rt.mark_init_finished()

    def step(position: int) -> None:
        slot = 1 + position
        req_to_token[1, position] = slot
        rt.prepare(StepBatch(*(np.array(a, np.int64) for a in ([1], [position], [1], [7 + position], [position],
                                                                [slot]))))
        rt.pre_forward()

    for position in range(3):
        step(position)
        rt.post_forward()
        rt.finish_step()
    step(3)
    cache.set_(torch.zeros_like(cache))  # the engine re-allocated its KV cache
    before = runtime_arrays(rt)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: kv_cache: the torch tensor's storage moved"):
        rt.post_forward()
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []
