"""Reporting and health (:class:`Monitoring`): the device words snapshotted at the end of a step, read one
step late with the ring rows they announce, drained and counted; the health check of the run counters; the
stats and the bounded verify's latency bound built from what was read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..constants import CanaryStatus
from ..violations import ViolationReport, decode_row
from .base import RuntimeBase
from .config import verify_latency_bound
from .groups import Endpoint, GroupState, counter_name
from .reporting import StepReport, publish


@dataclass
class _Snapshot:
    """The device words as they were at the end of one step, on their way to (pinned) host memory."""

    host: tuple[np.ndarray, np.ndarray]
    event: Any
    step: int
    forwards: dict[str, int]
    sweep_launches: dict[str, int]


@dataclass(frozen=True)
class _WordKeys:
    """The names of the device words a step's read takes of one group (built once, not every step)."""

    write_index: str
    status: str
    lost: str
    plan_enable: str
    plan_num_valid: str
    plan_status: str

    @classmethod
    def of(cls, state: GroupState) -> _WordKeys:
        plan = state.plan_name  # KvGroup.plan_of: the words of the plan this group's launches read
        return cls(f"{state.name}.write_index", f"{state.name}.status", f"{state.name}.lost", f"{plan}.plan.enable",
                   f"{plan}.plan.num_valid", f"{plan}.plan.status")


