"""Random bad arguments for every public entry point: each must raise ``CanaryArgumentError`` (a ``kv-canary: ``
ValueError) and leave every buffer exactly as it was, byte for byte.

Each case starts from a valid call and breaks one or two of its arguments with a mutation that is invalid by
construction (a wrong dtype, rank, length, type, alignment, contiguity, writability, an aliased output, an
out-of-range scalar, a NumPy subclass, a DLPack producer that fails...). Launchers are called through the
NumPy and host backends and through ``bind_*``; the allocators, ``from_tensors``, ``RealKvSource``,
``for_endpoint``, ``read_violations``, the DLPack bridge and the SGLang compat layer get their own catalogues.
The plan and the received-prefix verify run under each slot layout (``kvcanary_cupy.layouts``), the record transfer
(``kvcanary_cupy.transfer``) like a launcher, and the engine runtime (``kvcanary_cupy.runtime``) is created
from broken configurations and pools and fed broken batches. Thousands of cases per run, drawn from a fixed
seed.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.bind import bind_plan, bind_scatter, bind_verify, bind_write
from kvcanary_cupy.dlpack import as_array, as_byte_rows, export
from kvcanary_cupy.layouts import BlockTable, PageList, TokenTable
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch
from kvcanary_cupy.transfer import ReceivedPrefixVerifier, gather_canary_records, scatter_canary_records

try:
    import torch
except ImportError:  # torch is an optional dependency
    torch = None

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
BACKENDS = ["numpy"] + ([] if unavailable_reason("host") else ["host"])
# Without a usable GPU, asking for one is a bad argument like any other.
NO_GPU_DEVICES = ["cuda", "cuda:0"] if unavailable_reason("cuda") else []


# ---- what a case checks --------------------------------------------------------------------------------------

def _arrays(value: Any) -> list[Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [a for f in dataclasses.fields(value) for a in _arrays(getattr(value, f.name))]
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays(v)]
    if isinstance(value, ReceivedPrefixVerifier):  # its plans: scratch a refused verify must not touch either
        return _arrays([value.plan, value._write_plan, value._no_extend])
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays(v)]
    if isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor)):
        return [value]
    return []


def _bytes(arr: Any) -> bytes:
    if isinstance(arr, np.ndarray):
        return np.asarray(arr).tobytes()
    if arr.layout != torch.strided or arr.device.type == "meta":  # no plain memory to compare
        return repr((arr.layout, arr.device, tuple(arr.shape))).encode()
    if arr.untyped_storage().nbytes() == 0:
        return b""
    return arr.detach().contiguous().numpy().tobytes()


def refuses(call: Callable[[], Any], watched: Any, what: str, names: tuple[str, ...] = (),
            never: tuple[str, ...] = ()) -> None:
    """``call()`` raises CanaryArgumentError naming something (one of ``names`` when given: the caller's
    arguments the case broke; none of ``never``: names the caller never used), and no watched buffer changed."""
    arrays = _arrays(watched)
    before = [_bytes(a) for a in arrays]
    try:
        call()
    except kc.CanaryArgumentError as exc:
        message = str(exc)
        assert message.startswith("kv-canary: ") and len(message) > len("kv-canary: ") + 10, what
        assert not names or any(n in message for n in names), f"{what}: names none of {names}: {message}"
        assert not any(n in message for n in never), f"{what}: names what the caller never passed: {message}"
    except Exception as exc:  # anything else is a leak of the contract
        raise AssertionError(f"{what}: {type(exc).__name__}: {exc}") from exc
    else:
        raise AssertionError(f"{what}: accepted")
    after = [_bytes(a) for a in arrays]
    assert before == after, f"{what}: a refused call changed a buffer"


# ---- bad values --------------------------------------------------------------------------------------------

class _FailingDlpack:
    """A DLPack producer whose export fails (as a producer refusing a stream or a dtype does)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise BufferError("export refused")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _NoDevice:
    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise BufferError("never called")

    def __dlpack_device__(self) -> tuple[int, int]:
        raise RuntimeError("no device")


class _WeirdDevice(_NoDevice):
    def __dlpack_device__(self) -> tuple[int, int]:
        return (7, 0)  # neither CPU nor CUDA


class _NonCapsule:
    """A producer whose ``__dlpack__`` returns something other than a capsule (it lies about what it is)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.value

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _JunkDevice(_NonCapsule):
    """A producer whose ``__dlpack_device__`` answers junk (not a pair of ints); its export would be valid."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return np.zeros(4, np.int64).__dlpack__()

    def __dlpack_device__(self) -> Any:
        return self.value


LYING_PRODUCERS = [_NonCapsule(None), _NonCapsule("capsule"), _NonCapsule(np.zeros(3)), _JunkDevice(None),
                   _JunkDevice("ab"), _JunkDevice(("1", 0)), _JunkDevice((1.5, 0)), _JunkDevice((1,)),
                   _JunkDevice(np.array([1, 0])), _JunkDevice((True, 0)), _JunkDevice((1, 0, 0))]


def _torch_unreadable(arr: np.ndarray) -> list[tuple[str, Any]]:
    """Torch tensors no launcher can read as plain memory: sparse and meta (no data at all)."""
    if torch is None or not arr.dtype.isnative:
        return []
    dense = torch.from_numpy(arr.copy())
    cases = [("torch meta", dense.to("meta"))]
    if arr.dtype in (np.int32, np.int64, np.uint8):  # the dtypes torch can make sparse and launchers take
        cases.append(("torch sparse", dense.to_sparse()))
    return cases


BAD_SCALARS = [None, "3", 1.5, np.float64(2.0), True, False, 2**63, 2**64, -(2**63) - 1, 10**30, [1], object(),
               np.array([1])]


