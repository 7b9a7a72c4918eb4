"""vLLM's CPU attention cache in its `amx` layout (bf16 models on an AMX CPU) and `vec16` layout, read in place.

The expectation is written from vLLM's layout description, one element at a time (``amx_cache`` below: 16-token
tiles of K with elements in VNNI pairs, 16-element chunks of V with tokens in pairs, measured on an AMX machine
and matching vLLM's ``reshape_and_cache`` of the AMX kernels). Each check compares the preset's source with it
in two independent ways: the scalar oracle's byte-by-byte walk of the source's layout must give each token's own
K/V bytes, and the fingerprints every CPU backend stamps must equal those of the same K/V copied into one row per
token (the source without a layout, pinned by published vectors elsewhere).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from chain_helpers import context, fields, rows, verify, write
from oracle import MODE_ALL, StridedSource, real_kv_hash

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.hashing import fold_real_kv
from kvcanary_cupy.kv_layouts import ACCESS_ELEMENTS, vllm_cpu_source

CPU_BACKENDS = [
    "numpy",
    pytest.param("host", marks=pytest.mark.skipif(unavailable_reason("host") is not None,
                                                  reason=f"host backend: {unavailable_reason('host')}")),
]
MODES = [kc.RealKvHashMode.PARTIAL, kc.RealKvHashMode.ALL]
BF16, FP8 = np.uint16, np.uint8  # the cache's storage: bf16 and fp8 elements as their raw bits


def amx_k_offset(o: int, d: int, block_size: int, head_size: int) -> int:
    """Element offset of K element ``d`` of token ``o`` inside a (block, head) plane (vLLM CPU `amx`)."""
    return (o // 16) * 16 * head_size + (d // 2) * 32 + (o % 16) * 2 + d % 2


def amx_v_offset(o: int, d: int, block_size: int, head_size: int) -> int:
    """Element offset of V element ``d`` of token ``o`` inside a (block, head) plane (vLLM CPU `amx`)."""
    return block_size * head_size + (d // 16) * block_size * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2


def amx_cache(k: np.ndarray, v: np.ndarray, block_size: int) -> np.ndarray:
    """vLLM's CPU `amx` cache ``[blocks, heads, block_size, 2 * D]`` holding per-slot ``k`` and ``v``
    (``[slots, heads, D]``), element by element."""
    slots, heads, d = k.shape
    blocks = slots // block_size
    planes = np.zeros((blocks, heads, 2 * block_size * d), k.dtype)
    for s in range(slots):
        b, o = divmod(s, block_size)
        for h in range(heads):
            for e in range(d):
                planes[b, h, amx_k_offset(o, e, block_size, d)] = k[s, h, e]
                planes[b, h, amx_v_offset(o, e, block_size, d)] = v[s, h, e]
    return planes.reshape(blocks, heads, block_size, 2 * d)


def random_kv(slots: int, heads: int, d: int, dtype, seed: int) -> np.ndarray:
    """Random raw bits per (slot, head, element): distinct enough that any misplaced element shows."""
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(0, info.max + 1, (slots, heads, d), dtype=dtype)


def oracle_view(source: kc.RealKvSource) -> StridedSource:
    lay = source.layout
    return StridedSource(bytes(np.asarray(source.byte_rows).reshape(-1).tobytes()), source.page_size,
                         lay.page_stride, lay.token_stride, lay.head_stride, lay.element_stride, lay.num_heads,
                         lay.elements_per_head, lay.element_bytes, source.read_bytes, lay.tokens_per_tile,
                         lay.tile_stride, lay.elements_per_group, lay.group_stride)


def stamps(source: kc.RealKvSource, slots: list[int], mode, backend: str) -> list[int]:
    """The real-KV fingerprints a write on ``backend`` stamps into ``slots``."""
    ctx = context(num_slots=max(slots) + 1, real_kv_sources=(source,), real_kv_hash_mode=mode)
    write(ctx, [len(slots)], [-1], slots, list(range(100, 100 + len(slots))), list(range(len(slots))),
          backend=backend)
    return [int(x) for x in fields(ctx)[slots, 3]]


def contiguous(values: np.ndarray, read_bytes: int) -> kc.RealKvSource:
    flat = np.ascontiguousarray(values.reshape(values.shape[0], -1)).view(np.uint8)
    return kc.RealKvSource(flat, page_size=1, num_bytes_per_token=flat.shape[1], read_bytes=read_bytes)


SHAPES = [  # (dtype, block_size, heads, head_size)
    (BF16, 32, 1, 64), (BF16, 32, 2, 128), (BF16, 64, 2, 64), (BF16, 128, 1, 32), (BF16, 96, 1, 96),
    (FP8, 32, 2, 64), (FP8, 64, 1, 128),
]


@pytest.mark.parametrize(("dtype", "bs", "heads", "d"), SHAPES)
def test_amx_preset_reads_every_token_byte_exact(dtype, bs, heads, d):
    """The oracle's walk of the preset's layout gives each token's own K (and V) bytes, for every slot."""
    slots = 2 * bs
    k, v = random_kv(slots, heads, d, dtype, 1), random_kv(slots, heads, d, dtype, 2)
    cache = amx_cache(k, v, bs)
    per_token = heads * d * np.dtype(dtype).itemsize
    for which, values in (("k", k), ("v", v)):
        source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                                 read_bytes=per_token, isa="amx")
        assert source.page_size == bs and source.slots_covered == slots
        assert source.layout.access_kind() == ACCESS_ELEMENTS
        walk = oracle_view(source)
        for s in range(slots):
            assert walk.logical_bytes(s, per_token) == values[s].tobytes(), (which, s)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("dtype", "bs", "heads", "d"), SHAPES)
