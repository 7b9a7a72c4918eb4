"""The canary in Hugging Face transformers' continuous batching (``generate_batch`` / ``ContinuousBatchingManager``).

``install(model_or_manager)`` hooks the engine's batch, its K/V writes and its forward; ``remove()`` takes every
hook out again. Needs ``transformers`` in the tested range (``pip install 'kvcanary_cupy[transformers]'``):
``install`` checks the installed version and refuses any other with a ``kv-canary:`` ValueError naming the range.
"""

from __future__ import annotations

from ...runtime import CanaryHealthError, CanaryViolationError
from ._version import SUPPORTED_RANGE, check_version
from .canary import CanaryOptions, StepViolation
from .hooks import TransformersCanary, install, remove

__all__ = [
    "SUPPORTED_RANGE",
    "CanaryHealthError",
    "CanaryOptions",
    "CanaryViolationError",
    "StepViolation",
    "TransformersCanary",
    "check_version",
    "install",
    "remove",
]