def _misaligned(arr: np.ndarray) -> np.ndarray:
    raw = np.zeros(arr.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + (arr.dtype.itemsize // 2 or 1)
    out = raw[start:start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    return out


def bad_arrays(arr: np.ndarray, *, output: bool, rng: random.Random) -> list[tuple[str, Any]]:
    """Replacements for a valid array argument, each invalid whatever the rest of the call."""
    other_dtype = np.int16  # no argument takes int16: a second mutation cannot land on a valid dtype
    arr = arr.astype(arr.dtype.newbyteorder("="))  # a second mutation of a big-endian array starts from native
    cases: list[tuple[str, Any]] = [
        ("None", None), ("list", arr.tolist()), ("string", "array"), ("int", 3), ("object", object()),
        ("dtype", arr.astype(other_dtype)), ("float", arr.astype(np.float64)), ("uint64", arr.astype(np.uint64)),
        ("bool", arr.astype(bool)), ("rank+1", arr[None]), ("0-d", np.array(arr.reshape(-1)[0] if arr.size else 0,
                                                                         arr.dtype)),
        ("misaligned", _misaligned(arr)), ("failing dlpack", _FailingDlpack()), ("no device", _NoDevice()),
        ("weird device", _WeirdDevice()), ("masked", np.ma.masked_array(arr)),
        ("lying producer", rng.choice(LYING_PRODUCERS)), *_torch_unreadable(arr),
    ]
    if arr.dtype.itemsize > 1:  # one byte has no byte order
        cases.append(("big-endian", arr.astype(arr.dtype.newbyteorder(">"))))
    if arr.ndim == 2:
        cases.append(("matrix", np.asmatrix(arr)))
        cases.append(("rank-1", arr.reshape(-1)))
    if arr.ndim == 2 or (arr.ndim == 1 and arr.shape[0] > 1):
        strided = np.repeat(arr, 2, axis=arr.ndim - 1)[..., ::2]
        cases.append(("strided", strided))
    if output:
        ro = arr.copy()
        ro.flags.writeable = False
        cases.append(("read-only", ro))
    if torch is not None:
        cases.append(("torch dtype", torch.from_numpy(arr.astype(other_dtype))))
        if arr.ndim == 1 and arr.shape[0] > 1:
            cases.append(("torch expanded", torch.from_numpy(arr[:1].copy()).expand(arr.shape[0])))
    return cases


# ---- launchers -----------------------------------------------------------------------------------------------

def _plan_call() -> dict[str, Any]:
    rtt = (np.arange(4 * 8, dtype=np.int32) + 1).reshape(4, 8)
    return {
        "verify_plan_out": kc.VerifyPlan.allocate(verify_capacity=16),
        "write_plan_out": kc.WritePlan.allocate(write_req_capacity=3),
        "req_pool_indices": np.array([1, 2], np.int64), "prefix_lens": np.array([3, 2], np.int64),
        "extend_seq_lens": np.array([1, 2], np.int64), "req_to_token": rtt, "swa_window_size": 0,
        "full_to_swa_index_mapping": None, "verify_capacity": 16,
        "req_to_verify_expected_tokens": np.zeros((4, 8), np.int32),
        "req_to_verify_expected_tokens_valid_lens": np.array([4, 4], np.int64), "kv_token_id_vs_position_offset": 0,
    }


def _context() -> kc.VerifyOrWriteContext:
    source = kc.RealKvSource(np.zeros((32, 32), np.uint8), page_size=1, num_bytes_per_token=32, read_bytes=32)
    return kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=8, real_kv_sources=(source,),
                                            real_kv_hash_mode=kc.RealKvHashMode.ALL)


def _verify_call() -> dict[str, Any]:
    vp = kc.VerifyPlan.allocate(verify_capacity=4)
    vp.verify_slot_indices[:] = [1, 2, 3, 0]
    vp.verify_expected_positions[:] = [0, 1, 2, 0]
    vp.verify_prev_slot_indices[:] = [-1, 1, 2, 0]
    vp.verify_expected_tokens[:] = -1
    vp.verify_num_valid[0] = 3
    return {"context": _context(), "plan": vp, "check_verify_expected_token": True}


def _verify_twin_call() -> dict[str, Any]:
    """A verify with a twin buffer (HEAD V after HEAD K): a second buffer of the context's shape."""
    call = _verify_call()  # a twin needs a context without real-KV hashing (HEAD's)
    call["context"] = call["context"].for_endpoint(real_kv_hash_mode=kc.RealKvHashMode.NONE, real_kv_sources=())
    call["twin_canary_buf"] = np.zeros_like(call["context"].canary_buf)
    return call


def _write_call() -> dict[str, Any]:
    wp = kc.WritePlan.allocate(write_req_capacity=2)
    wp.write_offsets[:] = [0, 2, 3]
    wp.write_seed_slot_indices[:] = [-1, 5]
    wp.write_num_valid_reqs[0] = 2
    return {"context": _context(), "plan": wp, "input_ids": np.array([7, 8, 9], np.int64),
            "positions": np.array([0, 1, 4], np.int64), "out_cache_loc": np.array([1, 2, 3], np.int64),
            "enable_write_input_assert": True, "expected_input_tokens": np.array([7, 8, 9], np.int64),
            "expected_input_positions": np.array([0, 1, 4], np.int64)}


def _scatter_call() -> dict[str, Any]:
    return {"flat_in": np.arange(6, dtype=np.int64), "offsets": np.array([0, 4, 6], np.int64),
            "req_pool_indices": np.array([1, 2], np.int64), "pool_out": np.zeros((4, 8), np.int32),
            "status": np.zeros(1, np.int32)}


def _plan_blocks_call() -> dict[str, Any]:
    call = _plan_call()
    del call["req_to_token"]
    table = np.array([[0, 0, 0, 0], [3, 1, 0, 0], [2, 5, 4, 0], [0, 0, 0, 0]], np.int32)
    call["layout"] = BlockTable(table, block_size=2, block_stride=3, num_slots=64)
    return call


def _plan_pages_call() -> dict[str, Any]:
    call = _plan_call()
    del call["req_to_token"]
    call["layout"] = PageList(np.array([0, 2, 4], np.int32), np.array([3, 1, 2, 5], np.int32), page_size=2,
                              num_slots=64)
    return call


def _received_call() -> dict[str, Any]:
    verifier = ReceivedPrefixVerifier(verify_capacity=16, max_requests=3)
    verifier.plan.verify_slot_indices[:] = 9  # a previous verify's plan, which a refused call must keep
    return {"verifier": verifier, "context": _context(), "req_pool_indices": np.array([1, 2], np.int64),
            "received_lens": np.array([3, 2], np.int64),
            "req_to_token": (np.arange(4 * 8, dtype=np.int32) % 31 + 1).reshape(4, 8),
            "req_to_verify_expected_tokens": np.zeros((4, 8), np.int32),
            "req_to_verify_expected_tokens_valid_lens": np.array([3, 2], np.int64),
            "kv_token_id_vs_position_offset": 0, "swa_window_size": 0, "full_to_swa_index_mapping": None}


def _received_blocks_call() -> dict[str, Any]:
    call = _received_call()
    del call["req_to_token"]
    table = np.array([[0, 0, 0, 0], [3, 1, 0, 0], [2, 5, 4, 0], [0, 0, 0, 0]], np.int32)
    call["layout"] = BlockTable(table, block_size=2, block_stride=3, num_slots=32)
    return call


def _received_pages_call() -> dict[str, Any]:
    call = _received_call()
    del call["req_to_token"], call["req_pool_indices"]  # CSR pages are in batch order
    call["layout"] = PageList(np.array([0, 2, 3], np.int32), np.array([3, 1, 5], np.int32), page_size=2,
                              num_slots=32)
    return call


def _received_verify(verifier: ReceivedPrefixVerifier, **kwargs: Any) -> None:
    verifier.verify(**kwargs)


def _gather_call() -> dict[str, Any]:
    canary = (np.arange(8 * 40) % 251).astype(np.uint8).reshape(8, 40)
    return {"canary_buf": canary, "slots": np.array([1, 5, 2], np.int64), "records_out": np.zeros((3, 4), np.int64),
            "status": np.zeros(1, np.int32)}


def _scatter_records_call() -> dict[str, Any]:
    return {"records": np.arange(12, dtype=np.int64).reshape(3, 4), "slots": np.array([1, 5, 2], np.int64),
            "canary_buf": np.zeros((8, 32), np.uint8), "status": np.zeros(1, np.int32)}


LAUNCHERS = {
    "plan": (_plan_call, kc.launch_canary_plan_kernels, bind_plan),
    "plan-blocks": (_plan_blocks_call, kc.launch_canary_plan_kernels, bind_plan),
    "plan-pages": (_plan_pages_call, kc.launch_canary_plan_kernels, bind_plan),
    "verify": (_verify_call, kc.launch_canary_verify_kernel, bind_verify),
    "verify-twin": (_verify_twin_call, kc.launch_canary_verify_kernel, bind_verify),
    "write": (_write_call, kc.launch_canary_write_kernel, bind_write),
    "scatter": (_scatter_call, kc.launch_scatter_req_token_ids, bind_scatter),
    # the record transfer and the received-prefix verify have no bind_* (each call converts its arguments)
    "gather-records": (_gather_call, gather_canary_records, None),
    "scatter-records": (_scatter_records_call, scatter_canary_records, None),
    "received": (_received_call, _received_verify, None),
    "received-blocks": (_received_blocks_call, _received_verify, None),
    "received-pages": (_received_pages_call, _received_verify, None),
}
# Cases per launcher: the layouts and the transfer add about as many as one core launcher.
CASES = {"plan": 1500, "verify": 1500, "verify-twin": 500, "write": 1500, "scatter": 1500, "plan-blocks": 700,
         "plan-pages": 700, "gather-records": 500, "scatter-records": 500, "received": 500, "received-blocks": 400,
         "received-pages": 400}
# Fields a launch neither reads nor writes (SPEC §0.7: only what is read is checked).
NOT_READ = {"verify": (("context", "enable_chain_position_assert"), ("plan", "status")),
            "verify-twin": (("context", "enable_chain_position_assert"), ("plan", "status")),
            "write": (("plan", "verify_offsets"),),
            **{step: (("context", "enable_chain_position_assert"),)
               for step in ("received", "received-blocks", "received-pages")}}
OPTIONAL_ARRAYS = {"verify-twin": ("twin_canary_buf",),
                   "plan": ("req_to_verify_expected_tokens",), "plan-blocks": ("req_to_verify_expected_tokens",),
                   "plan-pages": ("req_to_verify_expected_tokens", "req_pool_indices"), "scatter": ("status",),
                   "gather-records": ("status",), "scatter-records": ("status",),
                   "received": ("req_to_verify_expected_tokens",),
                   "received-blocks": ("req_to_verify_expected_tokens",),
                   "received-pages": ("req_to_verify_expected_tokens", "req_pool_indices")}
SCALARS = {"swa_window_size", "verify_capacity", "check_verify_expected_token", "enable_write_input_assert",
           "kv_token_id_vs_position_offset"}
OUTPUT_FIELDS = {"verify_plan_out", "write_plan_out", "pool_out", "status"}
STEP_OUTPUTS = {"gather-records": {"records_out"}, "scatter-records": {"canary_buf"}}
LAYOUTS = (TokenTable, BlockTable, PageList)
# Values no layout field accepts (None is valid for the optional ones, so it is not among them).
BAD_LAYOUT_SCALARS = {
    "block_size": [0, -2, 2**31, 1.5, True, "2", np.array([2]), 2**64],
    "block_stride": [1, 0, -3, 2**31, 1.5, False, "3", 2**63],
    "batch_rows": [1, 0, "yes", 2.0, np.array([True]), None],
    "num_slots": [-1, 1.5, True, "64", 2**63, 10**30, object()],
    "page_size": [0, -1, 2**31, 2.0, True, None, 2**64],
}
CONTEXT_OUTPUTS = {"canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                   "kernel_run_counter", "status"}


def _array_slots(step: str, call: dict[str, Any]) -> list[tuple[str, str | None, bool]]:
    """(argument, field or None, is output) for every array a launcher takes."""
    slots = []
    outputs = STEP_OUTPUTS.get(step, OUTPUT_FIELDS)
    for name, value in call.items():
        if isinstance(value, np.ndarray):
            slots.append((name, None, name in outputs | {"status"}))
        elif isinstance(value, LAYOUTS):
            slots += [(name, f.name, False) for f in dataclasses.fields(value)
                      if isinstance(getattr(value, f.name), np.ndarray)]
        elif isinstance(value, (kc.VerifyPlan, kc.WritePlan)):
            output = name in OUTPUT_FIELDS
            slots += [(name, f.name, output) for f in dataclasses.fields(value)]
        elif isinstance(value, kc.VerifyOrWriteContext):
            slots += [(name, f, f in CONTEXT_OUTPUTS) for f in (*CONTEXT_OUTPUTS, "enable_chain_position_assert")]
    return slots


def _get(call: dict[str, Any], arg: str, field: str | None) -> Any:
    return call[arg] if field is None else getattr(call[arg], field)


def _set(call: dict[str, Any], arg: str, field: str | None, value: Any) -> None:
    if field is None:
        call[arg] = value
    else:
        call[arg] = dataclasses.replace(call[arg], **{field: value})


def _alias(target: np.ndarray, other: np.ndarray) -> np.ndarray:
    """An array shaped like ``target`` over the first bytes of ``other`` (same memory, any dtypes)."""
    return other.reshape(-1).view(np.uint8)[: target.nbytes].view(target.dtype).reshape(target.shape)


def _mutate_launch(step: str, call: dict[str, Any], rng: random.Random) -> str:
    """Break ``call`` in place with one invalid change; returns what was done."""
    choice = rng.random()
    slots = [s for s in _array_slots(step, call) if (s[0], s[1]) not in NOT_READ.get(step, ())]
    outputs = [s for s in slots if s[2] and isinstance(_get(call, *s[:2]), np.ndarray)]
    if choice < 0.12 and outputs:  # an output sharing memory with another array of the launch
        arg, field, _ = rng.choice(outputs)
        target = _get(call, arg, field)
        others = [s for s in slots if s[:2] != (arg, field) and type(_get(call, *s[:2])) is np.ndarray
                  and _get(call, *s[:2]).nbytes >= target.nbytes and _get(call, *s[:2]).flags.c_contiguous
                  # the received-prefix verify runs two launches in turn: the verify's context may share
                  # memory with what the plan launch read before it (no race); within the verify it may not
                  and (not step.startswith("received") or s[0] == arg)]
        if others:
            o_arg, o_field, _ = rng.choice(others)
            _set(call, arg, field, _alias(target, _get(call, o_arg, o_field)))
            return f"{arg}.{field} aliased with {o_arg}.{o_field}"
    layouts = [n for n in call if isinstance(call[n], LAYOUTS)]
    if choice < 0.2 and layouts:
        return _mutate_layout(call, rng)
    if choice < 0.25:
        scalars = [n for n in call if n in SCALARS] + ["backend", "on_invalid"]
        name = rng.choice(scalars)
        if name == "backend":
            call["backend"] = rng.choice(["gpu", "", 3, None, "NUMPY", "auto ", ["numpy"]])
        elif name == "on_invalid":
            call["on_invalid"] = rng.choice(["ignore", 1, True])
        elif name in ("check_verify_expected_token", "enable_write_input_assert"):
            call[name] = rng.choice([1, 0, "yes", None, 2.0, np.array([True])])
        elif name == "kv_token_id_vs_position_offset":
            call[name] = rng.choice([2**31, -(2**31) - 1, None, "0", 1.5, True, 2**64])
        else:
            call[name] = rng.choice([-1, *BAD_SCALARS]) if name != "swa_window_size" else rng.choice(
                [-1, None, "0", 1.5, True, 2**63, 10**30, object()])
            if name == "verify_capacity" and call[name] is None:
                call[name] = 17  # differs from the plan's capacity
        return f"{name}={call[name]!r}"
    if choice < 0.3 and step == "write":
        call["expected_input_tokens"] = None if rng.random() < 0.5 else call["expected_input_tokens"]
        if call["expected_input_tokens"] is not None:
            call["enable_write_input_assert"] = False
        return "input assert and expected tensors disagree"
    if choice < 0.3 and step.startswith("received"):
        call["req_pool_indices"] = np.ones(5, np.int64)  # more requests than the verifier was sized for
        call["received_lens"] = np.ones(5, np.int64)
        return "more requests than max_requests"
    if choice < 0.3 and "canary_buf" in call and isinstance(call["canary_buf"], np.ndarray):
        call["canary_buf"] = rng.choice([np.zeros((8, 24), np.uint8), np.zeros((8, 36), np.uint8),
                                         np.zeros((0, 32), np.uint8), np.zeros((8, 4), np.int64)])
        return f"canary_buf {call['canary_buf'].dtype}{call['canary_buf'].shape}"
    objects = [n for n in call if isinstance(call[n], (kc.VerifyPlan, kc.WritePlan, kc.VerifyOrWriteContext,
                                                       *LAYOUTS))]
    if choice < 0.34 and objects:
        arg = rng.choice(objects)
        call[arg] = rng.choice([None, {}, object(), np.zeros(3, np.int64), "plan"])
        return f"{arg} is not the right object"
    arrays = [s for s in slots if isinstance(_get(call, *s[:2]), np.ndarray)]
    if not arrays:  # a first mutation replaced every array-holding object
        call["backend"] = "gpu"
        return "backend='gpu'"
    arg, field, output = rng.choice(arrays)
    bad = bad_arrays(_get(call, arg, field), output=output, rng=rng)
    if arg in OPTIONAL_ARRAYS.get(step, ()):  # None is a valid value for these
        bad = [b for b in bad if b[0] != "None"]
    label, value = rng.choice(bad)
    _set(call, arg, field, value)
    return f"{arg}.{field}: {label}"


def _mutate_layout(call: dict[str, Any], rng: random.Random) -> str:
    """A layout scalar no launch accepts, a second layout source, a missing row selector or too few rows."""
    layout = call["layout"]
    kind = rng.random()
    if kind < 0.15:
        call["req_to_token"] = np.zeros((4, 8), np.int32)
        return "both req_to_token and layout"
    if kind < 0.3 and isinstance(layout, BlockTable):
        if rng.random() < 0.5:
            call["layout"] = dataclasses.replace(layout, batch_rows=True, block_table=layout.block_table[:1].copy())
            return "batch_rows=True with fewer table rows than the batch"
        call["req_pool_indices"] = None
        return "BlockTable(batch_rows=False) without req_pool_indices"
    if kind < 0.3 and isinstance(layout, PageList):
        call["layout"] = dataclasses.replace(layout, kv_page_indptr=np.array([0, 2, 4, 4], np.int32))
        return "kv_page_indptr of bs + 2 entries"
    names = [f.name for f in dataclasses.fields(layout) if f.name in BAD_LAYOUT_SCALARS]
    name = rng.choice(names)
    value = rng.choice(BAD_LAYOUT_SCALARS[name])
    call["layout"] = dataclasses.replace(layout, **{name: value})
    return f"layout.{name}={value!r}"


@pytest.mark.parametrize("step", list(LAUNCHERS))
def test_launchers_and_bind_refuse_random_bad_arguments_and_write_nothing(step):
    make, launch, bind = LAUNCHERS[step]
    rng = random.Random(f"launch-{step}")
    for case in range(CASES[step]):
        call = make()
        watched = dict(call)  # the valid buffers, which no refused call may change
        what = _mutate_launch(step, call, rng)
        if rng.random() < 0.3:
            what += "; " + _mutate_launch(step, call, rng)
        backend = rng.choice(BACKENDS)
        if "backend" not in call:
            call["backend"] = backend
        entry = bind if case % 3 == 0 and bind is not None else launch
        refuses(lambda entry=entry, call=call: entry(**call), [watched, call], f"{step} case {case}: {what}")


def test_a_valid_call_of_each_launcher_is_accepted():
    """The baselines the mutations start from are valid (so every refusal above is the mutation's doing)."""
    for step, (make, launch, bind) in LAUNCHERS.items():
        for backend in BACKENDS:
            launch(**make(), backend=backend)
            if bind is not None:
                bind(**make(), backend=backend)()
        assert step


# ---- constructors, endpoints, ring reading ---------------------------------------------------------------------

def _constructor_cases(rng: random.Random) -> tuple[Callable[[], Any], Any, str]:
    kind = rng.randrange(10)
    if kind == 9:
        key = rng.choice(["verify_capacity", "max_requests", "device"])
        value = {"verify_capacity": [0, -1, 2**31, *BAD_SCALARS], "max_requests": [0, -3, 2**62, *BAD_SCALARS],
                 "device": ["gpu", None, 7, "cuda:one", *NO_GPU_DEVICES]}[key]
        args = {"verify_capacity": 8, "max_requests": 2, key: rng.choice(value)}
        return lambda: ReceivedPrefixVerifier(**args), None, f"ReceivedPrefixVerifier {args}"
    if kind == 0:
        key = rng.choice(["verify_capacity", "device"])
        value = rng.choice([*BAD_SCALARS, 0, -5]) if key == "verify_capacity" else rng.choice(
            ["gpu", "cuda:x", "tpu:0", 3, None, "cpu:", *NO_GPU_DEVICES])
        args = {"verify_capacity": 8, key: value}
        return lambda: kc.VerifyPlan.allocate(**args), None, f"VerifyPlan.allocate {args}"
    if kind == 1:
        key = rng.choice(["write_req_capacity", "device"])
        devices = ["gpu", 0, "cuda:-1", *NO_GPU_DEVICES]
        value = rng.choice([*BAD_SCALARS, 0, -1]) if key == "write_req_capacity" else rng.choice(devices)
        args = {"write_req_capacity": 4, key: value}
        return lambda: kc.WritePlan.allocate(**args), None, f"WritePlan.allocate {args}"
    if kind == 2:
        key = rng.choice(["num_slots", "ring_capacity", "kernel_kind", "real_kv_sources", "real_kv_hash_mode",
                          "slot_stride_bytes", "enable_chain_position_assert", "device"])
        value = {
            "num_slots": [0, -1, *BAD_SCALARS, 2**62], "ring_capacity": [0, *BAD_SCALARS],
            "kernel_kind": [None, "HEAD", 1.5, 2**64, object()],
            "real_kv_sources": [None, 3, [None], ("source",), (object(),) * 5],
            "real_kv_hash_mode": [7, -1, "ALL", None, 1.0, True],
            "slot_stride_bytes": [31, 36, 0, *BAD_SCALARS], "enable_chain_position_assert": [1, "yes", None],
            "device": ["gpu", 7, "cuda:zero", *NO_GPU_DEVICES],
        }[key]
        args = {"num_slots": 8, key: rng.choice(value)}
        return lambda: kc.VerifyOrWriteContext.allocate(**args), None, f"VerifyOrWriteContext.allocate {args}"
    if kind == 3:
        vp = kc.VerifyPlan.allocate(verify_capacity=4)
        fields = {f.name: getattr(vp, f.name) for f in dataclasses.fields(vp)}
        change = rng.choice(["unknown", "missing", "template"])
        if change == "unknown":
            fields["verify_slots"] = fields.pop("verify_slot_indices")
        elif change == "missing":
            fields.pop(rng.choice([k for k in fields if k != "status"]))
        else:
            fields["status"] = None
            fields["verify_num_valid"] = rng.choice([None, object(), [0], _FailingDlpack()])
        return lambda: kc.VerifyPlan.from_tensors(**fields), vp, f"VerifyPlan.from_tensors {change}"
    if kind == 4:
        wp = kc.WritePlan.allocate(write_req_capacity=4)
        fields = {f.name: getattr(wp, f.name) for f in dataclasses.fields(wp)}
        fields["verify_offsets"] = None
        fields["write_offsets"] = rng.choice([None, object(), [0, 1], np.zeros((2, 3), np.int64), _NoDevice()])
        if rng.random() < 0.3:
            fields["offsets"] = fields.pop("write_seed_slot_indices")
        return lambda: kc.WritePlan.from_tensors(**fields), wp, "WritePlan.from_tensors"
    if kind == 5:
        key = rng.choice(["tensor", "page_size", "num_bytes_per_token", "read_bytes"])
        args: dict[str, Any] = {"tensor": np.zeros((8, 64), np.uint8), "page_size": 2, "num_bytes_per_token": 32,
                                "read_bytes": 32}
        if key == "tensor":
            args["tensor"] = rng.choice([None, [1, 2], np.zeros(64, np.uint8), np.zeros((0, 64), np.uint8),
                                         np.zeros((8, 40), np.uint8)[:, :32], _misaligned(np.zeros((8, 64), np.uint8)),
                                         np.asmatrix(np.zeros((8, 64), np.uint8)), _FailingDlpack(),
                                         np.zeros((8, 16), np.uint8)])
        else:
            args[key] = rng.choice([0, -16, 24, 48, *BAD_SCALARS])
        return lambda: kc.RealKvSource(**args), args, f"RealKvSource {key}"
    if kind == 6:
        ctx = _context()
        change = rng.choice([{"kernel": 1}, {"kernel_kind": "x"}, {"kernel_kind": 2**70}, {"real_kv_hash_mode": 9},
                             {"real_kv_sources": None}, {"real_kv_sources": (1, 2)}, {"bogus": 3}])
        return lambda: ctx.for_endpoint(**change), ctx, f"for_endpoint {change}"
    if kind == 7:
        ctx = _context()
        change = rng.choice(["start", "context", "ring", "index"])
        if change == "start":
            start = rng.choice([None, "1", 1.5, 2**64, [0]])
            return lambda: kc.read_violations(ctx, start), ctx, f"read_violations start={start!r}"
        if change == "context":
            other = rng.choice([None, object(), {"violation_ring": ctx.violation_ring}, ctx.violation_ring])
            return lambda: kc.read_violations(other), ctx, "read_violations context"
        field = "violation_ring" if change == "ring" else "violation_write_index"
        bad = rng.choice([None, np.zeros((4, 7), np.int64), np.zeros(2, np.int32), np.zeros((4, 8), np.float64)])
        broken = dataclasses.replace(ctx, **{field: bad})
        return lambda: kc.read_violations(broken), ctx, f"read_violations {field}"
    name = rng.choice(["as_array", "as_byte_rows", "export"])
    if name == "as_array":
        obj = rng.choice([None, 3, "x", [1], _FailingDlpack(), _NoDevice(), _WeirdDevice(),
                          np.ma.masked_array([1, 2]), np.asmatrix([[1]])])
        return lambda: as_array(obj, "arg"), None, f"as_array {type(obj).__name__}"
    if name == "as_byte_rows":
        obj = rng.choice([np.zeros(4), np.zeros((0, 4)), np.zeros((4, 8))[:, ::2], np.asmatrix(np.zeros((2, 2))),
                          _FailingDlpack(), None])
        return lambda: as_byte_rows(obj, "arg"), None, "as_byte_rows"
    to = rng.choice([object(), np, None, "torch"])
    arr = rng.choice([[1, 2], None, "x"]) if to is np else np.zeros(3)
    return lambda: export(arr, to), None, f"export to {to!r}"


def test_constructors_endpoints_ring_reading_and_the_bridge_refuse_random_bad_arguments():
    rng = random.Random("constructors")
    for case in range(2500):
        call, watched, what = _constructor_cases(rng)
        refuses(call, watched, f"case {case}: {what}")


# ---- the SGLang compat layer -----------------------------------------------------------------------------------

@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_the_compat_layer_refuses_random_bad_arguments_and_writes_nothing():
    from kvcanary_cupy.compat import sglang

    rng = random.Random("compat")
    for case in range(1000):
        kind = rng.randrange(5)
        if kind == 0:
            cls = rng.choice([sglang.VerifyPlan, sglang.WritePlan, sglang.VerifyOrWriteContext])
            key = {"VerifyPlan": "verify_capacity", "WritePlan": "write_req_capacity",
                   "VerifyOrWriteContext": "num_slots"}[cls.__name__]
            args = {key: 8, "device": rng.choice(["cuda", "cuda:3", "gpu", 5, "tpu"])}
            if rng.random() < 0.5:
                args = {key: rng.choice([0, -1, 2**64, "8", 1.5, True])}
            refuses(lambda cls=cls, args=args: cls.allocate(**args), None, f"case {case}: {cls.__name__} {args}")
            continue
        vp = sglang.VerifyPlan.allocate(verify_capacity=16)
        wp = sglang.WritePlan.allocate(write_req_capacity=4)
        vp.zero_for_testing_()
        wp.zero_for_testing_()
        args = {"verify_plan_out": vp, "write_plan_out": wp, "req_pool_indices": torch.tensor([1, 2]),
                "prefix_lens": torch.tensor([3, 1]), "extend_seq_lens": torch.tensor([1, 1]),
                "req_to_token": torch.arange(32, dtype=torch.int32).reshape(4, 8), "swa_window_size": 0,
                "full_to_swa_index_mapping": None, "verify_capacity": 16, "req_to_verify_expected_tokens": None,
                "req_to_verify_expected_tokens_valid_lens": None, "kv_token_id_vs_position_offset": 0}
        watched = [vp, wp, dict(args)]
        if kind == 1:  # the torch reference: an output that cannot take its result, or a bad input
            change = rng.choice(["expanded", "aliased", "rtt", "offset", "pool", "window"])
            if change == "expanded":
                field = rng.choice(["verify_expected_tokens", "verify_slot_indices"])
                args["verify_plan_out"] = dataclasses.replace(vp, **{field: torch.zeros(1, dtype=torch.int64)
                                                                     .expand(16)})
            elif change == "aliased":
                args["verify_plan_out"] = dataclasses.replace(vp, verify_expected_positions=vp.verify_slot_indices)
            elif change == "rtt":
                args["req_to_token"] = torch.full((4, 8), 2**40, dtype=torch.int64)
            elif change == "offset":
                args["kv_token_id_vs_position_offset"] = rng.choice([2**31, "0", None])
            elif change == "pool":
                args["req_to_verify_expected_tokens"] = torch.zeros(4, 8, dtype=torch.int32)
            else:
                args["swa_window_size"] = 4
            refuses(lambda args=args: sglang.launch_canary_plan_kernels_torch_reference(**args), watched,
                    f"case {case}: torch reference {change}")
            continue
        if kind == 4:  # a slot layout through either compat plan entry
            entry = rng.choice([sglang.launch_canary_plan_kernels, sglang.launch_canary_plan_kernels_torch_reference])
            # the torch reference reads every input as int64 like SGLang's (a float table is converted)
            args["layout"], change = _bad_torch_layout(rng, converts=entry is not sglang.launch_canary_plan_kernels)
            if change != "both":  # with both, req_to_token stays next to a valid TokenTable
                args["req_to_token"] = None
            watched.append(args["layout"])
            refuses(lambda args=args, entry=entry: entry(**args), watched,
                    f"case {case}: {entry.__name__} layout {change}")
            continue
        if kind == 2:
            key = rng.choice(["req_pool_indices", "prefix_lens", "req_to_token", "verify_capacity"])
            args[key] = rng.choice([args[key].to(torch.float32) if key != "verify_capacity" else 0,
                                    None if key != "verify_capacity" else 2**64, [1, 2]])
            refuses(lambda args=args: sglang.launch_canary_plan_kernels(**args), watched,
                    f"case {case}: compat plan {key}")
            continue
        ctx = sglang.VerifyOrWriteContext.allocate(num_slots=16, ring_capacity=4)
        pool = torch.zeros(4, 8, dtype=torch.int32)
        bad = _compat_launcher_case(rng.randrange(4), sglang, ctx, pool, vp, wp)
        refuses(bad, [ctx, pool, vp, wp], f"case {case}: compat launcher")


def _bad_torch_layout(rng: random.Random, *, converts: bool) -> tuple[Any, str]:
    """A torch-tensor layout that the compat plan entries refuse (``converts``: the entry reads every integer
    or float tensor as int64), and what is wrong with it."""
    table = torch.tensor([[0, 0, 0, 0], [3, 1, 0, 0], [2, 5, 4, 0], [0, 0, 0, 0]], dtype=torch.int32)
    indptr, indices = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([3, 1, 2], dtype=torch.int32)
    changes = ["table rank", "table beyond int32", "block size", "stride", "rows", "indptr length", "indices 2-D",
               "page size", "num_slots", "not a layout", "both"]
    change = rng.choice(changes if converts else [*changes, "table dtype", "indptr float"])
    layout: Any = {
        "table dtype": lambda: BlockTable(table.to(torch.float32), block_size=2),
        "table rank": lambda: BlockTable(table.reshape(-1), block_size=2),
        "table beyond int32": lambda: BlockTable(table.to(torch.int64) + 2**40, block_size=2),
        "block size": lambda: BlockTable(table, block_size=rng.choice([0, -1, 2**40, 1.5, True])),
        "stride": lambda: BlockTable(table, block_size=2, block_stride=1),
        "rows": lambda: BlockTable(table[:1], block_size=2, batch_rows=True),
        "indptr length": lambda: PageList(indptr[:2], indices, page_size=2),
        "indptr float": lambda: PageList(indptr.to(torch.float64), indices, page_size=2),
        "indices 2-D": lambda: PageList(indptr, indices.reshape(1, 3), page_size=2),
        "page size": lambda: PageList(indptr, indices, page_size=rng.choice([0, 2**31, None, "2"])),
        "num_slots": lambda: PageList(indptr, indices, page_size=2, num_slots=rng.choice([-1, 2**63, 2.0])),
        "not a layout": lambda: rng.choice([table, "blocks", {"block_table": table}, object()]),
        "both": lambda: TokenTable(torch.zeros(4, 8, dtype=torch.int32)),
    }[change]()
    return layout, change


def _compat_launcher_case(kind: int, sglang: Any, ctx: Any, pool: Any, vp: Any, wp: Any) -> Callable[[], Any]:
    if kind == 0:  # int32 tokens where int64 is expected
        return lambda: sglang.launch_scatter_req_token_ids_kernel(
            flat_in=torch.arange(4, dtype=torch.int32), offsets=torch.tensor([0, 4]),
            req_pool_indices=torch.tensor([1]), pool_out=pool)
    if kind == 1:  # a write plan where a verify plan belongs
        return lambda: sglang.launch_canary_verify_kernel(context=ctx, plan=wp, check_verify_expected_token=False)
    if kind == 2:  # token arrays of different lengths
        return lambda: sglang.launch_canary_write_kernel(
            context=ctx, plan=wp, input_ids=torch.tensor([1]), positions=torch.tensor([0, 1]),
            out_cache_loc=torch.tensor([1]), enable_write_input_assert=False, expected_input_tokens=None,
            expected_input_positions=None)
    return lambda: sglang.VerifyPlan(  # status omitted, next to a field that is no array
        verify_slot_indices=vp.verify_slot_indices, verify_expected_tokens=vp.verify_expected_tokens,
        verify_expected_positions=vp.verify_expected_positions, verify_prev_slot_indices=vp.verify_prev_slot_indices,
        verify_num_valid=object(), enable=vp.enable)


# ---- the engine runtime ----------------------------------------------------------------------------------------

RT_SLOTS, RT_BS, RT_TOKENS, RT_HISTORY = 32, 3, 8, 16
RT_LOGGER = "kvcanary_cupy.test.fuzz"


class _RtEngine:
    """A tiny engine: one K pool per group (page size 1), ``req_to_token``, a SWA LUT and a block table."""

    def __init__(self) -> None:
        self.kv = {g: (np.arange(RT_SLOTS * 32) % 253).astype(np.uint8).reshape(RT_SLOTS, 32) for g in ("F", "S")}
        self.req_to_token = (np.arange(4 * 8, dtype=np.int32) % (RT_SLOTS - 1) + 1).reshape(4, 8)
        self.lut = np.arange(RT_SLOTS + 1, dtype=np.int64)
        self.block_table = np.array([[1, 2, 3, 0], [4, 5, 6, 0], [7, 0, 0, 0]], np.int32)

    def source(self, g: str) -> kc.RealKvSource:
        return kc.RealKvSource(self.kv[g], page_size=1, num_bytes_per_token=32, read_bytes=32)

    def arrays(self) -> list[np.ndarray]:
        return [*self.kv.values(), self.req_to_token, self.lut, self.block_table]


def _rt_parts(engine: _RtEngine, backend: str) -> dict[str, dict[str, Any]]:
    """Valid keyword arguments of every object the runtime is created from."""
    return {
        "config": {"mode": "log", "ring_capacity": 16, "real_kv_hash_mode": "all", "write_input_assert": True,
                   "verify_token_assert": True, "backend": backend, "logger": RT_LOGGER},
        "capacities": {"max_batch_size": RT_BS, "max_tokens": RT_TOKENS, "max_history_tokens": RT_HISTORY},
        "FULL": {"name": "FULL", "num_slots": RT_SLOTS, "k_sources": (engine.source("F"),)},
        "SWA": {"name": "SWA", "num_slots": RT_SLOTS, "k_sources": (engine.source("S"),), "swa_window": 2,
                "full_to_swa_index_mapping": engine.lut},
        "pools": {"req_to_token": engine.req_to_token},
        "create": {"device": "cpu", "framework": "numpy"},
    }


def _create(parts: dict[str, dict[str, Any]]) -> CanaryRuntime:
    groups = tuple(KvGroup(**parts[g]) for g in ("FULL", "SWA"))
    pools = {"groups": groups, **parts["pools"]}
    return CanaryRuntime.create(CanaryConfig(**parts["config"]), KvPools(**pools), Capacities(**parts["capacities"]),
                                **parts["create"])


_BAD_SIZES = [0, -1, 1.5, True, None, "8", 2**63, np.array([4])]
BAD_RUNTIME_PARTS: dict[str, dict[str, list[Any]]] = {
    "config": {
        "mode": [None, "OFF", 1, ["log"], np.array(["log"]), ""],
        "ring_capacity": [0, -1, 2**31, *BAD_SCALARS],
        "sweep_interval": [-1, 1.5, True, None, 2**63, "2", 3],  # 3: no sweep_source to sweep with
        "real_kv_hash_mode": ["some", 3, -1, 1.5, True, None, 2**70, object(), ["all"]],
        "write_input_assert": [1, "yes", None, np.array([True])],
        "health_check": [0, "no", None],
        "stats_interval": [-1, 1.5, None, 2**64],
        "log_rows": [-1, 1001, 1.5, True, "5", None, np.array([5])],
        "backend": ["gpu", None, 3, ["numpy"], "NUMPY", *(["cuda"] if unavailable_reason("cuda") else [])],
        "logger": ["", None, 3],
    },
    "capacities": {
        "max_batch_size": [*_BAD_SIZES, 2**24 + 1], "max_tokens": [0, -1, 2**60, *BAD_SCALARS],
        "verify_capacity": [0, -1, 2**31, 1.5, True, "8"], "pool_rows": [0, 2**31, 2.0, False],
        "max_context_len": [-1, "8"], "max_history_tokens": [0, 1.5], "max_sweep_slots": [0, -2, 2**40],
    },
    "FULL": {
        "name": ["", None, 3, "SWA"], "num_slots": [0, -1, 2**60, 1.5, True, None, "32"],
        "k_sources": [None, 3, (None,), ("source",), "source"], "v_sources": [3, (object(),), "v"],
        "swa_window": [2, -1, 1.5], "kv_token_id_vs_position_offset": [2**31, None, "1", 1.5, True],
        "model": ["", None, 3], "layout": [object(), "blocks", {"block_table": None}],
    },
    "SWA": {"swa_window": [-1, 0, 1.5, None], "num_slots": [0, 2**63]},
    "pools": {"layout": [object(), BlockTable(np.zeros((3, 4), np.int32), block_size=0)]},
    "create": {"device": ["gpu", 3, None, "cuda:x", "cpu:0", *NO_GPU_DEVICES], "framework": ["jax", None, 3,
                                                                                            ["numpy"], "TORCH"],
               "sweep_source": [3, "x"], "observer": [3], "timer": ["t"]},
}


def _runtime_creation_case(rng: random.Random, engine: _RtEngine) -> tuple[Callable[[], Any], str]:
    parts = _rt_parts(engine, rng.choice(BACKENDS))
    part = rng.choice([*BAD_RUNTIME_PARTS, "lut", "req_to_token", "groups", "no table"])
    if part == "lut":  # the SWA group's LUT, any bad array
        label, value = rng.choice([b for b in bad_arrays(engine.lut, output=False, rng=rng) if b[0] != "None"])
        parts["SWA"]["full_to_swa_index_mapping"] = value
        what = f"SWA lut: {label}"
    elif part == "req_to_token":
        label, value = rng.choice(bad_arrays(engine.req_to_token, output=False, rng=rng))
        parts["pools"]["req_to_token"] = value
        what = f"req_to_token: {label}"
    elif part == "groups":
        groups = rng.choice([None, (), (1,), "FULL", "dup"])
        config, caps = CanaryConfig(**parts["config"]), Capacities(**parts["capacities"])
        full = KvGroup(**parts["FULL"])

        def call() -> Any:
            pools = KvPools((full, full) if groups == "dup" else groups, req_to_token=engine.req_to_token)
            return CanaryRuntime.create(config, pools, caps)

        return call, f"KvPools.groups={groups!r}"
    elif part == "no table":  # the expected-token pool's shape comes from nowhere
        parts["pools"] = {"req_to_token": None}
        parts["FULL"]["layout"] = parts["SWA"]["layout"] = BlockTable(engine.block_table, block_size=4,
                                                                      batch_rows=True)
        what = "verify_token_assert without req_to_token or Capacities.pool_rows"
    else:
        key = rng.choice(list(BAD_RUNTIME_PARTS[part]))
        parts[part][key] = rng.choice(BAD_RUNTIME_PARTS[part][key])
        if part == "pools" and key == "layout" and rng.random() < 0.5:
            parts["pools"]["layout"] = BlockTable(engine.block_table, block_size=4, batch_rows=True)
            what = "pools: both req_to_token and layout"
        else:
            what = f"{part}.{key}={parts[part][key]!r}"
    return lambda: _create(parts), what


def test_runtime_creation_refuses_random_bad_configs_pools_and_capacities():
    rng = random.Random("runtime-create")
    engine = _RtEngine()
    for backend in BACKENDS:  # the baseline is valid
        _create(_rt_parts(engine, backend))
    for case in range(800):
        call, what = _runtime_creation_case(rng, engine)
        refuses(call, engine.arrays(), f"case {case}: {what}")


def _runtime_buffers(rt: CanaryRuntime) -> list[Any]:
    """Every array the runtime owns: canary buffers, rings, plans, device words, staged batches, the
    expected-token pool and its staged histories."""
    history = vars(rt._history) if rt._history is not None else None
    return _arrays([rt.groups, [vars(st) for st in rt.stages.values()], vars(rt.scalars), history, rt._sweep_in,
                    rt.expected_token_pool])


def _rt_batch(full: bool) -> dict[str, Any]:
    batch = {"req_pool_indices": np.array([1, 2], np.int64), "prefix_lens": np.array([2, 1], np.int64),
             "extend_seq_lens": np.array([1, 2], np.int64), "input_ids": np.array([5, 6, 7], np.int64),
             "positions": np.array([2, 1, 2], np.int64), "out_cache_loc": np.array([3, 4, 5], np.int64)}
    if full:  # write_input_assert and verify_token_assert on
        batch.update(expected_input_ids=batch["input_ids"].copy(), expected_positions=batch["positions"].copy(),
                     valid_lens=np.array([3, 3], np.int64), history_ids=np.arange(6, dtype=np.int64),
                     history_offsets=np.array([0, 3, 6], np.int64),
                     history_req_pool_indices=np.array([1, 2], np.int64))
    return batch


ROW_FIELDS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "valid_lens")
TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc", "expected_input_ids", "expected_positions")
HISTORY_FIELDS = ("history_ids", "history_offsets", "history_req_pool_indices")


def _mutate_batch(batch: dict[str, Any], full: bool, rng: random.Random) -> str:
    """Break a valid batch: a bad array, lengths that disagree, a capacity exceeded, a field missing or extra."""
    kind = rng.random()
    present = [k for k, v in batch.items() if isinstance(v, np.ndarray)]
    if kind < 0.45 and present:
        name = rng.choice(present)
        # a misaligned batch array is fine: the runtime copies it into its own buffers
        bad = [b for b in bad_arrays(batch[name], output=False, rng=rng) if b[0] != "misaligned"]
        if name == "req_pool_indices" and not full:  # the row-less layout needs no request rows
            bad = [b for b in bad if b[0] != "None"]
        label, batch[name] = rng.choice(bad)
        return f"batch.{name}: {label}"
    if kind < 0.55:
        fields = rng.choice([ROW_FIELDS, TOKEN_FIELDS])
        name = rng.choice([f for f in fields if isinstance(batch.get(f), np.ndarray)])
        batch[name] = np.append(batch[name], 1)
        return f"batch.{name} one entry longer than the others"
    if kind < 0.7:
        which = rng.choice(["rows", "tokens", "history tokens", "history rows"] if full else ["rows", "tokens"])
        if which in ("rows", "tokens"):
            size = RT_BS + 1 if which == "rows" else RT_TOKENS + 1
            for f in ROW_FIELDS if which == "rows" else TOKEN_FIELDS:
                if batch.get(f) is not None:
                    batch[f] = np.ones(size, np.int64)
        elif which == "history tokens":
            batch["history_ids"] = np.zeros(RT_HISTORY + 1, np.int64)
            batch["history_offsets"] = np.array([0, 8, RT_HISTORY + 1], np.int64)
        else:
            batch["history_req_pool_indices"] = np.ones(RT_BS + 1, np.int64)
            batch["history_offsets"] = np.zeros(RT_BS + 2, np.int64)
        return f"capacity exceeded: {which}"
    if kind < 0.85:
        if full:
            name = rng.choice(["req_pool_indices", "expected_input_ids", "expected_positions", "valid_lens",
                               rng.choice(HISTORY_FIELDS)])
            batch[name] = None
            return f"batch.{name} missing"
        name = rng.choice(["expected_input_ids", "valid_lens", "history_ids"])
        batch[name] = np.zeros(2 if name == "valid_lens" else 3, np.int64)
        if name == "history_ids":
            batch.update(history_offsets=np.array([0, 3], np.int64), history_req_pool_indices=np.ones(1, np.int64))
        return f"batch.{name} given with its switch off"
    if full:
        batch["history_offsets"] = np.array([0, 3], np.int64)  # 2 entries where k + 1 = 3 are needed
        return "history offsets that disagree with the rows"
    batch["prefix_lens"] = np.array([0, 2, 1], np.int64)
    return "prefix_lens of another length"


@pytest.mark.parametrize("backend", BACKENDS)
def test_runtime_refuses_random_bad_batches_and_models_and_writes_nothing(backend):
    """Phase 1 (prepare) takes the batch; phases 2 and 3 take the model. A refused call leaves every canary
    buffer, ring, plan, device word and staged buffer of the runtime, and the engine's arrays, unchanged."""
    rng = random.Random(f"runtime-steps-{backend}")
    engine = _RtEngine()
    swept: list[Any] = [None]
    parts = _rt_parts(engine, backend)
    parts["create"]["sweep_source"] = lambda: swept[0]
    full = _create(parts)
    lean_parts = _rt_parts(engine, backend)
    lean_parts["config"].update(write_input_assert=False, verify_token_assert=False)
    lean_parts["pools"] = {"layout": BlockTable(engine.block_table, block_size=4, batch_rows=True)}
    lean = _create(lean_parts)
    runtimes = [(full, True), (lean, False)]
    for rt, is_full in runtimes:  # one valid step first, so that the buffers hold more than their fill
        rt.mark_init_finished()
        rt.prepare(StepBatch(**_rt_batch(is_full)))
        rt.pre_forward()
        rt.post_forward()
        rt.finish_step()
    for case in range(350):
        rt, is_full = rng.choice(runtimes)
        call, watched, what = _runtime_step_case(rt, is_full, rng)
        if rng.random() < 0.1:  # what the engine's prefix cache reports to the sweep
            swept[0] = rng.choice(BAD_SWEEPS)
            call, watched, what = full.sweep, [_runtime_buffers(full)], f"sweep_source() -> {swept[0]!r}"
        refuses(call, [watched, engine.arrays()], f"case {case}: {what}")


BAD_SWEEPS = [None, 3, ([1], [0]), ([1.5], [0], [-1]), (["a"], [0], [-1]), ([2**70], [0], [-1]),
              (np.array([2**64 - 1], np.uint64), [0], [-1]), ([1, 2], [0], [-1]), ([1], [True], [-1]),
              ([[1], [2, 3]], [0], [-1]), "abc",
              (np.ma.masked_array([1, 2], mask=[0, 1]), [0, 1], [-1, 1]), ([1], np.ma.masked_array([0]), [-1]),
              (_NonCapsule("capsule"), [0], [-1])]


def _runtime_step_case(rt: CanaryRuntime, is_full: bool,
                       rng: random.Random) -> tuple[Callable[[], Any], list[Any], str]:
    """A phase call that must be refused, what it must leave unchanged, and what is wrong with it."""
    watched: list[Any] = [_runtime_buffers(rt)]
    kind = rng.random()
    if kind < 0.1:
        model = rng.choice(["draft", None, 3, ["target"], "", np.array(["target"])])
        phase = rng.choice(["prepare", "pre_forward", "post_forward"])
        if phase == "prepare":
            return lambda: rt.prepare(StepBatch(**_rt_batch(is_full)), model=model), watched, f"prepare({model!r})"
        return lambda: getattr(rt, phase)(model=model), watched, f"{phase}(model={model!r})"
    if kind < 0.15:
        batch: Any = rng.choice([None, _rt_batch(is_full), object(), "batch"])
        return lambda: rt.prepare(batch), watched, f"batch is a {type(batch).__name__}"
    fields = _rt_batch(is_full)
    what = _mutate_batch(fields, is_full, rng)
    if rng.random() < 0.2:
        what += "; " + _mutate_batch(fields, is_full, rng)
    watched.append(dict(fields))
    return lambda: rt.prepare(StepBatch(**fields)), watched, what


# ---- groups that share a plan (KvGroup.plan_of) ---------------------------------------------------------------

# plan_of values that name nothing a group could share: not a str (numpy strings are str), or no group at all
BAD_PLAN_OF_TYPES = [3, 0, np.int64(1), True, False, 1.5, b"A", ["A"], ("A",), np.array(["A"]), np.array("A"),
                     object(), 2**64, {"A": 1}]
MISSING_PLAN_OF = ["C", "", "a", "A ", " A", "A\x00", "\u0391", "FULL"]  # \u0391: Greek capital alpha


def _plan_of_case(rng: random.Random, engine: _RtEngine) -> tuple[Callable[[], Any], str]:
    """A group whose plan_of names no earlier group, or one whose plan inputs differ from the group's."""
    src = engine.source("F")
    lut = engine.lut
    base = {"name": "B", "num_slots": RT_SLOTS, "k_sources": (src,), "plan_of": "A"}
    leader = KvGroup("A", RT_SLOTS, (src,))
    kind = rng.choice(["type", "self", "missing", "later", "chain", "differs"])
    if kind == "type":
        base["plan_of"] = rng.choice(BAD_PLAN_OF_TYPES)
        return lambda: KvGroup(**base), f"KvGroup(plan_of={base['plan_of']!r})"
    if kind == "self":
        base["plan_of"] = rng.choice(["B", np.str_("B")])
        return lambda: KvGroup(**base), "KvGroup naming itself"
    if kind == "missing":
        base["plan_of"] = rng.choice(MISSING_PLAN_OF)
        follower = KvGroup(**base)
        return lambda: KvPools((leader, follower), req_to_token=engine.req_to_token), f"plan_of={base['plan_of']!r}"
    if kind == "later":  # the named group exists, but after the group
        follower = KvGroup(**base)
        groups = rng.choice([[follower, leader], [KvGroup("C", RT_SLOTS, (src,)), follower, leader]])
        return lambda: KvPools(tuple(groups), req_to_token=engine.req_to_token), "plan_of names a later group"
    if kind == "chain":  # the named group shares a plan itself
        middle = KvGroup(**base)
        last = KvGroup("C", RT_SLOTS, (src,), plan_of="B")
        return (lambda: KvPools([leader, middle, last], req_to_token=engine.req_to_token),
                "plan_of names a group sharing another's plan")
    change = rng.choice(["num_slots", "model", "window", "lut", "offset", "layout", "leader layout"])
    pools_layout: dict[str, Any] = {"req_to_token": engine.req_to_token}
    if change == "num_slots":
        base["num_slots"] = rng.choice([RT_SLOTS - 1, RT_SLOTS + 1, 2 * RT_SLOTS, np.int64(RT_SLOTS + 8)])
    elif change == "model":
        base["model"] = rng.choice(["draft", "Target", "target "])
    elif change == "window":  # a sliding-window follower of a full leader
        base.update(swa_window=rng.choice([1, 2, np.int32(5)]), full_to_swa_index_mapping=lut)
    elif change == "lut":  # both sliding-window, same window, a LUT of the same values in another array
        leader = KvGroup("A", RT_SLOTS, (src,), swa_window=2, full_to_swa_index_mapping=lut)
        base.update(swa_window=2, full_to_swa_index_mapping=rng.choice([lut.copy(), lut[:], lut.view()]))
    elif change == "offset":
        base["kv_token_id_vs_position_offset"] = rng.choice([1, -1, np.int64(1)])
    elif change == "layout":  # a layout of its own, over the same table or a copy of it
        base["layout"] = TokenTable(rng.choice([engine.req_to_token, engine.req_to_token.copy()]))
    else:  # the leader has a layout of its own, the follower the pools'
        leader = KvGroup("A", RT_SLOTS, (src,), layout=TokenTable(engine.req_to_token))
        pools_layout = rng.choice([{"req_to_token": engine.req_to_token},
                                   {"layout": TokenTable(engine.req_to_token)}])
    follower = KvGroup(**base)
    return lambda: KvPools((leader, follower), **pools_layout), f"plan inputs differ: {change}"


def test_shared_plans_are_refused_by_plan_of_unless_an_earlier_group_has_the_same_plan_inputs():
    """``KvGroup(plan_of=...)`` takes the name of another group (a str); ``KvPools`` then requires an earlier
    group with its own plan and the same model, slot count, window, LUT (the same array), offset and layout (the
    same object). Every other combination is refused naming plan_of, with no engine array touched."""
    rng = random.Random("plan-of")
    engine = _RtEngine()
    src = engine.source("F")
    # the baselines are valid: a full pair, a sliding-window pair over one LUT, a pair over one own layout
    KvPools((KvGroup("A", RT_SLOTS, (src,)), KvGroup("B", np.int64(RT_SLOTS), (src,), plan_of=np.str_("A"))),
            req_to_token=engine.req_to_token)
    KvPools((KvGroup("A", RT_SLOTS, (src,), swa_window=2, full_to_swa_index_mapping=engine.lut),
             KvGroup("B", RT_SLOTS, (src,), swa_window=2, full_to_swa_index_mapping=engine.lut, plan_of="A")),
            req_to_token=engine.req_to_token)
    own = TokenTable(engine.req_to_token)
    KvPools((KvGroup("A", RT_SLOTS, (src,), layout=own), KvGroup("C", RT_SLOTS, (src,)),
             KvGroup("B", RT_SLOTS, (src,), layout=own, plan_of="A")), req_to_token=engine.req_to_token)
    for case in range(400):
        call, what = _plan_of_case(rng, engine)
        refuses(call, engine.arrays(), f"case {case}: {what}", names=("plan_of",))


# ---- the host backend's per-thread cap (threads_on_this_thread) -------------------------------------------------

BAD_THREAD_COUNTS = [0, -1, 257, 1000, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, np.int64(0), np.int32(257),
                     np.uint64(2**64 - 1), np.int8(-1), np.uint16(300), True, False, np.bool_(True), 1.5,
                     np.float64(4.0), np.float32(8), "4", b"4", None, [4], (4,), np.array([4]), np.array(4), object(),
                     complex(4, 0)]


def test_threads_on_this_thread_refuses_counts_outside_1_to_256_naming_threads_and_keeps_the_cap():
    """A refused count raises on entering the block, names ``threads``, and leaves the calling thread's cap as it
    was (none, or the enclosing block's); valid counts (ints and NumPy integers, 1 to 256) cap launches inside
    the block only."""
    from kvcanary_cupy import hostcuda

    rng = random.Random("threads-on-this-thread")
    assert hostcuda._capped(300) == 300  # no cap on this thread to begin with
    for case in range(300):
        bad = rng.choice(BAD_THREAD_COUNTS)
        outer = rng.choice([None, 1, 7, np.int16(256)])

        def enter(bad: Any = bad) -> None:
            with hostcuda.threads_on_this_thread(bad):
                raise AssertionError("the block ran")

        if outer is None:
            refuses(enter, None, f"case {case}: threads={bad!r}", names=("threads",))
            assert hostcuda._capped(300) == 300, f"case {case}: a refused count left a cap"
            continue
        with hostcuda.threads_on_this_thread(outer):
            refuses(enter, None, f"case {case}: threads={bad!r} inside a cap of {outer!r}", names=("threads",))
            assert hostcuda._capped(300) == int(outer), f"case {case}: a refused count changed the enclosing cap"
        assert hostcuda._capped(300) == 300
    for good in [1, 256, np.int64(3), np.uint8(200), np.int32(1)]:
        with hostcuda.threads_on_this_thread(good):
            assert hostcuda._capped(300) == int(good) and hostcuda._capped(1) == 1
        assert hostcuda._capped(300) == 300


# ---- host slot lists: copy_slots and what a sweep source answers ---------------------------------------------

def _bad_slot_lists(rng: random.Random) -> Any:
    """A slot list (1-D integers on the host) that must be refused, however NumPy would convert it."""
    good = np.array([3, 4], np.int64)
    return rng.choice([
        np.ma.masked_array(good, mask=[False, True]), np.ma.masked_array(good), np.asmatrix(good), good.astype(float),
        good.reshape(1, 2), [3.5, 4], ["3", "4"], [[3], [4, 5]], None, "34", object(), rng.choice(LYING_PRODUCERS),
        np.array([2**64 - 1, 3], np.uint64), [2**70, 3], good.astype(bool),
    ])


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_slots_and_finish_step_refuse_bad_slot_lists_and_change_nothing(backend):
    """copy_slots and finish_step's sweep answer take host slot lists through one coercion: masked arrays,
    matrices, floats, nested lists and lying producers are refused before anything is read or written; a
    refused finish_step reads no ring (stats unchanged, the step not advanced)."""
    rng = random.Random(f"slot-lists-{backend}")
    engine = _RtEngine()
    answer: list[Any] = [(np.zeros(0, np.int64),) * 3]
    parts = _rt_parts(engine, backend)
    parts["config"]["sweep_interval"] = 1
    parts["create"]["sweep_source"] = lambda: answer[0]
    rt = _create(parts)
    batch = _rt_batch(True)
    rt.prepare(StepBatch(**batch))
    rt.pre_forward()
    rt.post_forward()
    rt.finish_step()
    for case in range(120):
        bad = _bad_slot_lists(rng)
        if rng.random() < 0.5:
            src, dst = (bad, np.array([7, 8])) if rng.random() < 0.5 else (np.array([3, 4]), bad)
            refuses(lambda src=src, dst=dst: rt.copy_slots(src, dst), [_runtime_buffers(rt), engine.arrays()],
                    f"case {case}: copy_slots({src!r}, {dst!r})")
            continue
        k = rng.randrange(3)
        answer[0] = tuple(bad if i == k else np.zeros(2, np.int64) for i in range(3))
        stats = rt.stats()
        refuses(rt.finish_step, [_runtime_buffers(rt), engine.arrays()], f"case {case}: sweep answer {answer[0]!r}")
        assert rt.stats() == stats, f"case {case}: a refused finish_step counted something"
    answer[0] = (np.zeros(0, np.int64),) * 3
    rt.finish_step()  # and the runtime goes on


# ---- the transformers integration: install() and CanaryOptions ------------------------------------------------

BAD_CANARY_OPTIONS: dict[str, list[Any]] = {
    "mode": [None, "LOG", "", 1, ["log"], np.array(["log"]), object()],
    "real_kv_hash": ["none", "ALL", None, True, 1, np.array(["all"])],
    "with_v": ["no", "yes", "", 1, 0, None, 1.0, np.array([True]), [True]],
    "backend": ["gpu", "", None, 3, ["numpy"], np.array(["numpy"])],
    "ring_capacity": [0, -1, 2**31, 1.5, True, "8", None, np.array([4]), [4]],
    "sweep_interval": [-1, 1.5, True, False, "2", None, np.array([8]), 2**64],
    "log_rows": [-1, 1001, 1.5, True, "5", None, np.array([5]), [5]],
    "logger": ["", None, 3, np.array(["x"]), ["x"]],
}


def test_transformers_install_and_canary_options_refuse_random_wrong_objects():
    """Every CanaryOptions field strictly (no truthiness, no arrays, no conversion), and every wrong object
    handed to install(): a class instead of a model, a str or dict (or anything else) instead of
    CanaryOptions, unknown keywords, both options and keywords. A refused install hooks nothing."""
    transformers = pytest.importorskip("transformers")
    from kvcanary_cupy.integrations.transformers import CanaryOptions, install

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    rng = random.Random("transformers-install")
    for case in range(300):
        field = rng.choice(list(BAD_CANARY_OPTIONS))
        value = rng.choice(BAD_CANARY_OPTIONS[field])
        kind = rng.randrange(5)
        if kind == 0:
            call = lambda field=field, value=value: CanaryOptions(**{field: value})  # noqa: E731
            what = f"CanaryOptions({field}={value!r})"
        elif kind == 1:
            call = lambda field=field, value=value: install(model, **{field: value})  # noqa: E731
            what = f"install(model, {field}={value!r})"
        elif kind == 2:
            opts = CanaryOptions()
            setattr(opts, field, value)  # changed after construction
            call, what = (lambda opts=opts: install(model, opts)), f"install(model, options with {field}={value!r})"
        elif kind == 3:
            target = rng.choice([type(model), transformers.PreTrainedModel, None, "model", 3, object(), {"model": 1},
                                 torch.nn.Linear(2, 2) if torch is not None else None])
            call, what = (lambda target=target: install(target)), f"install({target!r})"
        else:
            options = rng.choice(["raise", {"mode": "raise"}, {}, [], 3, CanaryOptions, "", object()])
            extra = rng.choice([{}, {"mood": "raise"}, {"mode": "log"} if not isinstance(options, str) else {}])
            call, what = (lambda options=options, extra=extra: install(model, options, **extra)), \
                f"install(model, {options!r}, **{extra!r})"
        refuses(call, None, f"case {case}: {what}")
        assert not model._forward_pre_hooks and getattr(model, "_kvcanary", None) is None, f"case {case}: hooked"


# ---- the compat layer's torch references: arrays torch cannot read as plain memory ----------------------------

@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_the_compat_layer_refuses_sparse_meta_big_endian_and_lying_arrays_and_writes_nothing():
    """Every array argument of both compat plan entries and of the compat launchers, replaced by a sparse or
    meta tensor, a big-endian NumPy array (torch.from_dlpack raises BufferError for it) or a lying DLPack
    producer: a CanaryArgumentError naming something, nothing written."""
    from kvcanary_cupy.compat import sglang

    rng = random.Random("compat-unreadable")

    def unreadable(t: Any) -> Any:
        kinds = ["meta", "big-endian", "lying"] + (["sparse"] if t.dtype in (torch.int32, torch.int64) else [])
        kind = rng.choice(kinds)
        if kind == "sparse":
            return t.to_sparse()
        if kind == "meta":
            return t.to("meta")
        if kind == "big-endian":
            arr = t.numpy()
            return arr.astype(arr.dtype.newbyteorder(">"))
        return rng.choice(LYING_PRODUCERS)

    for case in range(300):
        vp = sglang.VerifyPlan.allocate(verify_capacity=16).zero_for_testing_()
        wp = sglang.WritePlan.allocate(write_req_capacity=4).zero_for_testing_()
        ctx = sglang.VerifyOrWriteContext.allocate(num_slots=16, ring_capacity=4)
        pool = torch.zeros(4, 8, dtype=torch.int32)
        watched = [vp, wp, ctx, pool]
        kind = rng.randrange(4)
        if kind < 2:
            args = {"verify_plan_out": vp, "write_plan_out": wp, "req_pool_indices": torch.tensor([1, 2]),
                    "prefix_lens": torch.tensor([3, 1]), "extend_seq_lens": torch.tensor([1, 1]),
                    "req_to_token": torch.arange(32, dtype=torch.int32).reshape(4, 8), "swa_window_size": 0,
                    "full_to_swa_index_mapping": None, "verify_capacity": 16,
                    "req_to_verify_expected_tokens": pool, "req_to_verify_expected_tokens_valid_lens":
                    torch.tensor([3, 3]), "kv_token_id_vs_position_offset": 0}
            name = rng.choice(["req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token",
                               "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens",
                               "verify_plan_out.verify_slot_indices", "write_plan_out.write_offsets"])
            if "." in name:
                plan_arg, field = name.split(".")
                args[plan_arg] = dataclasses.replace(args[plan_arg],
                                                     **{field: unreadable(getattr(args[plan_arg], field))})
            else:
                args[name] = unreadable(args[name])
            entry = (sglang.launch_canary_plan_kernels if kind == 0
                     else sglang.launch_canary_plan_kernels_torch_reference)
            refuses(lambda entry=entry, args=args: entry(**args), watched, f"case {case}: {entry.__name__} {name}")
        elif kind == 2:
            args = {"context": ctx, "plan": wp, "input_ids": torch.tensor([1, 2]), "positions": torch.tensor([0, 1]),
                    "out_cache_loc": torch.tensor([3, 4]), "enable_write_input_assert": False,
                    "expected_input_tokens": None, "expected_input_positions": None}
            name = rng.choice(["input_ids", "positions", "out_cache_loc"])
            args[name] = unreadable(args[name])
            refuses(lambda args=args: sglang.launch_canary_write_kernel(**args), watched,
                    f"case {case}: write {name}")
        else:
            args = {"flat_in": torch.arange(4), "offsets": torch.tensor([0, 4]), "req_pool_indices": torch.tensor([1]),
                    "pool_out": pool}
            name = rng.choice(list(args))
            args[name] = unreadable(args[name])
            refuses(lambda args=args: sglang.launch_scatter_req_token_ids_kernel(**args), watched,
                    f"case {case}: scatter {name}")

# ---- strided real-KV layouts (KvByteLayout, the vLLM presets) ------------------------------------------------

_LAYOUT_FIELDS = ("page_stride", "token_stride", "head_stride", "element_stride", "num_heads", "elements_per_head",
                  "element_bytes", "tokens_per_tile", "tile_stride", "elements_per_group", "group_stride")


def _valid_layout_args() -> dict[str, Any]:
    # 2 heads of 8 two-byte elements, heads 32 bytes apart, tokens 16 bytes apart: 64 bytes per token position
    return {"page_stride": 512, "token_stride": 16, "head_stride": 256, "element_stride": 2, "num_heads": 2,
            "elements_per_head": 8, "element_bytes": 2}


def _strided_case(rng: random.Random) -> tuple[Callable[[], Any], Any, str]:
    from kvcanary_cupy.kv_layouts import flash_attn_source, flashinfer_hnd_source, vllm_cpu_source

    kind = rng.randrange(4)
    if kind == 0:  # the descriptor itself
        args = _valid_layout_args()
        key = rng.choice(_LAYOUT_FIELDS)
        invalid = {"num_heads": [0, -2], "elements_per_head": [0, -2], "element_bytes": [0, 3, 5, 32, -2],
                   "tokens_per_tile": [-1, -16, (1 << 31) + 1], "elements_per_group": [-1, -2, (1 << 31) + 1],
                   "tile_stride": [-2, 3, 7, 64], "group_stride": [-2, 3, 7, 64]}  # 64: a stride of no split
        args[key] = rng.choice([*invalid.get(key, [-2, 3, 7]), *BAD_SCALARS])  # strides: odd, not whole elements
        return lambda: kc.KvByteLayout(**args), args, f"KvByteLayout {key}={args[key]!r}"
    if kind == 1:  # a source with a layout
        layout = kc.KvByteLayout(**_valid_layout_args())
        args = {"tensor": np.zeros(4 * 512, np.uint8), "page_size": 16, "num_bytes_per_token": 32, "read_bytes": 32,
                "layout": layout}
        change = rng.choice(["per_token", "beyond", "type", "tensor", "read"])
        if change == "per_token":
            args["num_bytes_per_token"] = rng.choice([16, 48, 64])
            args["read_bytes"] = 16
        elif change == "beyond":
            args["tensor"] = np.zeros(rng.choice([16, 256, 270]), np.uint8)
        elif change == "type":
            args["layout"] = rng.choice([_valid_layout_args(), "flash", 3, (512, 16)])
        elif change == "tensor":
            args["tensor"] = rng.choice([None, np.zeros(0, np.uint8), np.zeros(4 * 512, np.uint8)[::-1],
                                         _misaligned(np.zeros(4 * 512, np.uint8)), _FailingDlpack(), [0] * 64])
        else:
            args["read_bytes"] = rng.choice([0, 24, 48, *BAD_SCALARS])
        return lambda: kc.RealKvSource(**args), args, f"RealKvSource with a layout: {change}"
    if kind == 2:  # the presets
        preset = rng.choice(["cpu", "flash", "hnd"])
        shapes = {"cpu": (2, 2, 32, 16), "flash": (2, 2, 32, 16), "hnd": (2, 2, 32, 16)}
        cache: Any = np.zeros(shapes[preset], np.float32)
        kwargs: dict[str, Any] = {"which": "k", "read_bytes": 32}
        if preset == "cpu":
            kwargs.update(block_size=32, num_kv_heads=2, head_size=8, isa="vec")
        change = rng.choice(["which", "read_bytes", "cache", "isa", "sizes"])
        if change == "which":
            kwargs["which"] = rng.choice(["K", "kv", None, 0, "key"])
        elif change == "read_bytes":
            kwargs["read_bytes"] = rng.choice([0, 24, 80, 4096, *BAD_SCALARS])
        elif change == "cache":
            cache = rng.choice([None, np.zeros((2, 2, 2), np.float32), np.zeros((3,) * len(shapes[preset]), np.float32),
                                np.zeros((0, *shapes[preset][1:]), np.float32), _FailingDlpack(), "cache"])
        elif change == "isa" and preset == "cpu":
            kwargs["isa"] = rng.choice(["amx", "neon", None, "VEC", "AMX", "vsx"])  # amx: fp32 is not its dtype
        elif preset == "cpu":
            key = rng.choice(["block_size", "num_kv_heads", "head_size"])
            kwargs[key] = rng.choice([0, -1, 7, 64, *BAD_SCALARS])
        else:
            cache = np.zeros(shapes[preset], np.float32)[..., ::-1]  # a negative stride is never read in place
        build = {"cpu": vllm_cpu_source, "flash": flash_attn_source, "hnd": flashinfer_hnd_source}[preset]
        return lambda: build(cache, **kwargs), cache, f"{preset} preset: {change}"
    # a launch whose strided source covers fewer slots than the canary buffer: refused, nothing written
    layout = kc.KvByteLayout(page_stride=32, token_stride=32, head_stride=0, element_stride=4, num_heads=1,
                             elements_per_head=8, element_bytes=4)
    short = kc.RealKvSource(np.zeros(32 * rng.randrange(1, 32), np.uint8), page_size=1, num_bytes_per_token=32,
                            read_bytes=32, layout=layout)
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=32, real_kv_sources=(short,),
                                           real_kv_hash_mode=kc.RealKvHashMode.ALL)
    wp = kc.WritePlan.allocate(write_req_capacity=1)
    wp.write_offsets[:] = [0, 1]
    wp.write_num_valid_reqs[0] = 1
    wp.write_seed_slot_indices[0] = -1
    backend = rng.choice(BACKENDS)
    one = np.ones(1, np.int64)
    return (lambda: kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=one, positions=one,
                                                  out_cache_loc=one, enable_write_input_assert=False,
                                                  backend=backend),
            [ctx, wp], f"write with a short strided source on {backend}")