def test_amx_preset_fingerprints_like_the_same_kv_stored_contiguously(backend, mode, dtype, bs, heads, d):
    k, v = random_kv(3 * bs, heads, d, dtype, 3), random_kv(3 * bs, heads, d, dtype, 4)
    cache = amx_cache(k, v, bs)
    per_token = heads * d * np.dtype(dtype).itemsize
    slots = sorted({0, 1, 15, 16, 17, bs - 1, bs, bs + 16, 2 * bs + 3, 3 * bs - 1})
    for which, values in (("k", k), ("v", v)):
        for read in sorted({16, per_token // 2 // 16 * 16 or 16, per_token}):
            source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                                     read_bytes=read, isa="amx")
            want = stamps(contiguous(values, read), slots, mode, "numpy")
            assert stamps(source, slots, mode, backend) == want, (which, read)


@pytest.mark.parametrize("seed", range(6))
def test_amx_preset_fingerprints_random_shapes_and_slots_on_every_backend(seed):
    """Many seeds: random block and head sizes, heads, dtype and slots; numpy and host agree with the
    contiguous copy."""
    rng = np.random.default_rng(seed)
    dtype = [BF16, FP8][seed % 2]
    bs, d, heads = 32 * int(rng.integers(1, 4)), 32 * int(rng.integers(1, 5)), int(rng.integers(1, 4))
    blocks = int(rng.integers(1, 4))
    k, v = random_kv(blocks * bs, heads, d, dtype, seed + 10), random_kv(blocks * bs, heads, d, dtype, seed + 20)
    cache = amx_cache(k, v, bs)
    per_token = heads * d * np.dtype(dtype).itemsize
    slots = sorted(set(rng.integers(0, blocks * bs, 12).tolist()))
    backends = ["numpy"] + (["host"] if unavailable_reason("host") is None else [])
    for which, values in (("k", k), ("v", v)):
        source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                                 read_bytes=per_token, isa="amx")
        want = stamps(contiguous(values, per_token), slots, MODE_ALL, "numpy")
        for backend in backends:
            assert stamps(source, slots, MODE_ALL, backend) == want, (which, backend)


