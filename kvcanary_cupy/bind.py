"""Bind once, launch many: convert and validate a launch's buffers at setup time, then launch with no per-call
conversion and no per-call validation.

Owns :class:`BoundLaunch` and its four constructors :func:`bind_plan`, :func:`bind_verify`,
:func:`bind_write` and :func:`bind_scatter`, which take exactly the keyword arguments of the matching public
launchers. A serving engine keeps its batch tensors, plans, canary buffers and rings alive for its whole life
and refills their *contents* every step; binding views them through DLPack once, checks every host-visible
fact once and resolves the backend once. Calling the bound launch then only enters the right CUDA stream and
launches the kernels, which is what a CUDA-graph capture needs:

* a ``__dlpack__`` call that names a stream may make the producer insert a cross-stream wait, and the import
  itself costs host time on every step; neither belongs inside a captured region;
* kernels of a call on torch CUDA tensors go to torch's current stream *at call time* (inside
  ``torch.cuda.graph`` that is the capture stream), so they are ordered after the engine's own kernels
  without any synchronisation.

Contract of a bound launch:

* Device values may be refilled in place between calls (``tensor.copy_(...)``, ``tensor[:] = ...``,
  ``array[...] = ...``): every call reads them afresh.
* Shapes, dtypes and the buffers themselves may not change. A bound launch holds every object it was bound
  to, so replacing an attribute of your own objects by a new tensor is not seen: the launch keeps using (and
  keeping alive) the buffers it was bound to. A bound torch tensor whose storage moves or shrinks in place
  (``resize_``, ``set_``, a storage resize), which frees the memory the bound view addresses, is detected:
  every call compares each bound torch tensor's data pointer and storage size with the values at bind time
  (a few microseconds, on the host) and raises a ``kv-canary: `` ValueError instead of launching. Bind again
  after changing capacities.
* The first call on a GPU compiles and loads the kernels (NVRTC), which is not capture-safe: call every
  bound launch once (warm-up) before capturing it in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ._validate import StorageGuard, storage_guards
from .backends import Backend, resolve_backend
from .context import VerifyOrWriteContext
from .dlpack import Device, DLPackArray, cupy_stream_for, first_torch_cuda_tensor, stream_scope
from .layouts import SlotLayout
from .plan import OnInvalid, VerifyPlan, WritePlan, prepare_plan_launch
from .scatter import prepare_scatter_launch
from .verify import prepare_verify_launch
from .write import prepare_write_launch

__all__ = ["BoundLaunch", "bind_plan", "bind_scatter", "bind_verify", "bind_write"]

@dataclass(frozen=True, eq=False, repr=False)
class BoundLaunch:
    """One validated launch, ready to be called any number of times.

    Attributes:
        step: "plan", "verify", "write" or "scatter" — the backend method a call runs.
        launch: the normalized launch (NumPy/CuPy views of the bound buffers, plain-int scalars).
        backend: the backend object resolved at bind time.
        device: where the bound buffers live.
        follows_torch_stream: True when a bound buffer is a torch CUDA tensor; calls then run on
            ``torch.cuda.current_stream(device)`` as it is at call time. Otherwise CUDA launches run on CuPy's
            current stream at call time, and CPU launches run inline.
        arguments: the objects bound (held, so that they outlive the launch).
        guards: one storage check per bound torch tensor, run before every call.
    """

    step: str
    launch: Any
    backend: Backend
    device: Device
    follows_torch_stream: bool
    arguments: tuple[Any, ...] = ()
    guards: tuple[StorageGuard, ...] = ()
    runner: Callable[[], None] | None = None  # the kernel launches prepared once (kernel backends), else None

    def check(self) -> None:
        """The storage check of every bound torch tensor, alone: a caller that runs several bound launches
        checks them all first, so that a refusal comes before any of them has written anything."""
        for guard in self.guards:
            guard.check()

    def __call__(self) -> None:
        """Run the bound launch once on the buffers' current contents. No conversion, no validation beyond
        the storage check of bound torch tensors (a pointer and size comparison each)."""
        self.check()
        self.run_checked()

    def run_checked(self) -> None:
        """Run the bound launch without its storage check: for a caller that ran :meth:`check` (or the
        :func:`distinct_guards` of several launches) just before, with nothing in between that could move a
        tensor."""
        if self.device.kind == "cpu":
            if self.runner is not None:
                self.runner()
            else:
                getattr(self.backend, self.step)(self.launch)
            return
        with self._cuda_scope():
            getattr(self.backend, self.step)(self.launch)

    @contextlib.contextmanager
    def _cuda_scope(self) -> Iterator[None]:
        cupy = sys.modules["cupy"]  # imported at bind time: the bound CuPy views exist
        index = self.device.index
        with cupy.cuda.Device(index):
            if not self.follows_torch_stream:
                yield
                return
            torch = sys.modules["torch"]
            pointer = int(torch.cuda.current_stream(index).cuda_stream)
            with cupy_stream_for(cupy, index, pointer):
                yield

    @property
    def backend_name(self) -> str:
        return str(getattr(self.backend, "name", type(self.backend).__name__))

    def __repr__(self) -> str:
        stream = "torch current stream" if self.follows_torch_stream else "CuPy current stream"
        where = "inline" if self.device.kind == "cpu" else stream
        return f"BoundLaunch({self.step}, backend={self.backend_name}, device={self.device}, {where})"


def distinct_guards(launches: Iterable[BoundLaunch | None]) -> tuple[StorageGuard, ...]:
    """The storage checks of several bound launches, each distinct check once: the launches of one runtime
    phase share most of their tensors (ring, counters, plans)."""
    seen: set[tuple[int, int, int]] = set()
    guards = []
    for launch in launches:
        if launch is None:
            continue
        for guard in launch.guards:
            key = (id(guard.tensor), guard.pointer, guard.needed_bytes)
            if key not in seen:
                seen.add(key)
                guards.append(guard)
    return tuple(guards)


def _named_leaves(name: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``(dotted name, leaf)`` of an argument: dataclass fields (plans, contexts, sources) and sequences opened."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _named_leaves(f"{name}.{f.name}", getattr(value, f.name))
    elif isinstance(value, (tuple, list)):
        for k, item in enumerate(value):
            yield from _named_leaves(f"{name}[{k}]", item)
    else:
        yield name, value


def _bind(step: str, arguments: dict[str, Any], prepare: Callable[[], Any], backend: str,
          on_invalid: str | None) -> BoundLaunch:
    # Conversion, validation and backend resolution happen exactly as in the launchers, inside the same
    # stream scope (so DLPack imports of torch CUDA tensors name torch's current stream and need no wait).
    values = tuple(arguments.values())
    with stream_scope(*values):
        launch = prepare()
        resolved = resolve_backend(backend, launch.device, on_invalid)
    follows_torch = launch.device.kind == "cuda" and first_torch_cuda_tensor(values) is not None
    named = [leaf for name, value in arguments.items() for leaf in _named_leaves(name, value)]
    # A preset's source reads a view of the engine's tensor: the tensor itself is checked too, first.
    sources = getattr(arguments.get("context"), "real_kv_sources", ())
    owners = tuple(guard for source in sources for guard in source.owner_guards)
    # On the CPU the host backend's launches are packed once here; a CUDA launch keeps building its arguments
    # per call (CuPy packs them itself, and the first call may compile).
    prepare_launch = getattr(resolved, "prepare", None)
    runner = prepare_launch(step, launch) if launch.device.kind == "cpu" and prepare_launch is not None else None
    return BoundLaunch(step, launch, resolved, launch.device, follows_torch, values, owners + storage_guards(named),
                       runner)


def bind_plan(
    *,
    verify_plan_out: VerifyPlan,
    write_plan_out: WritePlan,
    req_pool_indices: DLPackArray | None = None,
    prefix_lens: DLPackArray,
    extend_seq_lens: DLPackArray,
    req_to_token: DLPackArray | None = None,
    swa_window_size: int,
    full_to_swa_index_mapping: DLPackArray | None,
    verify_capacity: int,
    req_to_verify_expected_tokens: DLPackArray | None = None,
    req_to_verify_expected_tokens_valid_lens: DLPackArray | None = None,
    kv_token_id_vs_position_offset: int = 0,
    layout: SlotLayout | None = None,
    backend: str = "auto",
    on_invalid: OnInvalid | None = None,
) -> BoundLaunch:
    """Bind :func:`~kvcanary_cupy.launch_canary_plan_kernels` (same arguments). Scalars such as
    ``swa_window_size`` and ``kv_token_id_vs_position_offset`` are fixed at bind time; the contents of every
    array argument are read at call time."""
    arguments = {
        "verify_plan_out": verify_plan_out, "write_plan_out": write_plan_out,
        "req_pool_indices": req_pool_indices, "prefix_lens": prefix_lens, "extend_seq_lens": extend_seq_lens,
        "req_to_token": req_to_token, "layout": layout, "full_to_swa_index_mapping": full_to_swa_index_mapping,
        "req_to_verify_expected_tokens": req_to_verify_expected_tokens,
        "req_to_verify_expected_tokens_valid_lens": req_to_verify_expected_tokens_valid_lens,
    }
    return _bind("plan", arguments, lambda: prepare_plan_launch(
        verify_plan_out=verify_plan_out, write_plan_out=write_plan_out, req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens, req_to_token=req_to_token,
        swa_window_size=swa_window_size, full_to_swa_index_mapping=full_to_swa_index_mapping,
        verify_capacity=verify_capacity, req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, function="bind_plan", layout=layout,
    ), backend, on_invalid)


def bind_verify(
    *,
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    check_verify_expected_token: bool,
    twin_canary_buf: Any = None,
    backend: str = "auto",
    on_invalid: str | None = None,
) -> BoundLaunch:
    """Bind :func:`~kvcanary_cupy.launch_canary_verify_kernel` (same arguments)."""
    return _bind("verify", {"context": context, "plan": plan}, lambda: prepare_verify_launch(
        context=context, plan=plan, check_verify_expected_token=check_verify_expected_token,
        twin_canary_buf=twin_canary_buf,
    ), backend, on_invalid)


def bind_write(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: DLPackArray,
    positions: DLPackArray,
    out_cache_loc: DLPackArray,
    enable_write_input_assert: bool,
    expected_input_tokens: DLPackArray | None = None,
    expected_input_positions: DLPackArray | None = None,
    backend: str = "auto",
    on_invalid: str | None = None,
) -> BoundLaunch:
    """Bind :func:`~kvcanary_cupy.launch_canary_write_kernel` (same arguments). ``input_ids``, ``positions``
    and ``out_cache_loc`` are bound at their padded length; pad unused tails with ``out_cache_loc = -1``."""
    arguments = {
        "context": context, "plan": plan, "input_ids": input_ids, "positions": positions,
        "out_cache_loc": out_cache_loc, "expected_input_tokens": expected_input_tokens,
        "expected_input_positions": expected_input_positions,
    }
    return _bind("write", arguments, lambda: prepare_write_launch(
        context=context, plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
    ), backend, on_invalid)


def bind_scatter(
    *,
    flat_in: DLPackArray,
    offsets: DLPackArray,
    req_pool_indices: DLPackArray,
    pool_out: DLPackArray,
    status: DLPackArray | None = None,
    backend: str = "auto",
    on_invalid: str | None = None,
) -> BoundLaunch:
    """Bind :func:`~kvcanary_cupy.launch_scatter_req_token_ids` (same arguments)."""
    arguments = {"flat_in": flat_in, "offsets": offsets, "req_pool_indices": req_pool_indices,
                 "pool_out": pool_out, "status": status}
    return _bind("scatter", arguments,
                 lambda: prepare_scatter_launch(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                                                pool_out=pool_out, status=status),
                 backend, on_invalid)