def test_strided_sources_and_the_vllm_presets_refuse_random_bad_arguments():
    rng = random.Random("strided")
    for case in range(800):
        call, watched, what = _strided_case(rng)
        refuses(call, watched, f"case {case}: {what}")

# ---- KV hierarchy: offload and restore of records in pages (kvcanary_cupy.tiers) --------------------------------

def _offload_call() -> dict[str, Any]:
    canary = (np.arange(24 * 40) % 251).astype(np.uint8).reshape(24, 40)
    return {"canary_buf": canary, "pages": np.array([1, 4], np.int64), "page_size": 4, "page_stride": 5,
            "records_out": np.zeros((8, 4), np.int64), "status": np.zeros(1, np.int32)}


def _restore_records_call() -> dict[str, Any]:
    return {"records": np.arange(32, dtype=np.int64).reshape(8, 4), "pages": np.array([1, 4], np.int64),
            "page_size": 4, "canary_buf": np.zeros((24, 32), np.uint8), "status": np.zeros(1, np.int32)}


def _prefix_restore_call() -> dict[str, Any]:
    table = np.zeros((3, 4), np.int32)
    table[1, :2] = [1, 3]
    return {"context": _context(), "records": np.arange(32, dtype=np.int64).reshape(8, 4),
            "pages": np.array([1, 3], np.int64), "page_size": 4, "restored_lens": np.array([8], np.int64),
            "req_pool_indices": np.array([1], np.int64), "layout": BlockTable(table, 4),
            "status": np.zeros(1, np.int32)}


