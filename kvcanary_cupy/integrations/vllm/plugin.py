"""vLLM general plugin (entry point group ``vllm.general_plugins``, name ``kvcanary``): the canary in whichever
process builds the model runner, with no code change, when ``KVCANARY_VLLM`` asks for it.

``KVCANARY_VLLM=log|raise|off`` turns it on (unset or empty: the plugin does nothing at all);
``KVCANARY_VLLM_REAL_KV_HASH``, ``_WITH_V``, ``_BACKEND``, ``_RING_CAPACITY``, ``_SWEEP_INTERVAL``, ``_LOG_ROWS``
set the other :class:`~.canary.CanaryOptions`; ``KVCANARY_VLLM_FAULT=<kind>[@step]`` injects one fault of
:mod:`.faults` (for drills: it corrupts the engine on purpose).

vLLM calls :func:`register` in every process it starts (API server, engine core, worker). It wraps
``GPUModelRunner.execute_model`` once, at class level; the first step of each runner installs a
:class:`~.hooks.VllmCanary` on that instance. Findings go to the ``kvcanary_cupy.vllm`` logger
with the record's structured fields (``extra["kv_canary"]``) appended as JSON (a bounded number of lines per
step: :func:`kvcanary_cupy.runtime.reporting.publish`), and, where ``prometheus_client`` writes to a
``PROMETHEUS_MULTIPROC_DIR`` the server reads (set it before ``vllm serve``), to the counters of
:mod:`kvcanary_cupy.integrations.common.metrics` on the server's ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from .canary import CanaryOptions

_state: dict[str, Any] = {}


class _StructuredFormatter(logging.Formatter):
    """``kv-canary: ... kv_canary={json}``: the record's structured fields, machine-readable on one line."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "kv_canary", None)
        return f"{text} kv_canary={json.dumps(fields, sort_keys=True)}" if fields is not None else text


def _logger(name: str) -> None:
    logger = logging.getLogger(name)
    if not any(isinstance(h.formatter, _StructuredFormatter) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(_StructuredFormatter(f"%(levelname)s [pid {os.getpid()}] %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def register() -> None:
    """The entry point vLLM calls in each of its processes."""
    options = CanaryOptions.from_env()
    if options is None or "original" in _state:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from .hooks import VllmCanary

    _logger(options.logger)
    fault = os.environ.get("KVCANARY_VLLM_FAULT", "").strip()
    original = GPUModelRunner.execute_model
    _state["original"] = original

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if "_kvcanary" in vars(self):
            return original(self, scheduler_output, *args, **kwargs)
        canary = VllmCanary(self, options)
        if canary.disabled is not None:  # said once, at install (support.py); the engine runs unchecked
            return self.execute_model(scheduler_output, *args, **kwargs)
        if fault:
            from .faults import injector

            kind, _, at = fault.partition("@")
            canary.observers.append(injector(kind, int(at or 3)))
        options.log_install(type(self).__name__, "cpu")
        return self.execute_model(scheduler_output, *args, **kwargs)

    GPUModelRunner.execute_model = execute_model


def unregister() -> None:
    """Put ``GPUModelRunner.execute_model`` back (tests; runners already hooked keep their instance hooks)."""
    original = _state.pop("original", None)
    if original is not None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner.execute_model = original
