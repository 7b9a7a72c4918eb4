"""Disaggregated serving: one prefill process and N decode workers exchange KV pages and canary records over
``torch.distributed`` (gloo on CPU, NCCL with GPUs; loopback addresses only), and every transfer fault is
caught on the decode side before the request's first decode step.

``kvcanary simulate --disaggregated --decode-workers N`` runs it; from Python::

    from kvcanary_cupy.sim.disagg import DisaggConfig, run_disaggregated

    report = run_disaggregated(DisaggConfig(decode_workers=2, inject={"page-swap": 0.2}))

Modules: :mod:`.config` (options), :mod:`.faults` (the transfer fault kinds and their schedule),
:mod:`.wire` (the message protocol), :mod:`.sides` (the synthetic engine's simulation as one side),
:mod:`.prefill` and :mod:`.decode` (the two roles), :mod:`.processes` (start, supervise, collect) and
:mod:`.report` (merge and render).
"""

from __future__ import annotations

from typing import Any

from .config import DisaggConfig
from .faults import TRANSFER_KINDS
from .processes import DisaggRunError


def run_disaggregated(cfg: DisaggConfig) -> dict[str, Any]:
    """Run the processes and return the merged report (raises DisaggRunError when a process fails)."""
    from .processes import run_processes
    from .report import merge

    cfg.validate()
    results, wall = run_processes(cfg)
    return merge(cfg, results, wall)


__all__ = ["TRANSFER_KINDS", "DisaggConfig", "DisaggRunError", "run_disaggregated"]