def _prefix_restore(**kwargs: Any) -> None:
    kc.PrefixRestorer(verify_capacity=16, max_requests=2).restore(**kwargs)


TIER_CALLS = {
    "offload": (_offload_call, kc.offload_canary_records, {"records_out", "status"}),
    "restore-records": (_restore_records_call, kc.restore_canary_records, {"canary_buf", "status"}),
    "prefix-restore": (_prefix_restore_call, _prefix_restore, {"status"}),
}
TIER_BAD_SCALARS = {"page_size": [0, -4, 2**31, 1.5, "4", None, 2**64], "page_stride": [3, 0, -5, 2**31, 2.5, "5"]}


def _tier_case(name: str, rng: random.Random) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """A broken call of a tier entry point: (arguments, what was broken, the argument names a refusal may
    name: the ones the case broke, as the caller spelled them)."""
    make, _, outputs = TIER_CALLS[name]
    call = make()
    arrays = [k for k, v in call.items() if isinstance(v, np.ndarray)]
    roll = rng.random()
    if roll < 0.15:
        key = rng.choice([k for k in TIER_BAD_SCALARS if k in call or name == "offload"])
        call[key] = rng.choice(TIER_BAD_SCALARS[key])
        return call, f"{key}={call[key]!r}", (key,)
    if roll < 0.25:  # both index forms, or neither
        if rng.random() < 0.5:
            call["slots"] = np.arange(8, dtype=np.int64)
            return call, "slots and pages", ("slots", "pages")
        del call["pages"]
        return call, "no pages", ("slots", "pages")
    if roll < 0.3:  # one slot per record, with a page size or stride that would scale it
        del call["pages"]
        call["slots"] = np.arange(1, 9, dtype=np.int64)
        call.pop("page_size", None)
        key = rng.choice(["page_size", "page_stride"])
        call[key] = rng.choice([2, 4, 5, 1]) if key == "page_stride" else rng.choice([2, 4])
        return call, f"slots with {key}={call[key]}", (key,)
    if roll < 0.37 and name != "prefix-restore":  # an output aliasing an input
        if "records_out" in outputs:
            call["records_out"] = _alias(call["records_out"], call["canary_buf"])
            return call, "records_out aliases canary_buf", ("records_out",)
        call["status"] = call["records"].reshape(-1).view(np.int32)[:1]
        return call, "status aliases records", ("status",)
    if roll < 0.45 and name == "prefix-restore":  # the context, or its canary buffer
        if rng.random() < 0.3:
            call["context"] = rng.choice([None, call["context"].canary_buf, "context", {}])
            return call, "context is not a context", ("context",)
        label, value = rng.choice(bad_arrays(call["context"].canary_buf, output=True, rng=rng))
        call["context"] = dataclasses.replace(call["context"], canary_buf=value)
        return call, f"context.canary_buf: {label}", ("context.canary_buf",)
    key = rng.choice(arrays)
    label, value = rng.choice(bad_arrays(call[key], output=key in outputs, rng=rng))
    if key == "status" and label == "None":  # status is optional: None is valid
        label, value = "dtype", call[key].astype(np.int16)
    call[key] = value
    return call, f"{key}: {label}", (key,)