class Monitoring(RuntimeBase):
    """The reading side of the runtime: snapshot buffers, host copies of the rings and the run-counter table
    (:meth:`_allocate_monitoring`), what a step's snapshot held (:meth:`_consume`), the health checks, the run
    counters and the stats."""

    # (endpoint, op, slot-counter name, kernel-counter name) per group, in endpoint order
    _counters: dict[str, list[tuple[Endpoint, str, str, str]]]
    _group_index: dict[str, int]
    _word_keys: dict[str, _WordKeys]
    _ring_host: dict[str, np.ndarray]
    _snap_host: list[tuple[np.ndarray, np.ndarray]]
    _snap_events: list[Any]
    _side: Any
    _pending: _Snapshot | None
    _health_offsets: dict[str, int]
    _init_finished: bool

    def _allocate_monitoring(self) -> None:
        """The run-counter table, the host copies of the rings and the two snapshot slots."""
        space = self.space
        self._group_index = {name: i for i, name in enumerate(self.groups)}
        self._counters = {name: [(ep, op, counter_name(state, ep, op, "slots"), counter_name(state, ep, op, "kernels"))
                                 for ep in state.all_endpoints()
                                 for op in (("verify", "write") if ep.write_ctx is not None else ("verify",))]
                          for name, state in self.groups.items()}
        self._word_keys = {name: _WordKeys.of(state) for name, state in self.groups.items()}
        self._ring_host = {name: space.host((self.config.ring_capacity, 8), np.int64) for name in self.groups}
        # Two snapshot slots, each a host buffer and its event, alternated between the snapshot being read (one
        # step late) and the one being taken, so no step allocates either.
        self._snap_host = [self.scalars.host_buffers(space) for _ in range(2)]
        self._snap_events = [space.event() for _ in range(2)]
        self._side = space.side_stream()

    # -- snapshot and read ---------------------------------------------------------------------------------

    def _take_snapshot(self, step: int, *, clear: bool = True) -> None:
        space = self.space
        slot = step % 2
        if self._pending is not None and self._pending.host is self._snap_host[slot]:
            slot = 1 - slot  # never the pending snapshot's buffer and event, which are still to be read
        host = self._snap_host[slot]
        with space.scope():
            self.scalars.copy_to(space, host)
            event = space.record(self._snap_events[slot])
            if clear:  # status words accumulate: clear them behind the copy (stream order), each bit is seen once
                for state in self.groups.values():
                    self.scalars.view(f"{state.name}.status").fill(0)
                self.scalars.view("scatter.status").fill(0)
        self._pending = _Snapshot(host, event, step, dict(self.forwards), dict(self._sweep_launches))

    def _consume(self, step: int, report: StepReport) -> None:
        """Read the pending snapshot (taken one step ago), the ring rows it announces, and drain them, into
        ``report`` (filled group by group, and counted in the totals as it is filled, so that a failure part way
        leaves in ``report`` and ``stats()`` exactly what was drained)."""
        snap, self._pending = self._pending, None
        report.step, report.launch_step = step, -1 if snap is None else snap.step
        if snap is None:
            return
        space, totals = self.space, self._totals
        space.wait(snap.event)
        words = self.scalars.read(snap.host)
        for name, state in self.groups.items():
            keys = self._word_keys[name]
            n, status, lost = words[keys.write_index], words[keys.status], words[keys.lost]
            cap = int(state.ring_view.shape[0])
            dropped = max(0, n - cap) + lost - totals.counters.get(keys.lost, 0)
            totals.counters[keys.lost] = lost
            rows = []
            if n > 0:
                m = min(n, cap)
                out = self._ring_host[name]
                space.read_after(snap.event, state.ring_view[:m], out[:m], self._side)
                rows = [decode_row(i, out[i]) for i in range(m)]
            if rows or status or dropped:
                first = (state.endpoints["HEAD"] or state.endpoints["TAIL"])[0]
                report.reports[name] = ViolationReport(
                    total=n, capacity=cap, rows=rows, status=CanaryStatus(status),
                    slot_run_counter=words[counter_name(state, first, "verify", "slots")],
                    kernel_run_counter=words[counter_name(state, first, "verify", "kernels")])
                report.new_violations += [(name, v) for v in rows]
                totals.by_group[name] = totals.by_group.get(name, 0) + len(rows)
                totals.violations += len(rows)
            if n > 0:  # drained once the rows are in the report
                self._drain(state, n)
            report.dropped += dropped
            totals.dropped += dropped
            totals.status_bits |= status
            # KvGroup.plan_of: the words of the plan this group's launches read
            enabled = words[keys.plan_enable]
            if state.window_plan is not None and enabled:
                live = words[keys.plan_num_valid]
                totals.live_max[name] = max(totals.live_max.get(name, 0), live)
            plan_status = words[keys.plan_status]
            if plan_status and state.leader is None:  # reported once, by the group whose plan it is
                report.plan_status[name] = plan_status
            if snap.forwards.get(state.model, 0) and enabled == 0:
                report.overflowed.append(name)
                totals.overflows[name] = totals.overflows.get(name, 0) + 1
        report.new_violations.sort(key=self._launch_order)
        report.scatter_status = words["scatter.status"]
        totals.status_bits |= report.scatter_status
        for counters in self._counters.values():
            for _, _, slots_key, kernels_key in counters:
                totals.counters[slots_key] = words[slots_key]
                totals.counters[kernels_key] = words[kernels_key]
        if self.config.health_check:
            report.health_problems = self._health(snap, words)
            totals.health_failures += len(report.health_problems)

    def _launch_order(self, item: tuple[str, Any]) -> tuple[int, ...]:
        """Rows of one step in the order their launches ran: per model (in order of first appearance), HEAD of
        every group then TAIL of every group; the sweep last; ring order within a launch."""
        group, v = item
        role = v.launch_tag.split("_", 1)[0]
        state = self.groups[group]
        model = self.models.index(state.model)
        return (role == "SWEEP", model, role == "TAIL", self._group_index[group], v.index)

    def _drain(self, state: GroupState, n: int) -> None:
        """Drop the ``n`` rows just read (stream-ordered after every launch enqueued since): rows appended
        later move to the front, the write index and the count of rows a full ring lost follow."""
        xp, sc, name = self.space.xp, self.scalars, state.name
        ring, scratch = state.ring_view, state.ring_scratch
        cap = int(ring.shape[0])
        shift = min(n, cap)
        keys = self._word_keys[name]
        wi, lost, temp = sc.view(keys.write_index), sc.view(keys.lost), sc.view(f"{name}.drain_temp")
        with self.space.scope():
            # a device write index cannot be read without a sync: move the whole tail; on the CPU move only the
            # rows appended since the snapshot
            end = cap if self.space.is_cuda else min(int(wi[0]), cap)
            if shift < end:
                scratch[: end - shift] = ring[shift:end]
                ring[: end - shift] = scratch[: end - shift]
            # rows still held after the shift: r = max(0, min(w, cap) - shift); the rest of (w - n) was lost
            xp.minimum(wi, cap, out=temp)
            temp -= shift
            xp.maximum(temp, 0, out=temp)
            lost += wi
            lost -= n
            lost -= temp
            xp.copyto(wi, temp, casting="unsafe")

    # -- health --------------------------------------------------------------------------------------------

    def _health(self, snap: _Snapshot, words: dict[str, int]) -> list[str]:
        problems: list[str] = []

        def check(key: str, got: int, want: int, what: str) -> None:
            # a deficit is reported once; later steps compare against the counter's new baseline
            offset = self._health_offsets.get(key, 0)
            if got != want - offset:
                problems.append(f"{what}: {got}, expected {want - offset}")
                self._health_offsets[key] = want - got

        for name, state in self.groups.items():
            forwards = snap.forwards.get(state.model, 0)
            ref: dict[str, int] = {}
            for ep, op, slots_key, kernels_key in self._counters[name]:
                want = snap.sweep_launches[name] if ep.role == "SWEEP" else forwards
                kernels = words[kernels_key]
                if kernels != want - self._health_offsets.get(kernels_key, 0):
                    whom = f"prepare() call of model {state.model!r}" if ep.role != "SWEEP" else "sweep launch"
                    check(kernels_key, kernels, want, f"group {name}: {ep.tag.name} {op} kernel ran (count) vs one "
                                                      f"per {whom}")
                if ep.role == "SWEEP":
                    continue
                slots = words[slots_key]
                if op not in ref:
                    ref[op] = slots
                elif slots != ref[op] - self._health_offsets.get(slots_key, 0):
                    check(slots_key, slots, ref[op],
                          f"group {name}: {ep.tag.name} {op} slot count vs HEAD_K (same plan, same batch)")
        return problems

    def check_health(self) -> list[str]:
        """Synchronise, take a snapshot now and check the run counters; the problems found (also counted and
        reported like those of :meth:`finish_step`). Outside any graph only."""
        if not self.enabled:
            return []
        self._outside_capture("check_health")
        pending = self._pending
        self.space.synchronize()
        self._take_snapshot(self.step, clear=False)
        snap = self._pending
        self._pending = pending
        assert snap is not None
        problems = self._health(snap, self.scalars.read(snap.host))
        self._totals.health_failures += len(problems)
        return problems

    def run_counters(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """Synchronise and read every run counter now: ``{(group, tag, "verify"|"write"): (slots, kernels)}``.
        Outside any graph only (tests, reports at shutdown)."""
        if not self.enabled:
            return {}
        self._outside_capture("run_counters")
        host = self.scalars.host_buffers(self.space)
        self.space.synchronize()
        with self.space.scope():
            self.scalars.copy_to(self.space, host)
        self.space.synchronize()
        return {(name, ep.tag.name, op): (self.scalars.value(host, slots_key), self.scalars.value(host, kernels_key))
                for name, keys in self._counters.items() for ep, op, slots_key, kernels_key in keys}

    # -- reporting -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _nothing_lost(self, report: StepReport) -> Iterator[None]:
        """Whatever fails once rows have been read from a ring (a timer or observer hook, a launch), what was
        read reaches the caller: every fact of ``report`` is logged (``log`` mode's records, whatever the mode;
        ``stats()`` already counts them) and the failure, which propagates, says so in a note."""
        try:
            yield
        except BaseException as exc:
            if not report.clean:
                publish(report, "log", self.log, overflow_counts=self._totals.overflows,
                        log_rows=self.config.log_rows)
                add_note = getattr(exc, "add_note", None)  # Python 3.11+
                if add_note is not None:
                    add_note(f"kv-canary: {len(report.new_violations)} violation(s) read from the rings before this "
                             f"failure were logged to {self.log.name!r} and are counted in stats()")
            raise

    # -- stats ---------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters for metrics exporters (device counters as of the last snapshot read, one step late)."""
        t = self._totals
        protected = verified = 0
        for name, keys in self._counters.items() if self.enabled else ():
            heads = self.groups[name].endpoints["HEAD"]
            head_k = heads[0] if heads else None  # a group sharing another's plan protects no token of its own
            for ep, op, slots_key, _ in keys:
                if op == "verify":
                    verified += t.counters.get(slots_key, 0)
                elif ep is head_k:
                    protected += t.counters.get(slots_key, 0)
        return {
            "mode": self.config.mode, "steps": self.step, "forwards": dict(self.forwards),
            "protected_tokens": protected, "verified_entries": verified, "sweeps": t.sweeps,
            "swept_slots": t.swept_slots, "violations": t.violations, "violations_by_group": dict(t.by_group),
            "dropped": t.dropped, "status_bits": t.status_bits, "overflows": dict(t.overflows),
            "health_failures": t.health_failures, "init_finished": self._init_finished,
            **self.verify_bound(),
        }

    def verify_bound(self) -> dict[str, Any]:
        """The bounded verify's detection-latency bound, from what the run has seen so far (one step late).

        ``verify_entries_per_step``: N (0: full verify, every live slot every step). ``verify_live_max``: the
        most live prefix entries any group's plan listed. ``verify_bound_steps``: every live slot of an
        unchanging set of prefixes is verified within this many steps (``ceil(live / N)``).
        ``verify_bound_steps_growing``: the bound while every step adds up to ``verify_growth_max`` entries (the
        most new tokens of one forward) to the lists; -1 when N does not exceed that growth (see
        :func:`~kvcanary_cupy.runtime.verify_latency_bound`)."""
        n = self.config.max_verify_entries_per_step
        live = max(self._totals.live_max.values(), default=0)
        growth = self._totals.step_tokens_max
        return {"verify_entries_per_step": n, "verify_live_max": live, "verify_growth_max": growth,
                "verify_bound_steps": verify_latency_bound(live, n),
                "verify_bound_steps_growing": verify_latency_bound(live, n, growth_per_step=growth)}

    def stats_line(self) -> str:
        s = self.stats()
        line = (f"kv-canary: protected {s['protected_tokens']} tokens, {s['sweeps']} sweep passes, "
                f"{s['violations']} violations")
        if s["verify_entries_per_step"]:
            grow = s["verify_bound_steps_growing"]
            line += (f"; bounded verify of {s['verify_entries_per_step']} entries/step/group: every live slot "
                     f"verified within {s['verify_bound_steps']} steps ({s['verify_live_max']} live entries), "
                     + (f"within {grow} while {s['verify_growth_max']} entries are added per step" if grow > 0 else
                        f"no bound while {s['verify_growth_max']} entries are added per step"))
        return line
