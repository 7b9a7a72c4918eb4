"""Installing the canary into transformers' continuous batching, and removing it again.

Where it hooks (transformers 5.24; see docs/transformers.md):

* **batch** -- a forward pre-hook on the model (``nn.Module.register_forward_pre_hook(with_kwargs=True)``, public
  torch API). Calls whose ``cache`` is not a ``PagedAttentionCache`` (plain ``generate``) are ignored. The
  request list is the batch processor's ``inputs_and_outputs.requests_in_batch`` (public name on an internal
  class); the block tables are ``allocator.block_table``.
* **K/V writes** -- ``update`` of every cache allocator of the cache (``FullAttentionCacheAllocator.update`` /
  ``SlidingAttentionCacheAllocator.update``, internal), wrapped per *instance* so that nothing else is touched:
  the wrapper records the ``write_index`` each layer really writes with, then calls the original.
* **after the forward** -- a forward hook on the model (public torch API): the TAIL launches.
* **block copies** -- ``copy_blocks`` of every cache allocator (internal, wrapped per instance): when the engine
  forks a request it copies whole blocks; the canary records of those slots are copied with them.
* **managers** -- when installed on a model, ``model.init_continuous_batching`` (public) is wrapped on the
  instance to learn the managers it creates (``manager.batch_processor`` gives the request list).

``remove()`` deletes every instance attribute it set and every hook handle, which restores the original methods.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..._errors import fail
from ..common.hooks import InstanceOverrides
from ..common.options import backend_refusal
from ..common.state import HostViews
from ._version import check_version
from .batch import StepBatch, build_step_batch
from .canary import CanaryOptions, StepViolation, TransformersCanaryState


class StepObserver(Protocol):
    """Something that watches (or, for fault injection, perturbs) the engine at the canary's hook points."""

    def before_batch(self, canary: TransformersCanary, step: int, kwargs: dict[str, Any], requests: list[Any],
                     cache: Any) -> None: ...

    def on_layer_write(self, canary: TransformersCanary, step: int, allocator: Any, layer_idx: int,
                       write_index: Any) -> Any: ...

    def after_forward(self, canary: TransformersCanary, step: int, batch: StepBatch, cache: Any) -> None: ...

    # Optional: ``on_block_copy(canary, step, allocator, source_block_ids, dest_block_ids)``, called after the
    # engine copied blocks (a fork) and the canary copied their records.


