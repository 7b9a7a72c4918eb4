"""The DLPack bridge (kvcanary_cupy.dlpack) with torch CPU tensors and NumPy producers.

Zero copy is checked by address, writes are checked from the other side of the bridge, and every refusal is a
``kv-canary: `` ValueError naming the argument. Device mixing is exercised with genuine ``cupy.ndarray``
objects that carry CUDA metadata but whose memory is never touched (validation fails before any launch);
the real CPU/CUDA mix with torch CUDA tensors lives in ``tests/gpu/test_torch_cuda.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from plan_helpers import fresh_plans, linear_rtt

import kvcanary_cupy as kc
from kvcanary_cupy._validate import array_arg, same_device
from kvcanary_cupy.dlpack import CPU, Device, as_array, as_byte_rows, device_of, export, stream_scope

torch = pytest.importorskip("torch")


def address(arr) -> int:
    return int(arr.ctypes.data) if isinstance(arr, np.ndarray) else int(arr.data_ptr())


class Producer:
    """A minimal DLPack producer: forwards the protocol of the array it wraps, optionally reporting another
    device. It is what a framework the bridge has never heard of looks like."""

    def __init__(self, arr, device=None):
        self.arr = arr
        self.device = device

    def __dlpack__(self, **kwargs):
        return self.arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.device if self.device is not None else self.arr.__dlpack_device__()


class NoDevice(Producer):
    def __dlpack_device__(self):
        raise RuntimeError("device query failed")


def read_only(values) -> np.ndarray:
    arr = np.asarray(values, np.int64).copy()
    arr.flags.writeable = False
    return arr


# --- zero copy, both ways ----------------------------------------------------------------------------------

def test_torch_cpu_tensor_becomes_a_numpy_view_of_the_same_memory():
    t = torch.arange(6, dtype=torch.int64)
    view = as_array(t, "t", writable=True)
    assert isinstance(view, np.ndarray)
    assert address(view) == address(t)
    assert view.dtype == np.int64 and view.shape == (6,)


def test_writes_through_the_view_land_in_the_tensor_and_back():
    t = torch.zeros(4, dtype=torch.int32)
    view = as_array(t, "t", writable=True)
    view[1] = 7
    assert t.tolist() == [0, 7, 0, 0]
    t[3] = -5
    assert view.tolist() == [0, 7, 0, -5]


def test_round_trip_torch_numpy_torch_shares_memory():
    t = torch.arange(5, dtype=torch.int64)
    back = export(as_array(t, "t"), torch)
    assert isinstance(back, torch.Tensor)
    assert back.data_ptr() == t.data_ptr()
    back[0] = 42
    assert int(t[0]) == 42


def test_export_of_a_numpy_array_to_torch_shares_memory():
    arr = np.arange(3, dtype=np.int64)
    t = export(arr, torch)
    t[2] = 9
    assert arr.tolist() == [0, 1, 9]


def test_export_to_a_module_without_from_dlpack_is_a_kv_canary_error():
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: to=.*has no from_dlpack"):
        export(np.zeros(1), object())


def test_numpy_arrays_pass_through_untouched():
    arr = np.arange(3)
    assert as_array(arr, "arr") is arr


def test_a_tensor_that_tracks_gradients_is_viewed_not_copied():
    t = torch.zeros(3, dtype=torch.float32, requires_grad=True)
    assert address(as_array(t, "t")) == address(t)


def test_foreign_producer_is_imported_zero_copy():
    arr = np.arange(4, dtype=np.int64)
    view = as_array(Producer(arr), "p", writable=True)
    assert address(view) == address(arr)


def test_a_plan_filled_through_the_bridge_is_read_back_through_torch():
    vp = kc.VerifyPlan.from_tensors(
        verify_slot_indices=torch.full((8,), -9, dtype=torch.int64),
        verify_expected_tokens=torch.full((8,), -9, dtype=torch.int64),
        verify_expected_positions=torch.full((8,), -9, dtype=torch.int64),
        verify_prev_slot_indices=torch.full((8,), -9, dtype=torch.int64),
        verify_num_valid=torch.zeros(1, dtype=torch.int32),
        enable=torch.zeros(1, dtype=torch.int32),
    )
    wp = kc.WritePlan.from_tensors(
        write_offsets=torch.full((3,), -9, dtype=torch.int64),
        write_seed_slot_indices=torch.full((2,), -9, dtype=torch.int64),
        write_num_valid_reqs=torch.zeros(1, dtype=torch.int32),
    )
    rtt = torch.from_numpy(linear_rtt(4, 16, base=100))
    kc.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor([2, 1]),
        prefix_lens=torch.tensor([2, 0]), extend_seq_lens=torch.tensor([1, 3]), req_to_token=rtt,
        swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=8,
    )
    assert vp.verify_slot_indices[:2].tolist() == [132, 133]
    assert vp.verify_slot_indices[2:].tolist() == [-9] * 6  # entries past the total are never touched
    assert vp.verify_prev_slot_indices[:2].tolist() == [-1, 132]
    assert int(vp.verify_num_valid) == 2 and int(vp.enable) == 1
    assert wp.write_offsets.tolist() == [0, 1, 4]
    assert wp.write_seed_slot_indices.tolist() == [133, -1]
    assert int(wp.write_num_valid_reqs) == 2


# --- refusals ----------------------------------------------------------------------------------------------

def test_read_only_numpy_output_is_refused():
    with pytest.raises(ValueError, match=r"^kv-canary: out is read-only"):
        as_array(read_only([1, 2]), "out", writable=True)


def test_read_only_dlpack_import_is_refused_as_output_but_viewed_as_input():
    ro = read_only([1, 2, 3])
    with pytest.raises(ValueError, match=r"^kv-canary: out is read-only; it is an output"):
        as_array(Producer(ro), "out", writable=True)
    view = as_array(Producer(ro), "inp")
    assert address(view) == address(ro) and not view.flags.writeable


def test_bfloat16_is_refused_with_the_argument_name():
    with pytest.raises(ValueError, match=r"^kv-canary: weights cannot be imported through DLPack"):
        as_array(torch.zeros(2, dtype=torch.bfloat16), "weights")


def test_a_device_that_is_neither_cpu_nor_cuda_is_refused():
    with pytest.raises(ValueError, match=r"kv-canary: x lives on DLPack device type 4, which is neither"):
        as_array(Producer(np.zeros(2), device=(4, 0)), "x")


def test_a_producer_whose_device_query_fails_is_refused():
    with pytest.raises(ValueError, match=r"kv-canary: x reports no DLPack device"):
        as_array(NoDevice(np.zeros(2)), "x")


def test_an_object_that_is_not_an_array_is_refused():
    with pytest.raises(ValueError, match=r"kv-canary: x must be an array .* got list"):
        as_array([1, 2], "x")


def test_non_contiguous_tensor_is_viewed_but_refused_by_validation():
    t = torch.arange(10, dtype=torch.int64)[::2]
    view = as_array(t, "t")
    assert address(view) == address(t) and view.strides == (16,)
    with pytest.raises(ValueError, match=r"kv-canary: t must be contiguous"):
        array_arg(t, "t", dtype=np.int64, ndim=1)


def test_wrong_dtype_is_refused_by_validation_with_both_dtypes():
    with pytest.raises(ValueError, match=r"kv-canary: t must have dtype int64, got int32"):
        array_arg(torch.zeros(2, dtype=torch.int32), "t", dtype=np.int64, ndim=1)


# --- byte rows (real-KV sources) ---------------------------------------------------------------------------

def test_byte_rows_of_a_bfloat16_tensor_are_its_bytes_in_place():
    t = torch.randn(4, 8, 16).to(torch.bfloat16)  # [slots, heads, dim]: 256 bytes per slot
    rows = as_byte_rows(t, "kv")
    assert rows.dtype == np.uint8 and rows.shape == (4, 256)
    assert address(rows) == address(t)
    assert rows.tobytes() == t.view(torch.uint8).numpy().tobytes()
    t[2].fill_(1.0)
    assert rows[2, :2].tolist() == [0x80, 0x3F]  # bfloat16 1.0 = 0x3F80, little-endian


def test_byte_rows_of_one_layer_of_a_per_layer_pool_keep_the_layer_stride():
    pool = torch.zeros(5, 3, 32, dtype=torch.bfloat16)  # [slots, layers, dim]: one layer is a strided view
    layer = pool[:, 1]
    rows = as_byte_rows(layer, "layer")
    assert rows.shape == (5, 64)
    assert rows.strides == (3 * 64, 1)
    assert address(rows) == address(pool) + 64
    pool[4, 1, 0] = 1.0
    assert rows[4, :2].tolist() == [0x80, 0x3F]
    assert rows[:4].max() == 0 and rows[4, 2:].max() == 0


def test_byte_rows_refuse_a_one_dimensional_tensor():
    with pytest.raises(ValueError, match=r"kv-canary: kv must be at least 2-D"):
        as_byte_rows(torch.zeros(8, dtype=torch.bfloat16), "kv")


def test_byte_rows_refuse_rows_that_are_not_contiguous_inside():
    t = torch.zeros(4, 16, dtype=torch.int64)[:, ::2]
    with pytest.raises(ValueError, match=r"kv-canary: kv must be contiguous within each dim-0 row"):
        as_byte_rows(t, "kv")


# --- devices -----------------------------------------------------------------------------------------------

def cuda_metadata_array(shape, dtype, device_id: int = 0):
    """A genuine ``cupy.ndarray`` reporting ``cuda:<device_id>``, built on host memory it never reads.

    Only host-side metadata (shape, dtype, strides, device) is consulted by validation, and every test below
    fails validation before a backend is chosen, so the memory behind it is never dereferenced.
    """
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import memory

    host = np.zeros(int(np.prod(shape)) or 1, dtype)
    mem = memory.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=device_id)
    return cupy.ndarray(shape, dtype, memory.MemoryPointer(mem, 0))


def test_device_of_numpy_and_of_a_cuda_array():
    assert device_of(np.zeros(1)) == CPU
    assert device_of(cuda_metadata_array((2,), np.int64, 1)) == Device("cuda", 1)
    assert str(Device("cuda", 1)) == "cuda:1" and str(CPU) == "cpu"


def test_device_of_refuses_what_is_not_numpy_or_cupy():
    with pytest.raises(TypeError):
        device_of(torch.zeros(1))


def test_same_device_accepts_one_device_and_skips_absent_arguments():
    assert same_device([("a", np.zeros(1)), ("b", None), ("c", np.zeros(2))]) == CPU
    assert same_device([("a", None)]) == CPU
    gpu = cuda_metadata_array((1,), np.int64)
    assert same_device([("a", gpu), ("b", None)]) == Device("cuda", 0)


def test_same_device_names_both_arguments_when_cpu_and_cuda_mix():
    with pytest.raises(ValueError, match=r"kv-canary: b is on cuda:0 but a is on cpu"):
        same_device([("a", np.zeros(1)), ("b", cuda_metadata_array((1,), np.int64))])


def test_same_device_names_both_arguments_when_two_gpus_mix():
    with pytest.raises(ValueError, match=r"kv-canary: b is on cuda:1 but a is on cuda:0"):
        same_device([("a", cuda_metadata_array((1,), np.int64, 0)),
                     ("b", cuda_metadata_array((1,), np.int64, 1))])


def test_cpu_tensors_and_plans_need_no_stream_scope():
    vp, _ = fresh_plans(capacity=2, write_capacity=1)
    with stream_scope(torch.zeros(1), vp, (np.zeros(1), None)) as scope:
        assert scope is None  # contextlib.nullcontext: no CuPy device or stream is entered


def plan_kwargs(**overrides):
    vp, wp = fresh_plans(capacity=8, write_capacity=2)
    kwargs = {
        "verify_plan_out": vp, "write_plan_out": wp,
        "req_pool_indices": torch.tensor([1, 2]), "prefix_lens": torch.tensor([2, 3]),
        "extend_seq_lens": torch.tensor([1, 1]), "req_to_token": torch.from_numpy(linear_rtt(4, 8)),
        "swa_window_size": 0, "full_to_swa_index_mapping": None, "verify_capacity": 8,
    }
    kwargs.update(overrides)
    return kwargs


def plan_bytes(kwargs) -> list[bytes]:
    vp, wp = kwargs["verify_plan_out"], kwargs["write_plan_out"]
    return [np.asarray(a).tobytes() for a in (*vars(vp).values(), *vars(wp).values())]


def test_plan_launch_mixing_torch_cpu_and_cuda_names_both_and_writes_nothing():
    kwargs = plan_kwargs(req_to_token=cuda_metadata_array((4, 8), np.int32))
    before = plan_bytes(kwargs)
    with pytest.raises(ValueError, match=r"kv-canary: req_to_token is on cuda:0 but req_pool_indices is on cpu"):
        kc.launch_canary_plan_kernels(**kwargs)
    assert plan_bytes(kwargs) == before


def test_plan_launch_mixing_two_gpus_names_both_and_writes_nothing():
    on0 = {name: cuda_metadata_array(tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch.")), 0)
           for name, t in plan_kwargs().items() if isinstance(t, torch.Tensor)}
    on0["full_to_swa_index_mapping"] = cuda_metadata_array((64,), np.int64, 1)
    kwargs = plan_kwargs(**on0)
    kwargs["verify_plan_out"] = kc.VerifyPlan(**{
        k: cuda_metadata_array(v.shape, v.dtype, 0) for k, v in vars(kwargs["verify_plan_out"]).items()})
    kwargs["write_plan_out"] = kc.WritePlan(**{
        k: cuda_metadata_array(v.shape, v.dtype, 0) for k, v in vars(kwargs["write_plan_out"]).items()})
    with pytest.raises(ValueError,
                       match=r"kv-canary: full_to_swa_index_mapping is on cuda:1 but req_pool_indices is on cuda:0"):
        kc.launch_canary_plan_kernels(**kwargs)


def test_numpy_subclasses_that_change_indexing_or_hide_elements_are_refused():
    values = np.arange(8, dtype=np.int64)
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: prefix_lens must be a plain array, got "
                                                     r"numpy\.ma\..*MaskedArray"):
        as_array(np.ma.masked_array(values, mask=values % 2 == 0), "prefix_lens")
    with pytest.warns(PendingDeprecationWarning):
        matrix = np.asmatrix(values.reshape(2, 4).astype(np.int32))
    with pytest.raises(kc.CanaryArgumentError, match=r"^kv-canary: req_to_token must be a plain array"):
        as_array(matrix, "req_to_token")


def test_a_memmap_is_used_in_place_as_a_plain_array(tmp_path):
    mapped = np.memmap(tmp_path / "pool.bin", dtype=np.int32, mode="w+", shape=(2, 4))
    view = as_array(mapped, "pool_out", writable=True)
    assert type(view) is np.ndarray and view.ctypes.data == mapped.ctypes.data
    view[1, 2] = 7
    assert mapped[1, 2] == 7
