"""Installing the canary into vLLM's V1 model runner, and removing it again.

Where it hooks (vLLM 0.32; the full list with what is read is :data:`.internals.INTERNALS`):

* **the step** -- ``execute_model`` of the runner, wrapped per *instance*: remembers that a real step is running
  (the runner's dummy and profile forwards never come through it) and drops the blocks the scheduler hands
  out fresh (``SchedulerOutput.new_block_ids_to_zero``) from the sweep's index.
* **the forward** -- ``_model_forward`` of the runner, wrapped per instance: inside it the forward context holds
  each layer's attention metadata (``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``); the
  canary plans, verifies and stamps HEAD before the original call and runs TAIL after it.

``remove()`` deletes the instance attributes it set, which restores the class's methods.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..._errors import fail
from ..common.hooks import InstanceOverrides
from ._version import check_version
from .canary import CanaryOptions, StepViolation, VllmCanaryState, VllmStep


class StepObserver(Protocol):
    """Something that watches (or, for fault injection, perturbs) the engine at the canary's hook points."""

    def before_forward(self, canary: VllmCanary, step: int, kwargs: dict[str, Any], metadata: dict[str, Any]
                       ) -> None: ...

    def after_forward(self, canary: VllmCanary, step: int, batch: VllmStep) -> None: ...


def find_runner(target: Any) -> Any:
    """The model runner of an in-process ``vllm.LLM`` / ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or
    ``target`` itself when it is a runner."""
    if hasattr(target, "_model_forward") and hasattr(target, "execute_model"):
        return target
    engine = getattr(target, "llm_engine", target)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    if core is None:
        fail(f"target must be an in-process vllm.LLM, LLMEngine or model runner, got {type(target).__name__} "
             "(with VLLM_ENABLE_V1_MULTIPROCESSING=1 the runner lives in another process: use the plugin, "
             "KVCANARY_VLLM=log)")
    try:
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        fail("this vllm.LLM has no in-process model runner (multiprocess executor); use the plugin "
             "(KVCANARY_VLLM=log)")


class VllmCanary(InstanceOverrides):
    """The canary installed in one vLLM model runner (:func:`install`)."""

    def __init__(self, target: Any, options: CanaryOptions | None = None) -> None:
        check_version()
        super().__init__()
        self.options = CanaryOptions.from_install(options, {})
        if isinstance(target, type):
            fail(f"target must be an in-process vllm.LLM, its engine or a model runner, got the class "
                 f"{target.__name__}")
        self.runner = find_runner(target)
        if getattr(self.runner, "_kvcanary", None) is not None:
            fail("a kv-canary is already installed in this model runner; remove() it first")
        self.state: VllmCanaryState | None = None
        self.observers: list[StepObserver] = []
        self.in_step = False
        self.preemptions = 0  # requests vLLM preempted while the canary watched (SchedulerOutput)
        self._set(self.runner, "execute_model", self._wrap_execute(self.runner.execute_model))
        self._set(self.runner, "_model_forward", self._wrap_forward(self.runner._model_forward))
        self._set(self.runner, "_kvcanary", self)
        self.installed = True
        # Blocks vLLM's prefix cache holds from before the install carry no canary records: a later hit on one
        # would read as corruption. Drop them (the public LLM API; the plugin installs before any step).
        reset = getattr(target, "reset_prefix_cache", None)
        if callable(reset) and reset() is False:
            self.remove()
            fail("vLLM refused to reset its prefix cache (requests still running): install the canary while "
                 "the engine is idle")

    def remove(self) -> None:
        """Remove every instance override; the runner runs its class's methods again."""
        if not self.installed:
            return
        self._unset_all()

    # -- results ---------------------------------------------------------------------------------------------

    @property
    def violations(self) -> list[StepViolation]:
        return [] if self.state is None else list(self.state.violations)

    @property
    def steps(self) -> int:
        return 0 if self.state is None else self.state.steps

    def finish(self) -> list[StepViolation]:
        """Read what the last step appended (call once the engine is idle, e.g. after ``LLM.generate``)."""
        if self.state is None:
            return []
        before = len(self.state.violations)
        self.state.flush()
        return self.state.violations[before:]

    # -- the hooks -------------------------------------------------------------------------------------------

    def _wrap_execute(self, original: Callable[..., Any]) -> Any:
        @functools.wraps(original)
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if self.state is not None:
                self.state.forget_blocks(getattr(scheduler_output, "new_block_ids_to_zero", None))
            self.preemptions += len(getattr(scheduler_output, "preempted_req_ids", None) or ())
            self.in_step = True
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                self.in_step = False

        return execute_model

    def _wrap_forward(self, original: Callable[..., Any]) -> Any:
        from vllm.forward_context import get_forward_context

        @functools.wraps(original)
        def model_forward(*args: Any, **kwargs: Any) -> Any:
            if not self.in_step or self.options.mode == "off" or args:
                return original(*args, **kwargs)
            metadata = get_forward_context().attn_metadata
            if not isinstance(metadata, dict) or not metadata or kwargs.get("input_ids") is None:
                return original(*args, **kwargs)
            if self.state is None:
                start = time.perf_counter()
                self.state = VllmCanaryState(self.runner, self.options)
                # once per install (the runtime, its buffers and bound launches): counted, under its own name
                self.state.seconds["setup"] += time.perf_counter() - start
            st = self.state
            for obs in self.observers:
                obs.before_forward(self, st.steps, kwargs, metadata)
            start = time.perf_counter()
            batch = st.read_step(kwargs, metadata)
            st.seconds["batch"] += time.perf_counter() - start
            st.before_forward(batch)
            out = original(*args, **kwargs)
            t = batch.forward_tokens
            written = {geo.index: np.asarray(metadata[geo.layer_names[0]].slot_mapping[:t].numpy(), np.int64).copy()
                       for geo in st.geos}
            st.after_forward(batch, written)
            for obs in self.observers:
                obs.after_forward(self, batch.step, batch)
            return out

        return model_forward


def install(target: Any, options: CanaryOptions | None = None, **option_fields: Any) -> VllmCanary:
    """Install the canary into an in-process ``vllm.LLM`` (or its engine, or a model runner); ``remove()`` the
    returned object to take it out again. ``option_fields`` build a :class:`CanaryOptions` when ``options`` is
    not given."""
    return VllmCanary(target, CanaryOptions.from_install(options, option_fields))


def remove(target: Any) -> None:
    """Remove the canary installed in ``target`` (an in-process LLM or a runner), if any."""
    canary = getattr(find_runner(target), "_kvcanary", None)
    if canary is not None:
        canary.remove()