class TransformersCanary(InstanceOverrides):
    """The canary installed in one transformers model or continuous-batching manager (:func:`install`)."""

    def __init__(self, target: Any, options: CanaryOptions | None = None) -> None:
        check_version()
        super().__init__()
        from transformers.generation.continuous_batching import ContinuousBatchingManager
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        self._paged_cache_type = PagedAttentionCache
        self.options = CanaryOptions.from_install(options, {})
        self._managers: list[Any] = []
        self.model: Any
        if isinstance(target, type):
            fail(f"target must be a model instance or a ContinuousBatchingManager, got the class {target.__name__} "
                 "(instantiate it, e.g. with from_pretrained)")
        if isinstance(target, ContinuousBatchingManager):
            self.model = target.model
            self._managers.append(target)
        elif hasattr(target, "init_continuous_batching") and hasattr(target, "register_forward_pre_hook"):
            self.model = target
        else:
            fail(f"target must be a transformers model with continuous batching or a ContinuousBatchingManager, "
                 f"got {type(target).__name__}")
        if getattr(self.model, "_kvcanary", None) is not None:
            fail("a kv-canary is already installed in this model; remove() it first")
        # the backend against the device the model (and so its paged KV cache) lives on, before anything is hooked
        device = getattr(getattr(self.model, "device", None), "type", "cpu")
        refusal = backend_refusal(self.options.backend, device)
        if refusal is not None:
            fail(f"backend={self.options.backend!r}: {refusal}")
        self.states: dict[int, TransformersCanaryState] = {}
        self.observers: list[StepObserver] = []
        self._current: tuple[TransformersCanaryState, StepBatch] | None = None
        self._layer_writes: dict[tuple[int, int], np.ndarray] = {}
        self._host = HostViews()  # the engine's per-step tensors as NumPy (kept views of its static buffers)
        self._handles = [
            self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            self.model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]
        original_init: Callable[..., Any] = self.model.init_continuous_batching

        @functools.wraps(original_init)
        def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
            manager = original_init(*args, **kwargs)
            if manager not in self._managers:
                self._managers.append(manager)
            return manager

        self._set(self.model, "init_continuous_batching", init_continuous_batching)
        self.model._kvcanary = self
        self._wrapped.append((self.model, "_kvcanary"))
        self.installed = True

    # -- install / remove ------------------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove every hook and instance override; the engine runs its original methods again."""
        if not self.installed:
            return
        for handle in self._handles:
            handle.remove()
        self._unset_all()
        self._host.clear()

    # -- results ---------------------------------------------------------------------------------------------

    @property
    def violations(self) -> list[StepViolation]:
        return [v for st in self.states.values() for v in st.violations]

    @property
    def steps(self) -> int:
        return sum(st.steps for st in self.states.values())

    def finish(self) -> list[StepViolation]:
        """Read what the last step appended (call once the engine is idle, e.g. after ``generate_batch``)."""
        before = len(self.violations)
        for st in self.states.values():
            st.flush()
        return self.violations[before:]

    # -- the hooks -------------------------------------------------------------------------------------------

    def _state_for(self, cache: Any) -> TransformersCanaryState:
        st = self.states.get(id(cache))
        if st is None or st.cache is not cache:
            max_requests = None
            for manager in self._managers:
                processor = getattr(manager, "batch_processor", None)
                if processor is not None and processor.cache is cache:
                    cfg = getattr(manager, "continuous_batching_config", None)
                    max_requests = getattr(cfg, "max_requests_per_batch", None) or None
            start = time.perf_counter()
            st = TransformersCanaryState(cache, self.options, max_requests)
            # once per cache (the runtime, its buffers and bound launches): counted, under its own name
            st.seconds["setup"] += time.perf_counter() - start
            self.states[id(cache)] = st
            for allocator in cache.cache_allocators.values():
                self._set(allocator, "update", self._wrap_update(allocator, allocator.update, st))
                self._set(allocator, "copy_blocks", self._wrap_copy_blocks(allocator, allocator.copy_blocks, st))
        return st

    def _requests_for(self, cache: Any) -> list[Any]:
        for manager in self._managers:
            processor = getattr(manager, "batch_processor", None)
            if processor is not None and processor.cache is cache:
                _check_supported(processor)
                return list(processor.inputs_and_outputs.requests_in_batch)
        fail("the model ran a paged-cache forward outside every continuous-batching manager the canary "
             "knows; install the canary before init_continuous_batching / generate_batch, or on the manager")

    def _wrap_update(self, allocator: Any, original: Callable[..., Any], st: TransformersCanaryState) -> Any:
        import torch

        @torch.compiler.disable  # the engine's own update is not compiled either (views of the cache tensor)
        def update(key_states: Any, value_states: Any, layer_idx: int, read_index: Any, write_index: Any) -> Any:
            for obs in self.observers:
                write_index = obs.on_layer_write(self, st.steps, allocator, layer_idx, write_index)
            start = time.perf_counter()
            self._layer_writes[(int(allocator.index), int(layer_idx))] = self._host(write_index).astype(np.int64)
            st.seconds["batch"] += time.perf_counter() - start
            return original(key_states, value_states, layer_idx, read_index, write_index)

        return update

    def _wrap_copy_blocks(self, allocator: Any, original: Callable[..., Any], st: TransformersCanaryState) -> Any:
        def copy_blocks(source_block_ids: list[int], dest_block_ids: list[int]) -> None:
            original(source_block_ids, dest_block_ids)
            st.copy_blocks(int(allocator.index), source_block_ids, dest_block_ids)
            for obs in self.observers:
                hook = getattr(obs, "on_block_copy", None)
                if hook is not None:
                    hook(self, st.steps, allocator, source_block_ids, dest_block_ids)

        return copy_blocks

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache")
        if not isinstance(cache, self._paged_cache_type):
            return None
        st = self._state_for(cache)
        requests = self._requests_for(cache)
        for obs in self.observers:
            obs.before_batch(self, st.steps, kwargs, requests, cache)
        start = time.perf_counter()
        batch = build_step_batch(st.steps, kwargs, requests, st.geos, st.tables, self._host)
        st.seconds["batch"] += time.perf_counter() - start
        self._layer_writes.clear()
        st.before_forward(batch)
        self._current = (st, batch)
        return None

    def _after_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._current is None or not isinstance(kwargs.get("cache"), self._paged_cache_type):
            return None
        st, batch = self._current
        self._current = None
        t = int(batch.input_ids.shape[0])
        written = {}
        for geo in st.geos:
            if kwargs.get("block_table") is not None:  # the decode fast path: the attention kernel writes
                written[geo.index] = batch.head_locs[geo.index]  # through the block table, no update() to watch
                continue
            seen = [self._layer_writes.get((geo.index, layer)) for layer in geo.layer_indices]
            writes = [w for w in seen if w is not None and w.shape[0] >= t]
            if len(writes) != len(seen):
                written[geo.index] = np.full(t, -1, np.int64)  # a layer did not write: stamp nothing
                continue
            loc = writes[0][:t].copy()
            for w in writes[1:]:
                loc[w[:t] != loc] = -1  # layers disagree on where the token went: leave the slot unstamped
            loc[loc == geo.write_trash_index] = -1
            written[geo.index] = loc
        st.after_forward(batch, written)
        for obs in self.observers:
            obs.after_forward(self, batch.step, batch, st.cache)
        return None


def _check_supported(processor: Any) -> None:
    """Refuse the engine modes whose steps the hooks cannot follow (all are off on a CPU)."""
    if getattr(processor, "use_async_batching", False):
        fail("async batching is not supported (the request state lags the batch by one step there); "
             "use ContinuousBatchingConfig(use_async_batching=False)")
    runner = getattr(processor, "model_runner", None)
    if getattr(runner, "use_cuda_graph_varlen", False) or getattr(runner, "use_cuda_graph_decode", False):
        fail("CUDA graphs are not supported (the hooks run host code inside the captured forward); "
             "use ContinuousBatchingConfig(use_cuda_graph=False)")


def install(target: Any, options: CanaryOptions | None = None, **option_fields: Any) -> TransformersCanary:
    """Install the canary into a transformers model (before ``generate_batch`` / ``init_continuous_batching``) or
    a ``ContinuousBatchingManager``; ``remove()`` the returned object to take it out again. ``option_fields``
    build a :class:`CanaryOptions` when ``options`` is not given."""
    canary = TransformersCanary(target, CanaryOptions.from_install(options, option_fields))
    device = getattr(canary.model, "device", None)
    canary.options.log_install(type(canary.model).__name__, "cuda" if getattr(device, "type", "cpu") == "cuda"
                               else "cpu")
    return canary


def remove(target: Any) -> None:
    """Remove the canary installed in ``target`` (a model or manager), if any."""
    model = getattr(target, "model", target)
    canary = getattr(model, "_kvcanary", None)
    if canary is not None:
        canary.remove()
