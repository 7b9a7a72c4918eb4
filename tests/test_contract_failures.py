"""The contract where calls fail: foreign exceptions become ``CanaryArgumentError`` naming the argument,
refused inputs are refused everywhere they enter, and a call that raises writes nothing and loses nothing.

Each test pins one reported case of a class whose fix lives in one place (the DLPack bridge, the array
coercion of host slot lists, the runtime's step phases, the received-prefix verifier, ``finish_step``); the
entry-point fuzz (``tests/test_fuzz_entry_points.py``) throws the same kinds of arguments at every entry point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.bind import bind_plan
from kvcanary_cupy.dlpack import as_array, as_byte_rows
from kvcanary_cupy.layouts import BlockTable
from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch

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
        elif isinstance(value, dict):
            out += _snapshot(*value.values())
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


def _no_plain_storage(kind: str, like: Any) -> Any:
    """A torch tensor with the values of ``like`` and no plain storage to view: sparse COO/CSR, nested, meta."""
    dense = torch.from_numpy(np.array(like, copy=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: sparse CSR and nested tensors are beta/prototype
        if kind == "sparse":
            return dense.to_sparse()
        if kind == "sparse_csr":
            return dense.reshape(1, -1).to_sparse_csr()
        if kind == "nested":
            return torch.nested.nested_tensor([dense])
        return dense.to("meta")


@needs_torch
@pytest.mark.parametrize("kind", ["sparse", "sparse_csr", "nested", "meta"])
@pytest.mark.parametrize("backend", ["numpy", "host"])
def test_a_context_flag_without_plain_storage_is_no_foreign_exception_when_bound(kind, backend):
    """A verify never reads the chain-position flag: bound with a sparse, nested or meta tensor there, it binds
    and runs like the unbound launch (SPEC 0.7). A write reads it: refused by its name, nothing written."""
    if backend == "host" and kc.backends.unavailable_reason("host"):
        pytest.skip(kc.backends.unavailable_reason("host"))
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=8, ring_capacity=4)
    flagged = ctx.for_endpoint(enable_chain_position_assert=_no_plain_storage(kind, ctx.enable_chain_position_assert))
    vp = kc.VerifyPlan.allocate(verify_capacity=2)
    vp.verify_slot_indices[:] = [1, 2]
    vp.verify_expected_positions[:] = [0, 1]
    vp.verify_prev_slot_indices[:] = [-1, 1]
    vp.verify_expected_tokens[:] = -1
    vp.verify_num_valid[0] = 2
    bound = kc.bind_verify(context=flagged, plan=vp, check_verify_expected_token=False, backend=backend)
    bound()
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, backend=backend)
    rows = [(v.slot, v.reason_bits) for v in kc.read_violations(ctx).rows]  # the zeroed slots 1 and 2, twice
    assert len(rows) == 4 and rows[:2] == rows[2:] and sorted(r[0] for r in rows[:2]) == [1, 2]
    wp = kc.WritePlan.allocate(write_req_capacity=1)
    wp.write_offsets[:] = [0, 1]
    wp.write_seed_slot_indices[:] = -1
    wp.write_num_valid_reqs[0] = 1
    one = np.ones(1, np.int64)
    for entry in (kc.bind_write, kc.launch_canary_write_kernel):
        refused(lambda entry=entry: entry(context=flagged, plan=wp, input_ids=one, positions=one, out_cache_loc=one,
                                          enable_write_input_assert=False, backend=backend),
                r"^kv-canary: context\.enable_chain_position_assert\b", ctx, wp)


@needs_torch
@pytest.mark.parametrize("offsets", [[0, 1], (0, 1), 2, "01", None, "0-d"], ids=str)
def test_the_compat_write_plan_refuses_write_offsets_it_cannot_size_its_scratch_by(offsets):
    """SGLang's three-field WritePlan sizes its scratch by write_offsets: a list, a scalar or a 0-d tensor there
    is refused by that name (it was an AttributeError or IndexError)."""
    from kvcanary_cupy.compat import sglang

    value = torch.tensor(2) if offsets == "0-d" else offsets
    refused(lambda: sglang.WritePlan(write_offsets=value, write_seed_slot_indices=torch.zeros(1, dtype=torch.int64),
                                     write_num_valid_reqs=torch.zeros(1, dtype=torch.int32)),
            r"^kv-canary: write_offsets\b")


def test_an_object_array_is_refused_by_name_wherever_an_array_enters():
    """An object array holds references, not values: the bridge refuses it by name (a byte view of it was a
    TypeError from NumPy, and would have read pointers as KV bytes)."""
    objects = np.zeros((4, 16), object)
    refused(lambda: as_array(objects, "the_arg"), r"^kv-canary: the_arg holds Python objects")
    refused(lambda: kc.RealKvSource(objects, page_size=1, num_bytes_per_token=16, read_bytes=16),
            r"^kv-canary: RealKvSource\.tensor holds Python objects")
    layout = kc.KvByteLayout(page_stride=16, token_stride=16, head_stride=0, element_stride=1, num_heads=1,
                             elements_per_head=16, element_bytes=1)
    refused(lambda: kc.RealKvSource(objects, page_size=1, num_bytes_per_token=16, read_bytes=16, layout=layout),
            r"^kv-canary: RealKvSource\.tensor holds Python objects")


@needs_torch
@pytest.mark.parametrize("kind", ["sparse", "nested", "meta"])
def test_a_real_kv_tensor_without_plain_storage_is_refused_by_name(kind):
    """Viewing a KV tensor as bytes asks torch for its strides first: a nested tensor raised torch's internal
    error there. Every byte view refuses what has no plain storage by the tensor's name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        dense = torch.zeros((4, 16), dtype=torch.float32)
        tensor = {"sparse": dense.to_sparse, "meta": lambda: dense.to("meta"),
                  "nested": lambda: torch.nested.nested_tensor([dense])}[kind]()
    layout = kc.KvByteLayout(page_stride=64, token_stride=64, head_stride=0, element_stride=4, num_heads=1,
                             elements_per_head=16, element_bytes=4)
    for with_layout in (None, layout):
        refused(lambda with_layout=with_layout: kc.RealKvSource(tensor, page_size=1, num_bytes_per_token=64,
                                                                read_bytes=64, layout=with_layout),
                r"^kv-canary: RealKvSource\.tensor\b")


