"""kvcanary_cupy — a framework-agnostic KV-cache integrity canary for LLM serving engines.

Next to every KV slot the canary keeps a 32-byte record (token, position, hash chained from the previous
slot, fingerprint of the real KV bytes). Each step, :func:`launch_canary_plan_kernels` turns the batch into
the slots to verify and the write offsets, :func:`launch_canary_verify_kernel` checks the prefix,
:func:`launch_canary_write_kernel` stamps the new tokens, and violations land in a ring that
:func:`read_violations` decodes on the host. Between processes (disaggregated prefill and decode), the
records travel with the KV pages: :func:`gather_canary_records` on the sender, :func:`scatter_canary_records`
and :class:`ReceivedPrefixVerifier` on the receiver.

Importing this package needs NumPy only; CuPy (CUDA backend), g++ (host backend) and torch (interop) are
used when present and asked for.
"""

from __future__ import annotations

import logging

from ._errors import CanaryArgumentError
from .backends import available_backends
from .bind import BoundLaunch, bind_plan, bind_scatter, bind_verify, bind_write
from .constants import (
    CANARY_CHAIN_ANCHOR,
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    CanaryLaunchTag,
    CanaryStatus,
    FailReason,
    PlanStatus,
    RealKvHashMode,
)
from .context import RealKvSource, VerifyOrWriteContext
from .kv_layouts import KvByteLayout
from .layouts import BlockTable, PageList, SlotLayout, TokenTable
from .plan import VerifyPlan, WritePlan, launch_canary_plan_kernels
from .scatter import launch_scatter_req_token_ids
from .transfer import ReceivedPrefixVerifier, gather_canary_records, scatter_canary_records
from .verify import launch_canary_verify_kernel
from .violations import Violation, ViolationReport, format_violations, read_violations
from .write import launch_canary_write_kernel

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it from here)

# The library logs (compiles, backend choice, fallbacks) and prints nothing; applications attach handlers.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "CANARY_CHAIN_ANCHOR",
    "CANARY_SLOT_BYTES",
    "MAX_REAL_KV_SOURCES",
    "BlockTable",
    "BoundLaunch",
    "CanaryArgumentError",
    "CanaryLaunchTag",
    "CanaryStatus",
    "FailReason",
    "KvByteLayout",
    "PageList",
    "PlanStatus",
    "RealKvHashMode",
    "RealKvSource",
    "ReceivedPrefixVerifier",
    "SlotLayout",
    "TokenTable",
    "VerifyOrWriteContext",
    "VerifyPlan",
    "Violation",
    "ViolationReport",
    "WritePlan",
    "available_backends",
    "bind_plan",
    "bind_scatter",
    "bind_verify",
    "bind_write",
    "format_violations",
    "gather_canary_records",
    "launch_canary_plan_kernels",
    "launch_canary_verify_kernel",
    "launch_canary_write_kernel",
    "launch_scatter_req_token_ids",
    "read_violations",
    "scatter_canary_records",
]
