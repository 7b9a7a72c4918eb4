"""The runtime's sweep (:class:`Sweeping`): every slot the engine's prefix cache holds (:class:`SweepSource`)
verified on the SWEEP endpoints of the groups that hold it (every group, or per model), in chunks of the sweep
capacity; the same verify checks the slots :meth:`~kvcanary_cupy.runtime.CanaryRuntime.restore` put back."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .._errors import fail
from .._validate import host_int_vector
from .base import RuntimeBase
from .batch import Buffer
from .groups import GroupState, gather_lut

SweepEntries = tuple[np.ndarray, np.ndarray, np.ndarray]


class SweepSource(Protocol):
    """What the sweep asks the engine: every slot its prefix cache holds, as ``(slots, positions, prev_slots)``
    int64 host arrays in the full pool's slot space (``prev`` -1 at a chain head; SGLang walks its radix tree),
    verified on every group; or, where each model has slots of its own (vLLM's KV cache groups, each with its own
    block table), a dict ``model name -> (slots, positions, prev_slots)``, each verified on that model's groups
    only (a model left out is not swept this time)."""

    def __call__(self) -> tuple[Any, Any, Any] | Mapping[str, tuple[Any, Any, Any]]: ...


def sweep_entries(answer: Any, models: Sequence[str]) -> dict[str | None, SweepEntries]:
    """A sweep source's answer as three int64 host vectors of one length per model it names (key ``None``: the
    plain triple, for every group), in the order of ``models``. Refused rather than converted, the whole answer
    before any of it is used: a float or 2-D array would otherwise be truncated or flattened into slots the
    engine never named, and a model name the runtime does not have would sweep nothing without a word."""
    if isinstance(answer, Mapping):
        unknown = [key for key in answer if not isinstance(key, str) or key not in models]
        if unknown:
            fail(f"sweep_source returned entries for {unknown[0]!r}, not a model of this runtime "
                 f"(models: {', '.join(models)})")
        return {model: _triple(answer[model], f" of model {model!r}") for model in models if model in answer}
    return {None: _triple(answer, "")}


def _triple(answer: Any, of: str) -> SweepEntries:
    """One ``(slots, positions, prev_slots)`` answer, validated (``of`` names the model in messages)."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 3:
        alternative = "" if of else " (or a dict: model name -> (slots, positions, prev_slots))"
        fail(f"sweep_source must return (slots, positions, prev_slots){of}, got {type(answer).__name__}{alternative}")
    slots, positions, prevs = (host_int_vector(value, f"sweep_source's {name}{of}")
                               for name, value in zip(("slots", "positions", "prev_slots"), answer, strict=True))
    if not slots.shape[0] == positions.shape[0] == prevs.shape[0]:
        fail(f"sweep_source returned {slots.shape[0]} slots{of} but {positions.shape[0]} positions and "
             f"{prevs.shape[0]} prev slots")
    return slots, positions, prevs


class Sweeping(RuntimeBase):
    """The sweep part of the runtime: its staging buffers (:meth:`_allocate_sweep`), :meth:`sweep` and the
    chunked verify of ``(slot, position, prev slot)`` entries on the SWEEP endpoints."""

    sweep_source: SweepSource | Callable[[], Any] | None
    _sweep_capacity: int
    _sweep_host: dict[str, np.ndarray]
    _sweep_in: dict[str, Buffer]

    def _allocate_sweep(self, capacity: int) -> None:
        """The host staging and device copies of ``capacity`` entries (``Capacities.max_sweep_slots``)."""
        space = self.space
        self._sweep_capacity = capacity
        self._sweep_host = {k: space.host(capacity, np.int64) for k in ("slots", "positions", "prevs")}
        self._sweep_in = {k: Buffer(*space.alloc(capacity, np.int64, name="Capacities.max_sweep_slots"))
                          for k in ("slots", "positions", "prevs")}

    def sweep(self) -> int:
        """Verify every slot the engine's prefix cache holds (``sweep_source``) on the SWEEP endpoints of every
        group, or of each model's groups for a per-model answer, in chunks of the sweep capacity; returns the
        number of slots. Outside any graph."""
        if not self.enabled or self.sweep_source is None:
            return 0
        self._outside_capture("sweep")
        return self._run_sweep(sweep_entries(self.sweep_source(), self.models))

    def _run_sweep(self, entries: dict[str | None, SweepEntries]) -> int:
        """Verify a validated sweep answer (:func:`sweep_entries`): key ``None`` on every group, a model's entries
        on that model's groups; every SWEEP launch is checked before the first one is filled."""
        parts = [(list(self.groups.values()) if model is None else self._groups_of(model), triple)
                 for model, triple in entries.items()]
        self._check_launches([state for groups, _ in parts for state in groups], "SWEEP")
        n = sum(int(triple[0].shape[0]) for _, triple in parts)
        if n == 0:
            return 0
        with self._timed("sweep"):
            for groups, (slots, positions, prevs) in parts:
                if slots.shape[0]:
                    self._verify_entries(groups, slots, positions, prevs, phase="sweep")
        self._totals.sweeps += 1
        self._totals.swept_slots += n
        return n

    def _verify_entries(self, groups: list[GroupState], slots: np.ndarray, positions: np.ndarray,
                        prevs: np.ndarray, *, phase: str) -> None:
        """Verify ``(slot, position, prev slot)`` entries (full pool's slot space) on the SWEEP endpoints of
        ``groups``, in chunks of the sweep capacity (the sweep, and the verify of restored slots). The caller
        ran ``_check_launches(groups, "SWEEP")`` first."""
        n = int(slots.shape[0])
        space, xp, cap = self.space, self.space.xp, self._sweep_capacity
        with space.scope():
            for start in range(0, n, cap):
                m = min(cap, n - start)
                for key, arr in (("slots", slots), ("positions", positions), ("prevs", prevs)):
                    host = self._sweep_host[key]
                    host[:m] = arr[start : start + m]
                    space.upload(self._sweep_in[key].view[:m], host[:m])
                for state in groups:
                    views = state.sweep_views
                    src_slots, src_prevs = self._sweep_in["slots"].view[:m], self._sweep_in["prevs"].view[:m]
                    if state.lut_view is not None:
                        gather_lut(state, xp, src_slots, views["verify_slot_indices"][:m])
                        gather_lut(state, xp, src_prevs, views["verify_prev_slot_indices"][:m])
                    else:
                        views["verify_slot_indices"][:m] = src_slots
                        views["verify_prev_slot_indices"][:m] = src_prevs
                    views["verify_expected_positions"][:m] = self._sweep_in["positions"].view[:m]
                    views["verify_num_valid"].fill(m)
                    views["enable"].fill(1)
                    for ep in state.endpoints["SWEEP"]:
                        assert ep.verify is not None
                        self._launch(ep.verify, "verify", state.model, state, ep, timer_phase=phase, checked=True)
                    self._sweep_launches[state.name] += 1