# ---- 2. refused means refused ----------------------------------------------------------------------------------

def _verifier_call(**changes: Any) -> dict[str, Any]:
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
    call = _verifier_call(received_lens=lens)
    message = refused(lambda: verifier.verify(**call), r"^kv-canary: received_lens\b",
                      _verifier_state(verifier), call)
    assert "prefix_lens" not in message


def test_a_received_lens_beyond_the_table_row_is_named_received_lens_by_the_reference():
    verifier = kc.transfer.ReceivedPrefixVerifier(verify_capacity=64, max_requests=3)
    call = _verifier_call(received_lens=np.array([3, 9], np.int64))  # rows are 8 wide
    message = refused(lambda: verifier.verify(**call), r"received_lens\[1\]=9 reaches beyond",
                      _verifier_state(verifier), call)
    assert "prefix_lens" not in message


# ---- 3. nothing written, nothing lost --------------------------------------------------------------------------

def test_a_received_prefix_verify_refused_for_an_out_of_buffer_slot_leaves_its_plan_unchanged():
    verifier = kc.transfer.ReceivedPrefixVerifier(verify_capacity=16, max_requests=3)
    verifier.plan.verify_slot_indices[:] = 9  # a previous verify's plan, which a refused call must keep
    table = (np.arange(4 * 8, dtype=np.int32) % 31 + 1).reshape(4, 8)
    table[2, 1] = 40  # a slot beyond the receiver's 32-slot canary buffer: the verify step refuses it
    call = _verifier_call(req_to_token=table)
    refused(lambda: verifier.verify(**call), r"plan\.verify_slot_indices\[\d+\]=40 is outside canary_buf",
            _verifier_state(verifier), call)
    # and the same call with a valid table still verifies and publishes its plan
    table[2, 1] = 17
    verifier.verify(**call)
    got = verifier.plan.verify_slot_indices[: int(verifier.plan.verify_num_valid[0])]
    np.testing.assert_array_equal(got, [table[1, 0], table[1, 1], table[1, 2], table[2, 0], table[2, 1]])


# ---- the runtime: a two-group engine whose prefix slots were never written, so every step finds violations --

RT_SLOTS = 32
RT_LOGGER = "kvcanary_cupy.test.contract"


