"""The contract where calls fail: foreign exceptions become ``CanaryArgumentError`` naming the argument,
refused inputs are refused everywhere they enter, and a call that raises writes nothing and loses nothing.

Each test pins one reported case of a class whose fix lives in one place (the DLPack bridge, the array
coercion of host slot lists, the runtime's step phases, the received-prefix verifier, ``finish_step``); the
entry-point fuzz (``tests/test_fuzz_entry_points.py``) throws the same kinds of arguments at every entry point.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.bind import bind_plan
from kvcanary_cupy.dlpack import as_array, as_byte_rows
from kvcanary_cupy.layouts import BlockTable

try:
    import torch
except ImportError:  # torch is an optional dependency
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _snapshot(*values: Any) -> list[bytes]:
    out = []
    for value in values:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += _snapshot(*(getattr(value, f.name) for f in dataclasses.fields(value)))
        elif isinstance(value, (list, tuple)):
            out += _snapshot(*value)
        elif isinstance(value, np.ndarray):
            out.append(value.tobytes())
        elif torch is not None and isinstance(value, torch.Tensor):
            out.append(value.detach().contiguous().numpy().tobytes())
    return out


def refused(call: Any, match: str, *watched: Any) -> str:
    """``call()`` raises CanaryArgumentError whose message matches ``match``; no watched buffer changed."""
    before = _snapshot(*watched)
    with pytest.raises(kc.CanaryArgumentError, match=match) as info:
        call()
    assert str(info.value).startswith("kv-canary: ")
    assert _snapshot(*watched) == before, "a refused call changed a buffer"
    return str(info.value)


# ---- 1. foreign exceptions -------------------------------------------------------------------------------------

class NonCapsule:
    """``__dlpack__`` answers with something that is not a DLPack capsule."""

    def __init__(self, value: Any = "not a capsule") -> None:
        self.value = value

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self.value

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class JunkDevice:
    """``__dlpack_device__`` answers junk; the export itself would be a valid CPU capsule."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return np.zeros(3, np.int64).__dlpack__()

    def __dlpack_device__(self) -> Any:
        return self.device


LIARS = [NonCapsule(), NonCapsule(None), NonCapsule(np.zeros(2)), JunkDevice(("a", 0)), JunkDevice("ab"),
         JunkDevice((1.5, 0)), JunkDevice(np.array([1, 0])), JunkDevice(None)]


@pytest.mark.parametrize("liar", LIARS, ids=[f"{type(p).__name__}-{k}" for k, p in enumerate(LIARS)])
def test_a_lying_dlpack_producer_is_an_argument_error_naming_the_argument(liar):
    refused(lambda: as_array(liar, "the_arg"), r"^kv-canary: the_arg")


def _plan_args() -> dict[str, Any]:
    return {
        "verify_plan_out": kc.VerifyPlan.allocate(verify_capacity=16),
        "write_plan_out": kc.WritePlan.allocate(write_req_capacity=3),
        "req_pool_indices": np.array([1, 2], np.int64), "prefix_lens": np.array([3, 2], np.int64),
        "extend_seq_lens": np.array([1, 2], np.int64),
        "req_to_token": (np.arange(32, dtype=np.int32) + 1).reshape(4, 8), "swa_window_size": 0,
        "full_to_swa_index_mapping": None, "verify_capacity": 16,
    }


@pytest.mark.parametrize("entry", ["launch", "bind"])
@pytest.mark.parametrize("liar", [NonCapsule(), JunkDevice(("a", 0))], ids=["non-capsule", "junk-device"])
def test_lying_producers_are_refused_by_launchers_bind_and_layouts_with_nothing_written(entry, liar):
    args = _plan_args()
    for v in (args["verify_plan_out"], args["write_plan_out"]):
        for f in dataclasses.fields(v):
            getattr(v, f.name)[...] = 7  # a plan that any write would change
    call = kc.launch_canary_plan_kernels if entry == "launch" else bind_plan
    for name in ("prefix_lens", "req_to_token"):
        bad = dict(args, **{name: liar})
        refused(lambda bad=bad: call(**bad, backend="numpy"), rf"^kv-canary: {name}\b", args)
    bad_plan = dataclasses.replace(args["verify_plan_out"], verify_slot_indices=liar)
    refused(lambda: call(**dict(args, verify_plan_out=bad_plan), backend="numpy"),
            r"^kv-canary: verify_plan_out\.verify_slot_indices\b", args)
    layout = BlockTable(liar, block_size=2)
    refused(lambda: call(**dict(args, req_to_token=None, layout=layout), backend="numpy"),
            r"^kv-canary: layout\.block_table\b", args)


def test_a_big_endian_array_is_refused_by_name_rather_than_read_with_its_bytes_swapped():
    args = _plan_args()
    args["verify_plan_out"].verify_slot_indices[...] = 7
    bad = dict(args, prefix_lens=args["prefix_lens"].astype(">i8"))
    message = refused(lambda: kc.launch_canary_plan_kernels(**bad, backend="numpy"),
                      r"^kv-canary: prefix_lens holds >i8 values in non-native byte order", args)
    assert "got int64" not in message  # the old message said "must have dtype int64, got int64"
    refused(lambda: as_byte_rows(np.zeros((4, 8), ">f4"), "tensor"), r"^kv-canary: tensor holds >f4")


