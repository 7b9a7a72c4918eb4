"""The canary as one object an engine installs: configuration, KV pools, capacities, and the per-step protocol
(SPEC §7) with log/raise, sweep, health check and stats.

    from kvcanary_cupy.runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools, StepBatch

    rt = CanaryRuntime.create(CanaryConfig(mode="raise"), KvPools((KvGroup.full("FULL", n, sources),),
                              req_to_token=req_to_token), Capacities(max_batch_size=64, max_tokens=4096))
    rt.prepare(batch); rt.pre_forward(); forward(); rt.post_forward(); rt.finish_step()

Modules: :mod:`.config` (switches, capacities), :mod:`.pools` (groups and layout), :mod:`.batch` (the
batch and its staged copy), :mod:`.groups` (per-group buffers and bound launches), :mod:`.scalars` (device
words and their snapshots), :mod:`.space` (device, framework, streams, pinned memory), :mod:`.reporting`
(step reports, exceptions, logging) and :mod:`.runtime` (the object, its creation and its four phases), built from
one class per concern: :mod:`.moves` (record moves between slots and tiers), :mod:`.sweep` (the sweep),
:mod:`.monitor` (snapshots, ring reads, health and stats) over :mod:`.base` (their shared state and launch helpers).
"""

from __future__ import annotations

from .batch import StepBatch
from .config import CanaryConfig, Capacities, verify_latency_bound
from .groups import Endpoint, GroupState
from .pools import KvGroup, KvPools
from .reporting import CanaryHealthError, CanaryViolationError, StepReport
from .runtime import CanaryRuntime, LaunchEvent, OffloadedRecords, SweepSource

__all__ = [
    "CanaryConfig",
    "CanaryHealthError",
    "CanaryRuntime",
    "CanaryViolationError",
    "Capacities",
    "Endpoint",
    "GroupState",
    "KvGroup",
    "KvPools",
    "LaunchEvent",
    "OffloadedRecords",
    "StepBatch",
    "StepReport",
    "SweepSource",
    "verify_latency_bound",
]