class Engine:
    """A FULL and a SWA group (page size 1) sharing ``req_to_token``; the SWA LUT and, with ``torch_kv``, the
    KV pools are torch tensors, which the runtime's bound launches guard against moving."""

    def __init__(self, *, torch_kv: bool = False) -> None:
        def pool() -> Any:
            return torch.zeros(RT_SLOTS, 32, dtype=torch.uint8) if torch_kv else np.zeros((RT_SLOTS, 32), np.uint8)

        self.kv = {"FULL": pool(), "SWA": pool()}
        self.lut = torch.arange(RT_SLOTS + 1, dtype=torch.int64) if torch is not None else np.arange(RT_SLOTS + 1)
        self.req_to_token = (np.arange(4 * 8, dtype=np.int32) % (RT_SLOTS - 1) + 1).reshape(4, 8)
        self.answer: Any = (np.zeros(0, np.int64),) * 3  # what the prefix cache reports to the sweep

    def sweep_source(self) -> Any:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def runtime(self, *, sweep_interval: int = 0, timer: Any = None) -> CanaryRuntime:
        def source(g: str) -> kc.RealKvSource:
            return kc.RealKvSource(self.kv[g], page_size=1, num_bytes_per_token=32, read_bytes=32)

        groups = (KvGroup(name="FULL", num_slots=RT_SLOTS, k_sources=(source("FULL"),)),
                  KvGroup(name="SWA", num_slots=RT_SLOTS, k_sources=(source("SWA"),), swa_window=2,
                          full_to_swa_index_mapping=self.lut))
        config = CanaryConfig(mode="log", ring_capacity=16, real_kv_hash_mode="all", sweep_interval=sweep_interval,
                              backend="numpy", logger=RT_LOGGER)
        return CanaryRuntime.create(config, KvPools(groups=groups, req_to_token=self.req_to_token),
                                    Capacities(max_batch_size=3, max_tokens=8), sweep_source=self.sweep_source,
                                    timer=timer)


def _batch() -> StepBatch:
    return StepBatch(req_pool_indices=np.array([1, 2]), prefix_lens=np.array([2, 1]),
                     extend_seq_lens=np.array([1, 2]), input_ids=np.array([5, 6, 7]), positions=np.array([2, 1, 2]),
                     out_cache_loc=np.array([3, 4, 5]))


def _forward(rt: CanaryRuntime) -> None:
    rt.prepare(_batch())
    rt.pre_forward()
    rt.post_forward()


def _buffers(rt: CanaryRuntime) -> list[Any]:
    """Every canary buffer, ring, plan and device word of the runtime, and its staged batches."""
    return [rt.groups, [st.buffers for st in rt.stages.values()], vars(rt.scalars)]


@needs_torch
@pytest.mark.parametrize("phase", ["pre_forward", "post_forward"])
def test_a_phase_refused_for_a_later_group_whose_tensor_moved_launches_no_group(phase):
    engine = Engine(torch_kv=True)
    rt = engine.runtime()
    _forward(rt)
    rt.finish_step()
    rt.prepare(_batch())
    if phase == "post_forward":
        rt.pre_forward()
        moved = torch.zeros(RT_SLOTS, 32, dtype=torch.uint8)  # allocated while the old storage lives: elsewhere
        engine.kv["SWA"].set_(moved)  # the SWA group's KV pool (a TAIL source) now lives in other memory
        match = r"^kv-canary: context\.real_kv_sources\[0\]\.tensor: the torch tensor's storage moved"
    else:
        engine.lut.set_(torch.arange(RT_SLOTS + 1, dtype=torch.int64))  # the SWA LUT (read by its plan) moved
        match = r"^kv-canary: full_to_swa_index_mapping: the torch tensor's storage moved"
    # the FULL group comes first: on the old code its launches ran (and wrote) before SWA's refused
    refused(lambda: getattr(rt, phase)(), match, _buffers(rt))


def test_copy_slots_refuses_masked_slot_lists_and_copies_nothing():
    rt = Engine().runtime()
    _forward(rt)
    src = np.ma.masked_array([3, 4], mask=[False, True])  # the masked 4 would be copied like any slot
    refused(lambda: rt.copy_slots(src, np.array([7, 8])), r"^kv-canary: src must be a plain array", _buffers(rt))
    refused(lambda: rt.copy_slots(np.array([3, 4]), np.ma.masked_array([7, 8])), r"^kv-canary: dst\b", _buffers(rt))