@pytest.mark.parametrize("name", list(TIER_CALLS))
def test_tier_offload_and_restore_refuse_random_bad_arguments_by_name_and_write_nothing(name):
    make, entry, _ = TIER_CALLS[name]
    for backend in BACKENDS:
        entry(**make(), backend=backend)  # the baseline is valid
    rng = random.Random(f"tiers-{name}")
    for case in range(400):
        call, what, names = _tier_case(name, rng)
        watched = [v for v in call.values() if isinstance(v, np.ndarray)]
        if isinstance(call.get("context"), kc.VerifyOrWriteContext):
            ctx = call["context"]
            watched += [ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index]
        call["backend"] = rng.choice(BACKENDS)
        refuses(lambda call=call: entry(**call), watched, f"{name} case {case}: {what}", names)


# ---- the engine runtime's carried records (OffloadedRecords at select and restore) -----------------------------

def _broken_offloaded(records: Any, rng: random.Random) -> tuple[Any, str, bool]:
    """A copy of ``records`` broken in one way an engine could hand it back (none of them what offload gave),
    and whether only a runtime can tell (a buffer it has not, or lacks: ``select`` cannot know)."""
    from kvcanary_cupy.runtime import OffloadedRecords

    arrays = {k: v.copy() for k, v in records.records.items()}
    model, count = records.model, records.count
    key = rng.choice(sorted(arrays))
    roll = rng.random()
    if roll < 0.4:
        # host arrays the runtime copies from: alignment and writability do not matter, everything else does
        bad = [b for b in bad_arrays(arrays[key], output=False, rng=rng) if b[0] != "misaligned"]
        label, arrays[key] = rng.choice(bad)
        what = f"records[{key}]: {label}"
    elif roll < 0.5:
        count = rng.choice([count - 1, count + 1, 0, -1, float(count), str(count), None, True])
        what = f"count={count!r}"
    elif roll < 0.55:
        count = rng.choice([count - 1, count + 1, 0, -1, float(count), str(count), None, True])
        what = f"count={count!r}"
    elif roll < 0.65:
        model = rng.choice([None, 0, "draft", "", ["target"], b"target"])
        what = f"model={model!r}"
    elif roll < 0.85:
        change = rng.choice(["drop", "add", "rename", "group"])
        if change == "drop":
            del arrays[key]
        elif change == "add":
            arrays[(key[0], 7)] = arrays[key].copy()
        elif change == "rename":
            arrays[key[0]] = arrays.pop(key)  # type: ignore[index]
        else:
            arrays[("NOPE", key[1])] = arrays.pop(key)
        return OffloadedRecords(model, count, arrays), f"key {key}: {change}", change != "rename"
    else:
        value = rng.choice([None, list(arrays.items()), "records", 3, tuple(arrays.values())])
        return OffloadedRecords(model, count, value), f"records={type(value).__name__}", False  # type: ignore
    return OffloadedRecords(model, count, arrays), what, model in ("draft", "")


