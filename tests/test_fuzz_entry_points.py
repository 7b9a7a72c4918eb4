"""Random bad arguments for every public entry point: each must raise ``CanaryArgumentError`` (a ``kv-canary: ``
ValueError) and leave every buffer exactly as it was, byte for byte.

Each case starts from a valid call and breaks one or two of its arguments with a mutation that is invalid by
construction (a wrong dtype, rank, length, type, alignment, contiguity, writability, an aliased output, an
out-of-range scalar, a NumPy subclass, a DLPack producer that fails...). Launchers are called through the
NumPy and host backends and through ``bind_*``; the allocators, ``from_tensors``, ``RealKvSource``,
``for_endpoint``, ``read_violations``, the DLPack bridge and the SGLang compat layer get their own catalogues.
Thousands of cases per run, drawn from a fixed seed.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.bind import bind_plan, bind_scatter, bind_verify, bind_write
from kvcanary_cupy.dlpack import as_array, as_byte_rows, export

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
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays(v)]
    if isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor)):
        return [value]
    return []


def _bytes(arr: Any) -> bytes:
    if isinstance(arr, np.ndarray):
        return np.asarray(arr).tobytes()
    if arr.untyped_storage().nbytes() == 0:
        return b""
    return arr.detach().contiguous().numpy().tobytes()


def refuses(call: Callable[[], Any], watched: Any, what: str) -> None:
    """``call()`` raises CanaryArgumentError naming something, and no watched buffer changed."""
    arrays = _arrays(watched)
    before = [_bytes(a) for a in arrays]
    try:
        call()
    except kc.CanaryArgumentError as exc:
        assert str(exc).startswith("kv-canary: ") and len(str(exc)) > len("kv-canary: ") + 10, what
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
    cases: list[tuple[str, Any]] = [
        ("None", None), ("list", arr.tolist()), ("string", "array"), ("int", 3), ("object", object()),
        ("dtype", arr.astype(other_dtype)), ("float", arr.astype(np.float64)), ("uint64", arr.astype(np.uint64)),
        ("bool", arr.astype(bool)), ("rank+1", arr[None]), ("0-d", np.array(arr.reshape(-1)[0] if arr.size else 0,
                                                                         arr.dtype)),
        ("misaligned", _misaligned(arr)), ("failing dlpack", _FailingDlpack()), ("no device", _NoDevice()),
        ("weird device", _WeirdDevice()), ("masked", np.ma.masked_array(arr)),
    ]
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
        "req_to_verify_expected_tokens_valid_lens": np.array([4, 4], np.int64),
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


LAUNCHERS = {
    "plan": (_plan_call, kc.launch_canary_plan_kernels, bind_plan),
    "verify": (_verify_call, kc.launch_canary_verify_kernel, bind_verify),
    "write": (_write_call, kc.launch_canary_write_kernel, bind_write),
    "scatter": (_scatter_call, kc.launch_scatter_req_token_ids, bind_scatter),
}
# Fields a launch neither reads nor writes (SPEC §0.7: only what is read is checked).
NOT_READ = {"verify": (("context", "enable_chain_position_assert"), ("plan", "status")),
            "write": (("plan", "verify_offsets"),)}
OPTIONAL_ARRAYS = {"plan": ("req_to_verify_expected_tokens",), "scatter": ("status",)}
SCALARS = {"swa_window_size", "verify_capacity", "check_verify_expected_token", "enable_write_input_assert"}
OUTPUT_FIELDS = {"verify_plan_out", "write_plan_out", "pool_out", "status"}
CONTEXT_OUTPUTS = {"canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                   "kernel_run_counter", "status"}


def _array_slots(call: dict[str, Any]) -> list[tuple[str, str | None, bool]]:
    """(argument, field or None, is output) for every array a launcher takes."""
    slots = []
    for name, value in call.items():
        if isinstance(value, np.ndarray):
            slots.append((name, None, name in OUTPUT_FIELDS))
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


def _mutate_launch(step: str, call: dict[str, Any], rng: random.Random) -> str:
    """Break ``call`` in place with one invalid change; returns what was done."""
    choice = rng.random()
    slots = [s for s in _array_slots(call) if (s[0], s[1]) not in NOT_READ.get(step, ())]
    outputs = [s for s in slots if s[2] and isinstance(_get(call, *s[:2]), np.ndarray)]
    if choice < 0.12 and outputs:  # an output aliased with another array of the launch
        arg, field, _ = rng.choice(outputs)
        target = _get(call, arg, field)
        others = [s for s in slots if s[:2] != (arg, field) and isinstance(_get(call, *s[:2]), np.ndarray)
                  and _get(call, *s[:2]).dtype == target.dtype and _get(call, *s[:2]).nbytes >= target.nbytes]
        if others:
            o_arg, o_field, _ = rng.choice(others)
            source = _get(call, o_arg, o_field).reshape(-1)[: target.size].reshape(target.shape)
            _set(call, arg, field, source)
            return f"{arg}.{field} aliased with {o_arg}.{o_field}"
    if choice < 0.25:
        scalars = [n for n in call if n in SCALARS] + ["backend", "on_invalid"]
        name = rng.choice(scalars)
        if name == "backend":
            call["backend"] = rng.choice(["gpu", "", 3, None, "NUMPY", "auto "])
        elif name == "on_invalid":
            call["on_invalid"] = rng.choice(["ignore", 1, True])
        elif name in ("check_verify_expected_token", "enable_write_input_assert"):
            call[name] = rng.choice([1, 0, "yes", None, 2.0, np.array([True])])
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
    objects = [n for n in call if isinstance(call[n], (kc.VerifyPlan, kc.WritePlan, kc.VerifyOrWriteContext))]
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


@pytest.mark.parametrize("step", list(LAUNCHERS))
def test_launchers_and_bind_refuse_random_bad_arguments_and_write_nothing(step):
    make, launch, bind = LAUNCHERS[step]
    rng = random.Random(f"launch-{step}")
    for case in range(1500):
        call = make()
        watched = dict(call)  # the valid buffers, which no refused call may change
        what = _mutate_launch(step, call, rng)
        if rng.random() < 0.3:
            what += "; " + _mutate_launch(step, call, rng)
        backend = rng.choice(BACKENDS)
        if "backend" not in call:
            call["backend"] = backend
        entry = bind if case % 3 == 0 else launch
        refuses(lambda entry=entry, call=call: entry(**call), [watched, call], f"{step} case {case}: {what}")


def test_a_valid_call_of_each_launcher_is_accepted():
    """The baselines the mutations start from are valid (so every refusal above is the mutation's doing)."""
    for step, (make, launch, bind) in LAUNCHERS.items():
        for backend in BACKENDS:
            launch(**make(), backend=backend)
            bind(**make(), backend=backend)()
        assert step


# ---- constructors, endpoints, ring reading ---------------------------------------------------------------------

def _constructor_cases(rng: random.Random) -> tuple[Callable[[], Any], Any, str]:
    kind = rng.randrange(9)
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
    for case in range(800):
        kind = rng.randrange(4)
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