def _step_with_violations(rt: CanaryRuntime) -> None:
    """Run one forward whose launches append rows, and the finish_step that takes their snapshot."""
    _forward(rt)
    rt.finish_step()


@pytest.mark.parametrize("answer", ["masked", "float", "raises"])
def test_finish_step_refused_by_its_sweep_answer_reads_nothing_and_the_next_one_reports_every_row(answer):
    engine = Engine()
    rt = engine.runtime(sweep_interval=1)
    _step_with_violations(rt)  # step 0: its rows are read by the next finish_step
    stats = rt.stats()
    assert stats["violations"] == 0
    engine.answer = {"masked": (np.ma.masked_array([3], mask=[True]), np.array([0]), np.array([-1])),
                     "float": (np.array([3.0]), np.array([0]), np.array([-1])),
                     "raises": RuntimeError("the prefix cache is being rebuilt")}[answer]
    if answer == "raises":  # the engine's own exception propagates unchanged
        before = _snapshot(_buffers(rt))
        with pytest.raises(RuntimeError, match="being rebuilt"):
            rt.finish_step()
        assert _snapshot(_buffers(rt)) == before
    else:
        refused(rt.finish_step, r"^kv-canary: sweep_source's slots", _buffers(rt))
    assert rt.stats() == stats  # nothing read, nothing counted, the step not advanced
    engine.answer = (np.zeros(0, np.int64),) * 3
    report = rt.finish_step()
    found = len(report.new_violations)
    assert found > 0 and rt.stats()["violations"] == found
    assert report.launch_step == 0


def test_a_failure_after_the_rings_were_read_still_reports_every_row_read(caplog):
    engine = Engine()

    @contextlib.contextmanager
    def timer(phase: str) -> Any:
        yield
        if phase == "sweep" and rt.step == 1:  # a debugging hook failing once the rings have been read
            raise OSError("the timing file is full")

    rt = engine.runtime(sweep_interval=1, timer=timer)
    _step_with_violations(rt)
    engine.answer = (np.array([3]), np.array([0]), np.array([-1]))
    caplog.set_level(logging.WARNING, logger=RT_LOGGER)
    caplog.clear()
    with pytest.raises(OSError, match="timing file") as info:
        rt.finish_step()
    logged = [r.kv_canary["rows"] for r in caplog.records if " violation row(s) (" in r.getMessage()]
    assert sum(logged) > 0
    assert rt.stats()["violations"] == sum(logged)  # what stats() counts is what reached the log
    assert any("logged" in note for note in getattr(info.value, "__notes__", []))


# ---- a failed allocation names the argument that asked for the bytes ------------------------------------------

HUGE = 2**55  # NumPy refuses at once (no machine has the bytes), so nothing is really allocated


@pytest.mark.parametrize("make, name", [
    (lambda: kc.WritePlan.allocate(write_req_capacity=HUGE), "write_req_capacity"),
    (lambda: kc.VerifyOrWriteContext.allocate(num_slots=HUGE), "num_slots"),
    (lambda: kc.VerifyOrWriteContext.allocate(num_slots=8, ring_capacity=HUGE), "ring_capacity"),
    (lambda: kc.transfer.ReceivedPrefixVerifier(verify_capacity=4, max_requests=HUGE), "max_requests"),
    (lambda: CanaryRuntime.create(CanaryConfig(), KvPools(groups=(KvGroup(name="F", num_slots=8),),
                                                           req_to_token=np.zeros((2, 4), np.int32)),
                                  Capacities(max_batch_size=2, max_tokens=HUGE)), "Capacities.max_tokens"),
    (lambda: CanaryRuntime.create(CanaryConfig(), KvPools(groups=(KvGroup(name="F", num_slots=HUGE),),
                                                           req_to_token=np.zeros((2, 4), np.int32)),
                                  Capacities(max_batch_size=2, max_tokens=4, verify_capacity=8, max_sweep_slots=8)),
     "num_slots"),
], ids=["WritePlan", "context-slots", "context-ring", "verifier", "runtime-tokens", "runtime-slots"])
def test_an_allocation_that_cannot_be_had_names_the_argument_that_sized_it(make, name):
    with pytest.raises(kc.CanaryArgumentError) as info:
        make()
    message = str(info.value)
    assert message.startswith("kv-canary: ") and name in message and "bytes" in message, message