def test_the_amx_cache_read_with_the_vec_layout_fingerprints_differently():
    """The comparison above can fail: the same amx cache read as if it were `vec` gives other fingerprints."""
    bs, heads, d = 32, 2, 64
    k, v = random_kv(bs, heads, d, BF16, 5), random_kv(bs, heads, d, BF16, 6)
    cache = amx_cache(k, v, bs)
    slots = [1, 2, 17, 31]
    for which, values in (("k", k), ("v", v)):
        wrong = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which, read_bytes=256,
                                isa="vec")
        want = stamps(contiguous(values, 256), slots, MODE_ALL, "numpy")
        got = stamps(wrong, slots, MODE_ALL, "numpy")
        assert all(g != w for g, w in zip(got, want, strict=True)), which


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("element", [0, 1, 17, 63])
def test_write_then_verify_over_an_amx_cache_catches_one_flipped_element_at_its_slot(backend, which, element):
    bs, heads, d = 32, 2, 64
    k, v = random_kv(2 * bs, heads, d, BF16, 7), random_kv(2 * bs, heads, d, BF16, 8)
    cache = amx_cache(k, v, bs)
    source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                             read_bytes=heads * d * 2, isa="amx")
    ctx = context(num_slots=2 * bs, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    slots = [3, 16, 17, 50]
    write(ctx, [4], [-1], slots, [10, 11, 12, 13], [0, 1, 2, 3], backend=backend)
    verify(ctx, slots, [0, 1, 2, 3], [-1, 3, 16, 17], backend=backend)
    assert rows(ctx) == []
    block, o = divmod(50, bs)  # slot 50: token 18 of block 1, head 1
    offset = (amx_k_offset if which == "k" else amx_v_offset)(o, element, bs, d)
    cache.reshape(2, heads, -1)[block, 1, offset] ^= 1 << 3
    verify(ctx, slots, [0, 1, 2, 3], [-1, 3, 16, 17], backend=backend)
    bad = rows(ctx)
    assert len(bad) == 1 and bad[0][1] == 50 and bad[0][7] == kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH


def test_amx_preset_reads_a_torch_bf16_cache_in_place():
    torch = pytest.importorskip("torch")
    bs, heads, d = 32, 2, 64
    k, v = random_kv(2 * bs, heads, d, BF16, 9), random_kv(2 * bs, heads, d, BF16, 10)
    cache = torch.from_numpy(amx_cache(k, v, bs).view(np.int16)).view(torch.bfloat16)
    source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which="v", read_bytes=256,
                             isa="amx")
    slots = [0, 5, 33, 63]
    assert stamps(source, slots, MODE_ALL, "numpy") == stamps(contiguous(v, 256), slots, MODE_ALL, "numpy")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("dtype", "bs", "d"), [(np.float32, 16, 48), (np.float16, 32, 80), (BF16, 48, 16)])
