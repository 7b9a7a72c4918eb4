"""Installing the canary into vLLM's V1 model runner, and removing it again.

Where it hooks (vLLM 0.32; the full list with what is read is :data:`.internals.INTERNALS`):

* **the step** -- ``execute_model`` of the runner, wrapped per *instance*: remembers that a real step is running
  (the runner's dummy and profile forwards never come through it) and drops the blocks the scheduler hands
  out fresh (``SchedulerOutput.new_block_ids_to_zero``) from the sweep's index.
* **the forward** -- ``_model_forward`` of the runner, wrapped per instance: inside it the forward context holds
  each layer's attention metadata (``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``); the
  canary plans, verifies and stamps HEAD before the original call and runs TAIL after it.

Everything that can be refused (options, the backend against the KV cache's device, async scheduling, the
runtime over the cache) is refused at install, before the runner is touched. A step the canary itself fails
(``raise`` mode) is undone in an in-process engine so that it keeps serving (:meth:`VllmCanary._undo_failed_step`).
``remove()`` deletes the instance attributes it set, which restores the class's methods.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..._errors import fail
from ...runtime import CanaryViolationError
from ..common.hooks import InstanceOverrides
from ..common.options import backend_refusal
from ._version import check_version
from .canary import CanaryOptions, StepViolation, VllmCanaryState, VllmStep
from .support import support_at_install


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
        super().__init__()
        self.options = CanaryOptions.from_install(options, {})
        check_version(allow_untested=self.options.allow_untested, logger=self.options.logger)
        if isinstance(target, type):
            fail(f"target must be an in-process vllm.LLM, its engine or a model runner, got the class "
                 f"{target.__name__}")
        self.runner = find_runner(target)
        if getattr(self.runner, "_kvcanary", None) is not None:
            fail("a kv-canary is already installed in this model runner; remove() it first")
        # What the canary checks here is decided now, before any request: raise mode refuses what it would leave
        # unchecked (async scheduling among them); log and off mode log it and check the rest (or nothing:
        # `disabled`, no hook placed).
        self.support = support_at_install(self.runner, self.options)
        self.disabled = self.support.disabled
        # Everything else that can be refused is refused here, before the runner is touched: the backend against
        # the device of the engine's KV cache, and (unless mode is off) the runtime over that cache, built now.
        caches = getattr(self.runner, "kv_caches", None)
        if not caches:
            fail("this model runner has no KV cache yet; install the canary once the engine is built")
        device = caches[0].device.type
        refusal = backend_refusal(self.options.backend, device)
        if refusal is not None:
            fail(f"backend={self.options.backend!r}: {refusal}")
        self.state: VllmCanaryState | None = None
        if self.options.mode != "off" and self.disabled is None:
            self.state = self._new_state()
        # The in-process engine around the runner (None for a bare runner): what a failed step is undone in.
        engine = getattr(target, "llm_engine", target)
        self._engine = engine if hasattr(engine, "output_processor") and hasattr(engine, "engine_core") else None
        self.observers: list[StepObserver] = []
        self.in_step = False
        self._hook_failed = False  # the canary's own code raised inside the current step
        self.preemptions = 0  # requests vLLM preempted while the canary watched (SchedulerOutput)
        # The TAIL work of a step starts once the runner has sampled (vLLM calls sample_tokens after an
        # execute_model that returned nothing): sampling and sending the output are the step's critical path,
        # the wait for the next step is not. A runner without it starts the work after the forward.
        self._tail_after_sampling = callable(getattr(self.runner, "sample_tokens", None))
        if self.disabled is None:
            self._set(self.runner, "execute_model", self._wrap_execute(self.runner.execute_model))
            self._set(self.runner, "_model_forward", self._wrap_forward(self.runner._model_forward))
            if self._tail_after_sampling:
                self._set(self.runner, "sample_tokens", self._wrap_sample(self.runner.sample_tokens))
        self._set(self.runner, "_kvcanary", self)
        self.installed = True
        from .connector import canary_connector_of

        self.connector = canary_connector_of()  # the canary connector of this worker: it carries the records
        if self.connector is not None:
            self.connector.attach(self)
            if self.connector.carries_records and self.state is not None:
                logging.getLogger(self.options.logger).info(
                    "kv-canary: the canary connector wraps %s: the records travel with the KV it saves and are "
                    "verified when it loads (refused loads: %s)", self.connector.wrapped, self.connector.on_refused)
        # Blocks vLLM's prefix cache holds from before the install carry no canary records: a later hit on one
        # would read as corruption. Drop them (the public LLM API; the plugin installs before any step).
        reset = getattr(target, "reset_prefix_cache", None)
        if callable(reset) and reset() is False:
            self.remove()
            fail("vLLM refused to reset its prefix cache (requests still running): install the canary while "
                 "the engine is idle")

    def remove(self) -> None:
        """Remove every instance override; the runner runs its class's methods again (after the last step's
        TAIL work, whose findings stay readable)."""
        if not self.installed:
            return
        if self.state is not None:
            self.state.close()
        connector = getattr(self, "connector", None)
        if connector is not None and connector.canary is self:
            connector.attach(None)
        self._unset_all()

    def _new_state(self) -> VllmCanaryState:
        """The runtime over the runner's KV cache (its setup time counted under its own name)."""
        start = time.perf_counter()
        state = VllmCanaryState(self.runner, self.options, self.support)
        state.seconds["setup"] += time.perf_counter() - start
        return state

    def _undo_failed_step(self) -> None:
        """Leave the in-process engine able to serve after the canary failed a step (``raise`` mode).

        vLLM's scheduler counts a step's tokens as computed when it schedules them, and only the step's output
        tells it what was sampled: a step that raises leaves a request whose prompt it finished waiting forever
        for a token that never comes (``LLM.generate`` then never returns, even with the canary removed), and a
        request it was prefilling resumes past KV the forward may never have written, while the prefix cache
        already lists those blocks. So every unfinished request of the engine (the failed call's) is aborted,
        the prefix cache is emptied, and the canary starts its records afresh, its findings kept."""
        engine = self._engine
        if engine is None:
            return
        processor = engine.output_processor
        engine.abort_request([*processor.request_states, *processor.parent_requests], internal=True)
        core = getattr(engine.engine_core, "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        leftover = [] if scheduler is None else list(scheduler.requests)
        if leftover:  # requests the engine's output side did not know
            engine.engine_core.abort_requests(leftover)
        engine.reset_prefix_cache()
        if self.state is not None:
            try:
                self.state.close()
            except Exception:  # the failure being undone is the one to report
                pass
            old, self.state = self.state, self._new_state()
            self.state.violations = old.violations
            self.state.health_problems = old.health_problems
            self.state.status_bits, self.state.dropped, self.state.steps = old.status_bits, old.dropped, old.steps
            for phase, seconds in old.seconds.items():
                self.state.seconds[phase] += seconds

    def _settle(self) -> None:
        """Wait for the last step's TAIL work; what it raised fails the step about to run, like a failure of
        the hook itself (raise mode runs the TAIL inline, so only the canary's own errors come here)."""
        assert self.state is not None
        try:
            self.state.settle()
        except BaseException as exc:
            self._hook_failed = True
            if isinstance(exc, CanaryViolationError):
                self.state._collect(exc.step_report)
            raise

    # -- results ---------------------------------------------------------------------------------------------

    @property
    def violations(self) -> list[StepViolation]:
        """The violations read so far (after the last step's TAIL work)."""
        if self.state is None:
            return []
        self.state.join_tail()
        return list(self.state.violations)

    @property
    def steps(self) -> int:
        """Engine steps the canary has finished (the last one's TAIL work included)."""
        if self.state is None:
            return 0
        self.state.join_tail()
        return self.state.steps

    def finish(self) -> list[StepViolation]:
        """Read what the last step appended (call once the engine is idle, e.g. after ``LLM.generate``)."""
        if self.state is None:
            return []
        self.state.settle()
        before = len(self.state.violations)
        self.state.flush()
        return self.state.violations[before:]

    # -- the hooks -------------------------------------------------------------------------------------------

    def _wrap_execute(self, original: Callable[..., Any]) -> Any:
        @functools.wraps(original)
        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self.in_step = True
            self._hook_failed = False
            try:
                if self.state is not None:
                    # the last step's TAIL work first: this step writes KV it may still be reading
                    self._settle()
                    self.state.forget_blocks(getattr(scheduler_output, "new_block_ids_to_zero", None))
                    self.state.drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
                self.preemptions += len(getattr(scheduler_output, "preempted_req_ids", None) or ())
                return original(scheduler_output, *args, **kwargs)
            except BaseException:
                if self._hook_failed:
                    try:
                        self._undo_failed_step()
                    except Exception:  # the step's own error is what the caller must see
                        logging.getLogger(self.options.logger).exception(
                            "kv-canary: could not undo the step it failed; the engine may need a restart")
                raise
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
            st = self.state
            if st is None:
                return original(*args, **kwargs)
            try:
                for obs in self.observers:
                    obs.before_forward(self, st.steps, kwargs, metadata)
                start = time.perf_counter()
                batch = st.read_step(kwargs, metadata)
                st.seconds["batch"] += time.perf_counter() - start
                # Inline when a connector saves the TAIL records with the KV (it reads them inside the step).
                inline = self.connector is not None and self.connector.carries_records
                st.before_forward(batch, inline=inline)
            except BaseException as exc:
                self._hook_failed = True
                if isinstance(exc, CanaryViolationError):  # raise mode: what failed the step is kept
                    st._collect(exc.step_report)
                raise
            out = original(*args, **kwargs)
            try:
                t = batch.forward_len
                written = {geo.index: np.asarray(metadata[geo.layer_names[0]].slot_mapping[:t].numpy(),
                                                 np.int64).copy() for geo in st.geos}
                st.after_forward(batch, written, inline=inline, hold=self._tail_after_sampling)
                if self.observers:
                    # an observer (fault injection) sees the step done: what it perturbs now is found by a later
                    # step, exactly as with the TAIL run inline
                    self._settle()
                for obs in self.observers:
                    obs.after_forward(self, batch.step, batch)
            except BaseException as exc:
                self._hook_failed = True
                if isinstance(exc, CanaryViolationError):  # raise mode: what failed the step is kept
                    st._collect(exc.step_report)
                raise
            return out

        return model_forward

    def _wrap_sample(self, original: Callable[..., Any]) -> Any:
        @functools.wraps(original)
        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                if self.state is not None:
                    self.state.release_tail()

        return sample_tokens


def install(target: Any, options: CanaryOptions | None = None, **option_fields: Any) -> VllmCanary:
    """Install the canary into an in-process ``vllm.LLM`` (or its engine, or a model runner); ``remove()`` the
    returned object to take it out again. ``option_fields`` build a :class:`CanaryOptions` when ``options`` is
    not given."""
    canary = VllmCanary(target, CanaryOptions.from_install(options, option_fields))
    if canary.disabled is None:
        canary.options.log_install(type(canary.runner).__name__, "cpu")
    return canary


def remove(target: Any) -> None:
    """Remove the canary installed in ``target`` (an in-process LLM or a runner), if any."""
    canary = getattr(find_runner(target), "_kvcanary", None)
    if canary is not None:
        canary.remove()