BAD_INDEXES = [[0, 4], [-1], [9, 0], [0.0], [[0, 1]], 2, None, "0", [True, False], np.ones(5, bool),
               slice("a", None), slice(0, 4, 0), np.ma.masked_array([0, 1], mask=[0, 1]), np.array([2**63], np.uint64),
               np.array([[0]]), object(), {0: 1}]


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_runtime_restore_and_select_refuse_random_broken_records_by_name_and_write_nothing(backend):
    from test_runtime import runtime_arrays
    from test_runtime_tiers import DST, _offloaded

    _, rt, _, _, records, _, _ = _offloaded(backend)
    rng = random.Random(f"offloaded-{backend}")
    before = runtime_arrays(rt)
    kept = {k: v.copy() for k, v in records.records.items()}
    for case in range(300):
        if case % 4 == 3:  # a subset with an index outside the records
            index = rng.choice(BAD_INDEXES)
            refuses(lambda index=index: records.select(index), records.records, f"case {case}: select({index!r})",
                    ("index", "OffloadedRecords"))
            continue
        broken, what, runtime_only = _broken_offloaded(records, rng)
        call = (lambda broken=broken: rt.restore(broken, DST, [0, 1, 2, 3], [-1, *DST[:3]])) \
            if case % 2 or runtime_only else (lambda broken=broken: broken.select([0, 1]))
        refuses(call, broken.records, f"case {case}: {what}", ("records", "OffloadedRecords"))
    after = runtime_arrays(rt)
    assert [k for k in before if not np.array_equal(before[k], after[k])] == []
    assert all(np.array_equal(kept[k], records.records[k]) for k in kept)
    assert rt.restore(records.select(slice(None)), DST, [0, 1, 2, 3], [-1, *DST[:3]]) == 4  # still whole