@needs_torch
@pytest.mark.parametrize("cls, args, name", [
    ("VerifyPlan", {"verify_capacity": HUGE}, "verify_capacity"),
    ("WritePlan", {"write_req_capacity": HUGE}, "write_req_capacity"),
    ("VerifyOrWriteContext", {"num_slots": HUGE}, "num_slots"),
])
def test_a_compat_allocation_that_cannot_be_had_names_its_size_argument(cls, args, name):
    from kvcanary_cupy.compat import sglang

    with pytest.raises(kc.CanaryArgumentError) as info:
        getattr(sglang, cls).allocate(**args)
    message = str(info.value)
    assert message.startswith("kv-canary: ") and f"{name}={HUGE}" in message and "bytes" in message, message


# ---- the transformers integration: install's arguments and CanaryOptions ---------------------------------------

@pytest.fixture(scope="module")
def tiny_model() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(config)


def _untouched(model: Any) -> None:
    """No hook, no instance override, no canary left behind by a refused install."""
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert "init_continuous_batching" not in vars(model) and getattr(model, "_kvcanary", None) is None


@pytest.mark.parametrize("case", ["class", "str options", "dict options", "unknown keyword", "options instance",
                                  "mutated options"])
def test_install_refuses_wrong_objects_by_name_and_hooks_nothing(tiny_model, case):
    from kvcanary_cupy.integrations.transformers import CanaryOptions, install

    mutated = CanaryOptions()
    mutated.with_v = "no"  # a field changed after construction is checked again
    call, match = {
        "class": (lambda: install(type(tiny_model)), r"^kv-canary: target must be a model instance"),
        "str options": (lambda: install(tiny_model, "raise"), r"^kv-canary: options must be a CanaryOptions"),
        "dict options": (lambda: install(tiny_model, {"mode": "raise"}), r"^kv-canary: options must be a Canary"),
        "unknown keyword": (lambda: install(tiny_model, mood="raise"), r"^kv-canary: install\(\) got unknown .*mood"),
        "options instance": (lambda: install(tiny_model, CanaryOptions), r"^kv-canary: options must be"),
        "mutated options": (lambda: install(tiny_model, mutated), r"^kv-canary: CanaryOptions\.with_v must be a bool"),
    }[case]
    with pytest.raises(kc.CanaryArgumentError, match=match):
        call()
    _untouched(tiny_model)
    assert "init_continuous_batching" not in vars(type(tiny_model))


BAD_OPTION_FIELDS = {
    "mode": [None, "LOG", 1, ["log"], np.array(["log"])],
    "real_kv_hash": ["none", "ALL", None, True, np.array(["all"])],
    "with_v": ["no", "yes", 1, 0, None, np.array([True]), [True]],
    "backend": ["gpu", None, 3, ["numpy"], np.array(["numpy"])],
    "ring_capacity": [0, -1, 2**31, 1.5, True, "8", None, np.array([4])],
    "sweep_interval": [-1, 1.5, True, "2", None, np.array([8])],
    "logger": ["", None, 3, np.array(["x"])],
    "log_rows": [-1, 1001, 1.5, True, None, np.array([5])],
}


@pytest.mark.parametrize("field", list(BAD_OPTION_FIELDS))
def test_every_canary_options_field_is_validated_strictly(field):
    pytest.importorskip("transformers")
    from kvcanary_cupy.integrations.transformers import CanaryOptions

    for value in BAD_OPTION_FIELDS[field]:
        with pytest.raises(kc.CanaryArgumentError, match=rf"^kv-canary: CanaryOptions\.{field}\b"):
            CanaryOptions(**{field: value})
    assert CanaryOptions(with_v=False, sweep_interval=0).config().sweep_interval == 0  # valid values still pass


def test_canary_options_take_each_bounded_field_at_its_bounds():
    pytest.importorskip("transformers")
    from kvcanary_cupy.integrations.transformers import CanaryOptions

    for field, values in (("ring_capacity", (1, 2**31 - 1)), ("sweep_interval", (0,)), ("log_rows", (0, 1000))):
        for value in values:
            assert getattr(CanaryOptions(**{field: value}), field) == value, (field, value)
