"""vLLM general plugin (entry point group ``vllm.general_plugins``, name ``kvcanary``): the canary in whichever
process builds the model runner, with no code change, when ``KVCANARY_VLLM`` asks for it.

``KVCANARY_VLLM=log|raise|off`` turns it on (unset or empty: the plugin does nothing at all);
``KVCANARY_VLLM_REAL_KV_HASH``, ``_WITH_V``, ``_BACKEND``, ``_RING_CAPACITY``, ``_SWEEP_INTERVAL``, ``_LOG_ROWS``
set the other :class:`~.canary.CanaryOptions`; ``KVCANARY_VLLM_FAULT=<kind>[@step][:rank<R>]`` injects one fault of
:mod:`.faults` (for drills: it corrupts the engine on purpose), in the worker of rank ``R`` only when given.

vLLM calls :func:`register` in every process it starts (API server, engine core, worker); it refuses any
``KVCANARY_VLLM*`` value outside its documented range, a backend the build's device cannot run, or a name it does
not know, so that vLLM stops before it serves. It wraps ``GPUModelRunner.initialize_kv_cache`` once, at class level:
when a runner has built its KV cache, a :class:`~.hooks.VllmCanary` is installed on that instance (or, where the
canary cannot check that model, one ERROR line says so and the engine runs unchecked).
Findings go to the ``kvcanary_cupy.vllm`` logger with the record's structured fields (``extra["kv_canary"]``)
appended as JSON (a bounded number of lines per step: :func:`kvcanary_cupy.runtime.reporting.publish`), and,
where ``prometheus_client`` writes to a ``PROMETHEUS_MULTIPROC_DIR`` the server reads (set it before
``vllm serve``), to the counters of :mod:`kvcanary_cupy.integrations.common.metrics` on the server's ``/metrics``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

from ... import settings
from ..._errors import fail
from ..common.options import backend_refusal
from .canary import CanaryOptions

_state: dict[str, Any] = {}


class _StructuredFormatter(logging.Formatter):
    """``kv-canary: ... kv_canary={json}``: the record's structured fields, machine-readable on one line. In a
    worker of a distributed engine (more than one rank) each line names the worker's rank after its pid, and the
    structured fields carry it as ``rank``: every rank checks and reports its own shard."""

    def format(self, record: logging.LogRecord) -> str:
        rank = _state.get("rank")
        record.kv_rank = "" if rank is None else f" rank {rank}"
        text = super().format(record)
        fields = getattr(record, "kv_canary", None)
        if fields is not None and rank is not None:
            fields = {**fields, "rank": rank}
        return f"{text} kv_canary={json.dumps(fields, sort_keys=True)}" if fields is not None else text


def _logger(name: str) -> None:
    logger = logging.getLogger(name)
    if not any(isinstance(h.formatter, _StructuredFormatter) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(
            _StructuredFormatter(f"%(levelname)s [pid {os.getpid()}%(kv_rank)s] %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _check_platform(options: CanaryOptions) -> None:
    """Refuse, at registration, a setting this vLLM build cannot run: the integration checks vLLM's CPU build
    (a CUDA runner's metadata and caches need device copies it does not make yet), and the backend must run on
    the device the KV cache will live on."""
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    if device != "cpu":
        fail(f"KVCANARY_VLLM={options.mode} asks for the canary, but the vLLM integration runs on vLLM's CPU build "
             f"only and this vLLM runs on {device}; unset KVCANARY_VLLM")
    refusal = backend_refusal(options.backend, device)
    if refusal is not None:
        fail(f"KVCANARY_VLLM_BACKEND={options.backend}: {refusal}")


def register() -> None:
    """The entry point vLLM calls in each of its processes: every ``KVCANARY_VLLM*`` variable is checked here,
    so that a wrong one stops vLLM before it serves (the refusal names the variable); the canary itself is
    installed in each model runner once its KV cache exists (:func:`_install_after_kv_cache`)."""
    options = CanaryOptions.from_env()
    if options is None or "original" in _state:
        return
    fault = settings.read("KVCANARY_VLLM_FAULT")
    wrapped = settings.read("KVCANARY_VLLM_CONNECTOR")
    settings.read("KVCANARY_VLLM_CONNECTOR_ON_REFUSED")
    _check_platform(options)
    if wrapped is not None:  # vLLM's connector factory builds the canary connector around that connector
        from .connector import wrap_factory

        wrap_factory(wrapped)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _logger(options.logger)
    original = GPUModelRunner.initialize_kv_cache
    _state["original"] = original

    @functools.wraps(original)
    def initialize_kv_cache(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, kv_cache_config, *args, **kwargs)
        if not (kwargs.get("is_profiling") or (args and args[0] is True)):
            _install_after_kv_cache(self, options, fault)
        return out

    GPUModelRunner.initialize_kv_cache = initialize_kv_cache


def _install_after_kv_cache(runner: Any, options: CanaryOptions, fault: tuple[str, int, int | None] | None
                            ) -> None:
    """Install the canary in ``runner``, whose KV cache has just been built (before any request is served). What
    the canary cannot check here (a model or cache it does not handle) is logged and left unchecked: the monitor
    never stops the engine."""
    from .distributed import worker_rank
    from .hooks import VllmCanary

    rank, world = worker_rank(runner)
    if world > 1:  # the log lines of this process name its rank from now on
        _state["rank"] = rank
    logger = logging.getLogger(options.logger)
    old = getattr(runner, "_kvcanary", None)
    if old is not None:  # the KV cache was built again: the canary follows the new one
        old.remove()
    try:
        canary = VllmCanary(runner, options)
    except Exception as exc:  # whatever it is, the engine serves on: said once, at startup
        if options.mode == "raise" and isinstance(exc, ValueError):
            raise  # raise mode refuses what it cannot check before vLLM serves (the engine fails to start)
        reason = str(exc).removeprefix("kv-canary: ") if isinstance(exc, ValueError) else \
            f"{type(exc).__name__}: {exc}"
        logger.error("kv-canary not installed in %s, its KV cache is left unchecked: %s", type(runner).__name__,
                     reason)
        return
    if canary.disabled is not None:  # said once, at install (support.py); the engine runs unchecked
        return
    if fault is not None:
        from .faults import injector

        kind, at, fault_rank = fault
        canary.observers.append(injector(kind, at, rank=fault_rank))
    options.log_install(type(runner).__name__, "cpu")


def unregister() -> None:
    """Put ``GPUModelRunner.initialize_kv_cache`` back (tests; runners already hooked keep their canary)."""
    from .connector import unwrap_factory

    unwrap_factory()
    original = _state.pop("original", None)
    if original is not None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner.initialize_kv_cache = original
