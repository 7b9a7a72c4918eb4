"""vLLM general plugin (entry point group ``vllm.general_plugins``, name ``kvcanary``): the canary in whichever
process builds the model runner, with no code change, when ``KVCANARY_VLLM`` asks for it.

``KVCANARY_VLLM=log|raise|off`` turns it on (unset or empty: the plugin does nothing at all);
``KVCANARY_VLLM_REAL_KV_HASH``, ``_WITH_V``, ``_BACKEND``, ``_RING_CAPACITY``, ``_SWEEP_INTERVAL`` set the
other :class:`~.canary.CanaryOptions`; ``KVCANARY_VLLM_FAULT=<kind>[@step]`` injects one fault of
:mod:`.faults` (for drills: it corrupts the engine on purpose).

vLLM calls :func:`register` in every process it starts (API server, engine core, worker). It wraps
``GPUModelRunner.execute_model`` once, at class level; the first step of each runner installs a
:class:`~.hooks.VllmCanary` on that instance. Findings go to the ``kvcanary_cupy.vllm`` logger as one line each
with the record's structured fields (``extra["kv_canary"]``) appended as JSON, and, where ``prometheus_client``
writes to a ``PROMETHEUS_MULTIPROC_DIR`` the server reads (set it before ``vllm serve``), to the counters
``kvcanary_steps_total`` and ``kvcanary_violations_total{reason}`` on the server's ``/metrics``.
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


class _Metrics:
    """Prometheus counters fed after every step (None where prometheus_client is missing)."""

    def __init__(self) -> None:
        try:
            from prometheus_client import Counter
        except ImportError:
            self.steps = self.violations = None
            return
        self.steps = Counter("kvcanary_steps", "Engine steps checked by the kv-canary")
        self.violations = Counter("kvcanary_violations", "KV-cache integrity violations found by the kv-canary",
                                  ["reason"])
        self.seen = 0

    def before_forward(self, canary: Any, step: int, kwargs: dict[str, Any], metadata: dict[str, Any]) -> None:
        pass

    def after_forward(self, canary: Any, step: int, batch: Any) -> None:
        if self.steps is None or self.violations is None or canary.state is None:
            return
        self.steps.inc()
        found = canary.state.violations
        for v in found[self.seen:]:
            for reason in v.violation.reasons:
                self.violations.labels(reason=reason).inc()
        self.seen = len(found)


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
        canary.observers.append(_Metrics())
        if fault:
            from .faults import injector

            kind, _, at = fault.partition("@")
            canary.observers.append(injector(kind, int(at or 3)))
        logging.getLogger(options.logger).info("kv-canary installed in %s (mode=%s, real_kv_hash=%s)",
                                               type(self).__name__, options.mode, options.real_kv_hash)
        return self.execute_model(scheduler_output, *args, **kwargs)

    GPUModelRunner.execute_model = execute_model


def unregister() -> None:
    """Put ``GPUModelRunner.execute_model`` back (tests; runners already hooked keep their instance hooks)."""
    original = _state.pop("original", None)
    if original is not None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner.execute_model = original