# ---- the presets over engines' KV caches, and layout extents -----------------------------------------------------

PRESET_SHAPES = {"cpu": (2, 2, 32, 16), "flash": (2, 2, 32, 16), "hnd": (2, 2, 32, 16), "packed": (2, 2, 32, 24),
                 "mla": (2, 32, 16)}


def _preset_call(preset: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    from kvcanary_cupy.kv_layouts import (
        flash_attn_source,
        flashinfer_hnd_source,
        vllm_attention_source,
        vllm_cpu_source,
        vllm_mla_source,
    )

    kwargs: dict[str, Any] = {"kv_cache": np.zeros(PRESET_SHAPES[preset], np.float32), "which": "k", "read_bytes": 32}
    if preset == "cpu":
        kwargs.update(block_size=32, num_kv_heads=2, head_size=8, isa="vec")
    if preset == "packed":  # K of 8 elements, V of 16, heads outside tokens
        kwargs.update(head_size=8, kv_cache_layout="LBHNC")
    build = {"cpu": vllm_cpu_source, "flash": flash_attn_source, "hnd": flashinfer_hnd_source,
             "packed": vllm_attention_source, "mla": vllm_mla_source}[preset]
    return build, kwargs


def _bad_cache(preset: str, rng: random.Random) -> tuple[Any, str]:
    """A kv_cache no preset can read in place: what no strided layout reaches, what is not plain memory."""
    shape = PRESET_SHAPES[preset]
    size = int(np.prod(shape)) * 4
    raw = np.zeros(size + 64, np.uint8)
    offset = (-raw.ctypes.data) % 16 + rng.choice([4, 8, 12])
    kind = rng.choice(["misaligned", "broadcast", "reversed", "token bytes", "dtype", "empty", "not an array",
                       "torch", "padded plane"])
    if kind == "misaligned":
        return raw[offset : offset + size].view(np.float32).reshape(shape), kind
    if kind == "broadcast":  # every element of a head at one address: a stream longer than the tensor
        last = 1 if preset == "mla" else shape[-1]  # (one latent row for every token is a readable cache)
        return np.broadcast_to(np.zeros((1,) * (len(shape) - 1) + (last,), np.float32), shape), kind
    if kind == "reversed":
        return np.zeros(shape, np.float32)[::-1], kind
    if kind == "token bytes":  # two 2-byte elements per head and one head: 4 bytes per token
        if preset == "packed":  # head_size=8 one-byte elements: 8 bytes of K per token
            return np.zeros((2, 1, 32, 12), np.uint8), kind
        small = {"cpu": (2, 2, 32, 4), "flash": (2, 1, 32, 4), "hnd": (2, 1, 32, 4), "mla": (2, 32, 2)}[preset]
        return np.zeros(small, np.float16), kind
    if kind == "dtype":
        return np.zeros(shape, rng.choice([np.clongdouble, object, "V3", "V6"])), kind
    if kind == "empty":
        return np.zeros((0, *shape[1:]), np.float32), kind
    if kind == "not an array":
        return rng.choice([None, "cache", [0.0] * 8, _FailingDlpack(), rng.choice(LYING_PRODUCERS)]), kind
    if kind == "torch" and torch is not None:
        dense = torch.zeros(shape)
        choice = rng.choice(["sparse", "meta", "expanded", "nested"])
        if choice == "sparse":
            return dense.to_sparse(), "torch sparse"
        if choice == "meta":
            return dense.to("meta"), "torch meta"
        if choice == "nested":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.nested.nested_tensor([dense]), "torch nested"
        last = 1 if preset == "mla" else shape[-1]
        return torch.zeros((1,) * (len(shape) - 1) + (last,)).expand(*shape), "torch expanded"
    padded = np.zeros((*shape[:-1], shape[-1] + rng.choice([1, 4])), np.float32)
    if preset != "cpu":
        return padded[..., : shape[-1]][::-1], "reversed padded"
    return padded[..., : shape[-1]], "padded plane"


def test_the_presets_refuse_random_bad_caches_and_arguments_by_the_callers_names():
    """Every refusal of a preset names kv_cache or the argument the case broke, never a field of the
    RealKvSource it would have built (the caller passed no such thing)."""
    rng = random.Random("presets")
    for case in range(600):
        preset = rng.choice(list(PRESET_SHAPES))
        build, kwargs = _preset_call(preset)
        build(**kwargs)  # valid as built
        keys = ["kv_cache", "kv_cache", "read_bytes", "which"] + (["block_size", "num_kv_heads", "head_size", "isa"]
                                                                   if preset == "cpu" else [])
        keys += ["head_size", "kv_cache_layout"] if preset == "packed" else []
        key = rng.choice(keys)
        if key == "kv_cache":
            kwargs[key], what = _bad_cache(preset, rng)
        elif key == "read_bytes":
            kwargs[key] = rng.choice([0, -16, 8, 24, 80, 4096, *BAD_SCALARS])
            what = f"read_bytes={kwargs[key]!r}"
        elif key == "which":
            kwargs[key] = rng.choice(["K", "kv", None, 0, "key", b"k"])
            what = f"which={kwargs[key]!r}"
        elif key == "isa":
            kwargs[key] = rng.choice(["neon", "amx", None, "VEC", 1])  # amx: the preset caches are not bf16
            what = f"isa={kwargs[key]!r}"
        elif key == "kv_cache_layout":  # an unknown name, or a real layout these strides do not store
            kwargs[key] = rng.choice(["NHD", "lbhnc", None, 3, "LBNHC", "LHBNC"])
            what = f"kv_cache_layout={kwargs[key]!r}"
            if kwargs[key] is None:
                continue  # no layout named: accepted
        else:
            kwargs[key] = rng.choice([0, -1, 7, 64, *BAD_SCALARS])
            what = f"{key}={kwargs[key]!r}"
        cache = kwargs["kv_cache"]
        refuses(lambda kwargs=kwargs, build=build: build(**kwargs), cache if isinstance(cache, np.ndarray) else None,
                f"case {case}: {preset} {what}", names=(key, "kv_cache"), never=("RealKvSource",))


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_preset_sources_over_random_torch_caches_moved_later_refuse_every_launch_by_the_caches_name():
    rng = random.Random("moved presets")
    for case in range(40):
        preset = rng.choice(list(PRESET_SHAPES))
        build, kwargs = _preset_call(preset)
        cache = torch.zeros(PRESET_SHAPES[preset])
        source = build(**{**kwargs, "kv_cache": cache, "which": "k" if preset == "mla" else rng.choice("kv")})
        ctx = kc.VerifyOrWriteContext.allocate(num_slots=16, ring_capacity=4, real_kv_sources=(source,),
                                               real_kv_hash_mode=kc.RealKvHashMode.ALL)
        move = rng.choice(["set_", "resize_", "storage resize"])
        if move == "set_":
            cache.set_(torch.zeros(cache.shape))
        elif move == "resize_":
            cache.resize_(cache.numel() * rng.choice([8, 64]))
        else:
            cache.untyped_storage().resize_(rng.choice([0, 64]))
        wp = kc.WritePlan.allocate(write_req_capacity=1)
        wp.write_offsets[:] = [0, 1]
        wp.write_seed_slot_indices[0] = -1
        wp.write_num_valid_reqs[0] = 1
        one = np.ones(1, np.int64)
        backend = rng.choice(BACKENDS)
        entry = rng.choice([kc.launch_canary_write_kernel, kc.bind_write])
        refuses(lambda ctx=ctx, wp=wp, one=one, backend=backend, entry=entry: entry(
            context=ctx, plan=wp, input_ids=one, positions=one, out_cache_loc=one, enable_write_input_assert=False,
            backend=backend), [dataclasses.replace(ctx, real_kv_sources=()), wp],  # the moved cache is no output
            f"case {case}: {preset} cache moved by {move}", names=("kv_cache",))


def test_random_layouts_are_refused_exactly_when_a_token_reaches_past_or_outgrows_the_tensor():
    """By the layout's definition, by hand: a source over ``span`` bytes is refused when slot 0's last byte lies
    past the tensor or one token's stream (heads x elements x element bytes) is longer than the whole tensor
    (zero strides alias; the work per slot must stay within the tensor); anything else is accepted."""
    rng = random.Random("extents")
    for case in range(400):
        eb = rng.choice([1, 2, 4, 8, 16])
        heads, per_head = rng.randrange(1, 2**rng.randrange(1, 12)), rng.randrange(1, 2**rng.randrange(1, 12))
        while (heads * per_head * eb) % 16:
            per_head += 1
        strides = [eb * rng.choice([0, 0, 1, 2, 3, 16, 1000]) for _ in range(4)]
        layout = kc.KvByteLayout(page_stride=strides[0], token_stride=strides[1], head_stride=strides[2],
                                 element_stride=strides[3], num_heads=heads, elements_per_head=per_head,
                                 element_bytes=eb)
        last = (heads - 1) * strides[2] + (per_head - 1) * strides[3] + eb - 1  # slot 0's last byte
        per_token = heads * per_head * eb
        span = rng.choice([last + 1, per_token, per_token - 16, last + 1 + rng.randrange(0, 4096), 16, 4096])
        span = max(span, 16)
        tensor = np.zeros(span, np.uint8)
        read = 16 * rng.randrange(1, per_token // 16 + 1)
        what = f"case {case}: {layout} over {span} bytes"
        if last >= span or per_token > span:
            refuses(lambda tensor=tensor, layout=layout, read=read, per_token=per_token: kc.RealKvSource(
                tensor, page_size=rng.randrange(1, 5), num_bytes_per_token=per_token, read_bytes=read, layout=layout),
                tensor, what, names=("RealKvSource.layout",))
        else:
            kc.RealKvSource(tensor, page_size=1, num_bytes_per_token=per_token, read_bytes=read, layout=layout)


# ---- the environment variables ---------------------------------------------------------------------------------

# What docs/backends.md documents for each variable, written out by hand: (lowest, highest) for a number, the
# accepted words otherwise (None: any text).
ENV_DOCUMENTED: dict[str, tuple[int, int] | tuple[str, ...] | None] = {
    "KVCANARY_CACHE_DIR": None, "KVCANARY_CACHE_MAX_MB": (0, 1048576), "KVCANARY_HOST_SANITIZE": ("0", "1", "thread"),
    "KVCANARY_HOST_THREADS": (1, 256), "KVCANARY_HOST_SPIN_US": (0, 1000000),
    "KVCANARY_MAX_ALLOCATION_BYTES": (1, (1 << 63) - 1), "KVCANARY_DEBUG": ("0", "1"),
    "KVCANARY_REPLAY_SANITIZED_CHILD": ("1",), "KVCANARY_VLLM": ("log", "raise", "off"),
    "KVCANARY_VLLM_REAL_KV_HASH": ("partial", "all", "none"),
    "KVCANARY_VLLM_WITH_V": ("1", "0", "true", "false", "yes", "no"),
    "KVCANARY_VLLM_BACKEND": ("auto", "numpy", "host", "cuda"), "KVCANARY_VLLM_RING_CAPACITY": (1, 2147483647),
    "KVCANARY_VLLM_SWEEP_INTERVAL": (0, 2147483647), "KVCANARY_VLLM_LOG_ROWS": (0, 1000),
    "KVCANARY_VLLM_ALLOW_UNTESTED": ("1", "0", "true", "false", "yes", "no"),
    "KVCANARY_VLLM_FAULT": ("<kind>@<step>:rank<R>",),
    "KVCANARY_VLLM_CONNECTOR": None, "KVCANARY_VLLM_CONNECTOR_ON_REFUSED": ("report", "load-error"),
}
_ENV_PIECES = ["0", "1", "7", "256", "257", "-", "+", ".", "5", "e", "E3", "inf", "nan", "Infinity", " ", "\t", "_",
               "x", "0x1f", "\u00b2", "\u0665", "\uff11", "1000000", "1048577", "9" * 25, "thread", "log", "host",
               "cuda", "@", "wrong-token", "kv-bitflip", "True", "yes", "\n", "é"]


def _junk(rng: random.Random) -> str:
    return "".join(rng.choice(_ENV_PIECES) for _ in range(rng.randint(1, 4)))


def _documented(name: str, raw: str, value: Any) -> bool:
    """Whether an accepted ``raw`` is a value the docs allow, and ``value`` what it says (an independent check)."""
    spec = ENV_DOCUMENTED[name]
    if spec is None:
        return value == raw
    if name == "KVCANARY_VLLM_FAULT":
        from kvcanary_cupy.integrations.vllm.faults import FAULT_KINDS

        spec, _, where = raw.partition(":")
        kind, _, step = spec.partition("@")
        rank = int(where[len("rank"):]) if where else None
        return kind in FAULT_KINDS and value == (kind, int(step) if step else 3, rank) and (not step or step.isdigit())
    if name == "KVCANARY_VLLM_CONNECTOR":  # a connector class name, not the canary's own wrapper
        return raw.isascii() and raw.isidentifier() and raw != "CanaryConnector" and value == raw
    if isinstance(spec[0], str):
        return raw in spec
    lo, hi = spec
    return raw.isascii() and raw.replace(".", "", 1).isdigit() and lo <= float(raw) <= hi and value == float(raw)


def test_every_environment_variable_takes_only_documented_values_and_refuses_junk_naming_itself():
    from kvcanary_cupy import settings

    assert set(ENV_DOCUMENTED) == set(settings.SETTINGS)
    rng = random.Random("environment")
    for name in settings.SETTINGS:
        for _ in range(150):
            raw = _junk(rng)
            try:
                value = settings.read(name, {name: raw})
            except kc.CanaryArgumentError as exc:
                assert str(exc).startswith(f"kv-canary: {name} must be "), (name, raw, str(exc))
                continue
            except Exception as exc:
                raise AssertionError(f"{name}={raw!r}: {type(exc).__name__}: {exc}") from exc
            assert raw == "" or _documented(name, raw, value), (name, raw, value)


def test_the_entry_points_that_read_a_variable_refuse_its_junk_before_doing_anything(tmp_path, monkeypatch):
    """Each reader of a variable, given junk: it works (the junk was a documented value) or raises CanaryArgumentError
    naming the variable, and no file appears under the cache folder."""
    from kvcanary_cupy import cache, hostcuda
    from kvcanary_cupy._limits import allocation_limit
    from kvcanary_cupy.backends import host_sanitizer_requested
    from kvcanary_cupy.integrations.common.options import backend_refusal
    from kvcanary_cupy.integrations.vllm.canary import CanaryOptions

    root = tmp_path / "cache"
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(root))
    readers: dict[str, Callable[[], Any]] = {
        "KVCANARY_CACHE_MAX_MB": cache.max_bytes, "KVCANARY_HOST_THREADS": hostcuda.default_host_threads,
        "KVCANARY_HOST_SPIN_US": hostcuda._check_host_settings, "KVCANARY_HOST_SANITIZE": host_sanitizer_requested,
        "KVCANARY_MAX_ALLOCATION_BYTES": lambda: allocation_limit("cpu"),
    }
    vllm_names = [n for n in ENV_DOCUMENTED if n.startswith("KVCANARY_VLLM_")] + ["KVCANARY_VLLM_BACKNED"]
    rng = random.Random("environment-readers")
    for _ in range(120):
        name = rng.choice([*readers, *vllm_names])
        raw = _junk(rng)
        env = {"KVCANARY_VLLM": "log", name: raw}
        call = (lambda env=env: CanaryOptions.from_env(env)) if name in vllm_names else readers[name]
        monkeypatch.setenv(name, raw)
        try:
            call()
        except kc.CanaryArgumentError as exc:
            assert str(exc).startswith("kv-canary: ") and name in str(exc), (name, raw, str(exc))
        except Exception as exc:
            raise AssertionError(f"{name}={raw!r}: {type(exc).__name__}: {exc}") from exc
        finally:
            monkeypatch.delenv(name)
    assert not root.exists()
    # the install option checked against the device: every backend name on every device kind, and junk
    for backend in ["auto", "numpy", "host", "cuda", "gpu", ""]:
        for device in ("cpu", "cuda", "meta"):
            refusal = backend_refusal(backend, device)
            runs = {"cpu": ("auto", "numpy", "host"), "cuda": ("auto", "cuda")}.get(device, ())
            if backend not in runs:
                assert refusal is not None, (backend, device)
            elif refusal is not None:  # a backend for this device that this machine cannot run: says why
                assert "not available here" in refusal and unavailable_reason(backend) is not None