@needs_torch
@pytest.mark.parametrize("kind", ["sparse", "sparse_csr", "meta", "big-endian"])
@pytest.mark.parametrize("entry", ["launch_canary_plan_kernels", "launch_canary_plan_kernels_torch_reference"])
def test_the_compat_layer_refuses_sparse_meta_and_big_endian_arrays_by_name(kind, entry):
    from kvcanary_cupy.compat import sglang

    def make(t):
        if kind == "sparse":
            return t.to_sparse()
        if kind == "sparse_csr":
            return t.to_sparse_csr()
        if kind == "meta":
            return t.to("meta")
        return t.numpy().astype(t.numpy().dtype.newbyteorder(">"))

    vp = sglang.VerifyPlan.allocate(verify_capacity=16).zero_for_testing_()
    wp = sglang.WritePlan.allocate(write_req_capacity=4).zero_for_testing_()
    args = {"verify_plan_out": vp, "write_plan_out": wp, "req_pool_indices": torch.tensor([1, 2]),
            "prefix_lens": torch.tensor([3, 1]), "extend_seq_lens": torch.tensor([1, 1]),
            "req_to_token": torch.arange(32, dtype=torch.int32).reshape(4, 8), "swa_window_size": 0,
            "full_to_swa_index_mapping": None, "verify_capacity": 16, "req_to_verify_expected_tokens": None,
            "req_to_verify_expected_tokens_valid_lens": None, "kv_token_id_vs_position_offset": 0}
    call = getattr(sglang, entry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: sparse CSR support is in beta
        bad = dict(args, req_to_token=make(args["req_to_token"]))
    refused(lambda: call(**bad), r"^kv-canary: req_to_token\b", vp, wp)
    if kind != "sparse_csr":  # CSR needs two dimensions
        bad = dict(args, prefix_lens=make(args["prefix_lens"]))
        refused(lambda: call(**bad), r"^kv-canary: prefix_lens\b", vp, wp)


# ---- 2. refused means refused ----------------------------------------------------------------------------------

def _verifier_call(verifier: Any, **changes: Any) -> dict[str, Any]:
    context = kc.VerifyOrWriteContext.allocate(num_slots=32, ring_capacity=8)
    call = {"context": context, "req_pool_indices": np.array([1, 2], np.int64),
            "received_lens": np.array([3, 2], np.int64),
            "req_to_token": (np.arange(4 * 8, dtype=np.int32) % 31 + 1).reshape(4, 8), "backend": "numpy"}
    call.update(changes)
    return call


def _verifier_state(verifier: Any) -> list[Any]:
    return [verifier.plan, verifier._write_plan, verifier._no_extend]


@pytest.mark.parametrize("bad", ["float", "2-D", "length", "lying", "masked"])
def test_a_bad_received_lens_is_reported_under_the_name_received_lens(bad):
    verifier = kc.transfer.ReceivedPrefixVerifier(verify_capacity=16, max_requests=3)
    verifier.plan.verify_slot_indices[:] = 9  # a previous verify's plan
    lens = {"float": np.array([3.0, 2.0]), "2-D": np.array([[3, 2]], np.int64), "length": np.array([3], np.int64),
            "lying": NonCapsule(), "masked": np.ma.masked_array([3, 2], mask=[0, 1])}[bad]
    call = _verifier_call(verifier, received_lens=lens)
    message = refused(lambda: verifier.verify(**call), r"^kv-canary: received_lens\b",
                      _verifier_state(verifier), call)
    assert "prefix_lens" not in message


def test_a_received_lens_beyond_the_table_row_is_named_received_lens_by_the_reference():
    verifier = kc.transfer.ReceivedPrefixVerifier(verify_capacity=64, max_requests=3)
    call = _verifier_call(verifier, received_lens=np.array([3, 9], np.int64))  # rows are 8 wide
    message = refused(lambda: verifier.verify(**call), r"received_lens\[1\]=9 reaches beyond",
                      _verifier_state(verifier), call)
    assert "prefix_lens" not in message


# ---- 3. nothing written, nothing lost --------------------------------------------------------------------------

def test_a_received_prefix_verify_refused_for_an_out_of_buffer_slot_leaves_its_plan_unchanged():
    verifier = kc.transfer.ReceivedPrefixVerifier(verify_capacity=16, max_requests=3)
    verifier.plan.verify_slot_indices[:] = 9  # a previous verify's plan, which a refused call must keep
    table = (np.arange(4 * 8, dtype=np.int32) % 31 + 1).reshape(4, 8)
    table[2, 1] = 40  # a slot beyond the receiver's 32-slot canary buffer: the verify step refuses it
    call = _verifier_call(verifier, req_to_token=table)
    refused(lambda: verifier.verify(**call), r"plan\.verify_slot_indices\[\d+\]=40 is outside canary_buf",
            _verifier_state(verifier), call)
    # and the same call with a valid table still verifies and publishes its plan
    table[2, 1] = 17
    verifier.verify(**call)
    got = verifier.plan.verify_slot_indices[: int(verifier.plan.verify_num_valid[0])]
    np.testing.assert_array_equal(got, [table[1, 0], table[1, 1], table[1, 2], table[2, 0], table[2, 1]])