def test_vec16_is_read_with_the_vec_layout(backend, dtype, bs, d):
    """`vec16` (head sizes a multiple of 16 but not 32, or block sizes not a multiple of 32) runs vLLM's `vec`
    cache writer: K column-major, V row-major per (block, head), built here element by element."""
    heads = 2
    rng = np.random.default_rng(bs + d)
    k = rng.integers(0, 1 << 16, (2 * bs, heads, d * np.dtype(dtype).itemsize // 2), np.uint16).view(dtype)
    v = rng.integers(0, 1 << 16, (2 * bs, heads, d * np.dtype(dtype).itemsize // 2), np.uint16).view(dtype)
    planes = np.zeros((2, heads, 2 * bs * d), dtype)
    for s in range(2 * bs):
        b, o = divmod(s, bs)
        for h in range(heads):
            for e in range(d):
                planes[b, h, e * bs + o] = k[s, h, e]
                planes[b, h, bs * d + o * d + e] = v[s, h, e]
    cache = planes.reshape(2, heads, bs, 2 * d)
    per_token = heads * d * np.dtype(dtype).itemsize
    slots = [0, 1, bs - 1, bs, 2 * bs - 1]
    for which, values in (("k", k), ("v", v)):
        source = vllm_cpu_source(cache, block_size=bs, num_kv_heads=heads, head_size=d, which=which,
                                 read_bytes=per_token, isa="vec16")
        want = stamps(contiguous(values, per_token), slots, MODE_ALL, "numpy")
        assert stamps(source, slots, MODE_ALL, backend) == want, which


def refused(message: str):
    return pytest.raises(kc.CanaryArgumentError, match="^" + re.escape("kv-canary: " + message) + "$")


@pytest.mark.parametrize(("cache", "bs", "d", "message"), [
    (np.zeros((2, 1, 32, 128), np.float32), 32, 64,
     "isa='amx' stores 2-byte (bf16) or 1-byte (fp8) elements; kv_cache has 4-byte elements"),
    (np.zeros((2, 1, 16, 128), np.uint16), 16, 64,
     "isa='amx' needs block_size and head_size multiples of 32 (vLLM picks another ISA otherwise), got "
     "block_size=16, head_size=64"),
    (np.zeros((2, 1, 32, 96), np.uint16), 32, 48,
     "isa='amx' needs block_size and head_size multiples of 32 (vLLM picks another ISA otherwise), got "
     "block_size=32, head_size=48"),
], ids=["fp32", "block-16", "head-48"])
def test_amx_preset_refuses_what_vllm_never_lays_out_as_amx(cache, bs, d, message):
    with refused(message):
        vllm_cpu_source(cache, block_size=bs, num_kv_heads=1, head_size=d, which="k", read_bytes=16, isa="amx")


@pytest.mark.parametrize("isa", ["neon", "vsx", "vxe", "rvv", "", "AMX"])
def test_a_cpu_isa_whose_layout_is_not_read_is_refused(isa):
    with refused(f"isa={isa!r}: the vLLM CPU KV layout of that ISA is not implemented (only 'vec', 'vec16', "
                 "'amx' are); it is refused rather than fingerprinted wrongly"):
        vllm_cpu_source(np.zeros((2, 1, 32, 64), np.uint16), block_size=32, num_kv_heads=1, head_size=32,
                        which="k", read_bytes=16, isa=isa)


def test_amx_layouts_are_the_digit_splits_written_out():
    """The preset's descriptors for a bf16 cache [3, 2, 64, 256] (block 64, head 128), field by field."""
    cache = np.zeros((3, 2, 64, 256), np.uint16)
    k = vllm_cpu_source(cache, block_size=64, num_kv_heads=2, head_size=128, which="k", read_bytes=16, isa="amx")
    v = vllm_cpu_source(cache, block_size=64, num_kv_heads=2, head_size=128, which="v", read_bytes=16, isa="amx")
    plane = 64 * 256 * 2
    assert k.layout == kc.KvByteLayout(page_stride=2 * plane, token_stride=4, head_stride=plane, element_stride=2,
                                       num_heads=2, elements_per_head=128, element_bytes=2, tokens_per_tile=16,
                                       tile_stride=16 * 128 * 2, elements_per_group=2, group_stride=64)
    assert v.layout == kc.KvByteLayout(page_stride=2 * plane, token_stride=2, head_stride=plane, element_stride=4,
                                       num_heads=2, elements_per_head=128, element_bytes=2, tokens_per_tile=2,
                                       tile_stride=64, elements_per_group=16, group_stride=64 * 16 * 2)
    assert np.asarray(v.byte_rows).ctypes.data - np.asarray(k.byte_rows).ctypes.data == 64 * 128 * 2


# --- the descriptor's digit splits ----------------------------------------------------------------------------

BASE = dict(page_stride=0, token_stride=0, head_stride=0, element_stride=2, num_heads=1, elements_per_head=8,
            element_bytes=2)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(tokens_per_tile=-1), "KvByteLayout.tokens_per_tile must be >= 0, got -1"),
    (dict(tokens_per_tile=(1 << 31) + 1), "KvByteLayout.tokens_per_tile must be <= 2147483648, got 2147483649"),
    (dict(elements_per_group=1.0), "KvByteLayout.elements_per_group must be an int, got float"),
    (dict(elements_per_group=-3), "KvByteLayout.elements_per_group must be >= 0, got -3"),
    (dict(tokens_per_tile=16, tile_stride=3),
     "KvByteLayout.tile_stride must be a multiple of element_bytes=2 (elements are loaded naturally aligned), got 3"),
    (dict(elements_per_group=2, group_stride=(1 << 48) + 2),
     "KvByteLayout.group_stride must be <= 281474976710656, got 281474976710658"),
    (dict(elements_per_group=2, group_stride=-2), "KvByteLayout.group_stride must be >= 0, got -2"),
    (dict(tile_stride=64), "KvByteLayout.tile_stride must be 0 when tokens_per_tile is 0 (nothing is split), got 64"),
    (dict(group_stride=2), "KvByteLayout.group_stride must be 0 when elements_per_group is 0 (nothing is split), "
                           "got 2"),
], ids=["tiles-negative", "tiles-big", "group-float", "group-negative", "tile-stride-odd", "group-stride-big",
        "group-stride-negative", "tile-stride-unsplit", "group-stride-unsplit"])
def test_layout_refuses_each_split_field_past_its_bound_with_the_exact_message(changes, message):
    with refused(message):
        kc.KvByteLayout(**{**BASE, **changes})


def test_layout_accepts_each_split_field_at_its_bound():
    lay = kc.KvByteLayout(**{**BASE, "tokens_per_tile": 1 << 31, "tile_stride": 1 << 48,
                             "elements_per_group": 1 << 31, "group_stride": 1 << 48})
    assert (lay.tokens_per_tile, lay.tile_stride, lay.elements_per_group, lay.group_stride) == (
        1 << 31, 1 << 48, 1 << 31, 1 << 48)


def test_layout_repr_names_a_split_only_where_the_layout_has_it():
    assert repr(kc.KvByteLayout(**BASE)) == ("KvByteLayout(page_stride=0, token_stride=0, head_stride=0, "
                                             "element_stride=2, num_heads=1, elements_per_head=8, element_bytes=2)")
    assert repr(kc.KvByteLayout(**BASE, elements_per_group=2, group_stride=64)) == (
        "KvByteLayout(page_stride=0, token_stride=0, head_stride=0, element_stride=2, num_heads=1, "
        "elements_per_head=8, element_bytes=2, elements_per_group=2, group_stride=64)")


def _term(index: int, radix: int, high: int, low: int) -> int:
    return index * low if radix == 0 else (index // radix) * high + (index % radix) * low


def _random_split_layout(rng: np.random.Generator) -> kc.KvByteLayout:
    eb = int(rng.choice([1, 2, 4, 8, 16]))
    heads, per_head = int(rng.integers(1, 4)), int(rng.integers(1, 9))
    while (heads * per_head * eb) % 16:
        per_head += 1
    tiles, groups = int(rng.choice([0, 1, 2, 3, 16])), int(rng.choice([0, 1, 2, 3, 4]))
    stride = lambda: eb * int(rng.choice([0, 1, 2, 3, 7, 32]))  # noqa: E731
    return kc.KvByteLayout(page_stride=stride() * 4, token_stride=stride(), head_stride=stride(),
                           element_stride=stride(), num_heads=heads, elements_per_head=per_head, element_bytes=eb,
                           tokens_per_tile=tiles, tile_stride=stride() if tiles else 0, elements_per_group=groups,
                           group_stride=stride() if groups else 0)


def test_extent_and_coverage_of_split_layouts_match_a_byte_by_byte_walk():
    """last_byte_in_token and slots_covered, against every element of every slot walked by the definition."""
    rng = np.random.default_rng(11)
    for _ in range(400):
        lay = _random_split_layout(rng)
        page_size, span = int(rng.integers(1, 40)), int(rng.integers(1, 3000))

        def ends(s, lay=lay, page_size=page_size):  # the last byte of each element of slot s
            token = (s // page_size) * lay.page_stride + _term(s % page_size, lay.tokens_per_tile, lay.tile_stride,
                                                               lay.token_stride)
            return [token + h * lay.head_stride + _term(e, lay.elements_per_group, lay.group_stride,
                                                        lay.element_stride) + lay.element_bytes - 1
                    for h in range(lay.num_heads) for e in range(lay.elements_per_head)]

        assert lay.last_byte_in_token() == max(ends(0))
        got = lay.slots_covered(page_size, span)
        fits = lambda s, span=span: max(ends(s)) < span  # noqa: E731
        if got == kc.kv_layouts.UNBOUNDED_SLOTS:
            assert lay.page_stride == 0 and all(fits(s) for s in range(3 * page_size))
        else:
            assert all(fits(s) for s in range(got)) and not fits(got), (lay, page_size, span, got)


@pytest.mark.parametrize("mode", MODES)
def test_reference_matches_the_oracle_on_random_split_layouts(mode):
    rng = np.random.default_rng(99 + int(mode))
    checked = 0
    for _ in range(150):
        lay = _random_split_layout(rng)
        extent = max(lay.last_byte_in_token() + 1, lay.bytes_per_token)
        data = rng.integers(0, 256, size=extent + int(rng.integers(0, 600)), dtype=np.uint8)
        read = 16 * int(rng.integers(1, lay.bytes_per_token // 16 + 1))
        source = kc.RealKvSource(data, page_size=int(rng.integers(1, 20)), num_bytes_per_token=lay.bytes_per_token,
                                 read_bytes=read, layout=lay)
        covered = min(source.slots_covered, 60)
        if covered == 0:
            continue
        slots = rng.integers(0, covered, size=10)
        got = fold_real_kv(slots.astype(np.int64), [source.view()], int(mode)).tolist()
        assert got == [real_kv_hash(int(s), [oracle_view(source)], int(mode)) for s in slots], lay
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_launch_past_what_a_split_layout_covers_is_refused_before_anything_is_written(backend):
    """A bf16 amx-style K layout (tiles of 16 tokens, element pairs) over a tensor that ends one byte before the
    last byte of page 1's token 16 (the first token of its second tile, 1024 + 15 * 64 + 2 + 1 bytes into the
    page): it covers 48 slots, and a canary buffer of 49 slots is refused, every buffer unchanged."""
    d, bs = 32, 32
    lay = kc.KvByteLayout(page_stride=2 * bs * d * 2, token_stride=4, head_stride=0, element_stride=2, num_heads=1,
                          elements_per_head=d, element_bytes=2, tokens_per_tile=16, tile_stride=16 * d * 2,
                          elements_per_group=2, group_stride=64)
    data = np.zeros(2 * bs * d * 2 + 1024 + 15 * 64 + 2 + 1, np.uint8)
    source = kc.RealKvSource(data, page_size=bs, num_bytes_per_token=2 * d, read_bytes=2 * d, layout=lay)
    assert source.slots_covered == bs + 16
    ctx = context(num_slots=bs + 17, real_kv_sources=(source,), real_kv_hash_mode=kc.RealKvHashMode.ALL)
    before = ctx.canary_buf.copy(), ctx.status.copy(), ctx.violation_ring.copy()
    with pytest.raises(kc.CanaryArgumentError, match=rf"^kv-canary: .*real_kv_sources\[0\] covers {bs + 16} slots"):
        write(ctx, [1], [-1], [0], [5], [0], backend=backend)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, (ctx.canary_buf, ctx.status, ctx.violation_ring),
                                                          strict=True))


def test_a_layouts_token_and_element_terms_split_their_index_into_two_digits():
    """The offsets the class documents, worked by hand: tokens in tiles of 16 (a tile 4096 bytes, a token 64
    inside it), elements in pairs (a pair 256 bytes apart, the two elements of a pair 2 bytes apart); without
    splits, index times stride."""
    amx = kc.KvByteLayout(page_stride=1 << 16, token_stride=64, head_stride=8192, element_stride=2, num_heads=2,
                          elements_per_head=32, element_bytes=2, tokens_per_tile=16, tile_stride=4096,
                          elements_per_group=2, group_stride=256)
    assert [amx.token_term(o) for o in (0, 1, 15, 16, 17, 33)] == [0, 64, 960, 4096, 4160, 8256]
    assert [amx.element_term(e) for e in (0, 1, 2, 3, 31)] == [0, 2, 256, 258, 3842]
    plain = kc.KvByteLayout(page_stride=4096, token_stride=96, head_stride=32, element_stride=4, num_heads=3,
                            elements_per_head=8, element_bytes=4)
    assert [plain.token_term(o) for o in (0, 1, 7)] == [0, 96, 672]
    assert [plain.element_term(e) for e in (0, 1, 7)] == [0, 4, 28]


def test_a_split_layouts_walk_is_the_widest_its_alignment_allows():
    """Elements in groups never take a run (a group's elements are not one run), even with every stride
    16-byte aligned; tokens in tiles whose strides are all 16-byte aligned read each token as one run, like an
    untiled layout of the same token (one head of 32 two-byte elements, 64 bytes)."""
    from kvcanary_cupy.kv_layouts import ACCESS_TOKEN_RUN

    grouped = kc.KvByteLayout(page_stride=1 << 16, token_stride=64, head_stride=0, element_stride=2, num_heads=1,
                              elements_per_head=32, element_bytes=2, elements_per_group=2, group_stride=256)
    assert grouped.access_kind() == ACCESS_ELEMENTS
    tiled = kc.KvByteLayout(page_stride=1 << 16, token_stride=64, head_stride=0, element_stride=2, num_heads=1,
                            elements_per_head=32, element_bytes=2, tokens_per_tile=16, tile_stride=4096)
    assert tiled.access_kind() == ACCESS_TOKEN_RUN
    unaligned_tiles = kc.KvByteLayout(page_stride=1 << 16, token_stride=64, head_stride=0, element_stride=2,
                                      num_heads=1, elements_per_head=32, element_bytes=2, tokens_per_tile=16,
                                      tile_stride=4098)
    assert unaligned_tiles.access_kind() == ACCESS_ELEMENTS
