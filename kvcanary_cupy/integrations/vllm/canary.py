"""The canary's side of vLLM's V1 model runner: the runner's KV cache described to
:class:`kvcanary_cupy.runtime.CanaryRuntime`, and one engine step driven through the runtime's four phases.

Slot numbering is vLLM's own: ``slot = block_id * block_size + offset`` per KV cache group, so the attention
metadata's ``slot_mapping`` is the write's ``out_cache_loc`` with no translation, and the metadata's
``block_table`` (the one attention reads) gives the plan's slots: ``block_table[row, p // block_size] *
block_size + p % block_size``, written per position into a :class:`~kvcanary_cupy.layouts.TokenTable` (a
same-step prefix hit needs a per-position exception, below). Expected
tokens come from the runner's request state (``prompt_token_ids + output_token_ids``), never from the batch.

Each vLLM KV cache group the canary checks (:mod:`.support` decides which, at install) is a runtime *model* of
its own; a runtime group takes at most 4 real-KV sources per K/V, so a KV cache group of more layers becomes one
runtime group per 4 layers (same slots and plan inputs).

Real-KV sources read the cache in place. On this CPU build the cache of a layer is ``[num_blocks, heads,
block_size, 2 * head_size]`` and, per (block, head), K is stored column-major ``[head_size, block_size]`` and V
row-major ``[block_size, head_size]`` (``layer.isa`` ``"vec"`` or ``"vec16"``), or in AMX tiles (``"amx"``); the
sources are :func:`kvcanary_cupy.kv_layouts.vllm_cpu_source` views (no copy).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ... import settings
from ..._errors import fail
from ..._validate import bool_arg
from ...constants import MAX_REAL_KV_SOURCES
from ...context import RealKvSource
from ...layouts import TokenTable
from ...runtime import CanaryConfig, CanaryRuntime, Capacities, KvGroup, KvPools
from ..common.options import EngineCanaryOptions
from ..common.state import EngineCanaryState, StepViolation
from ..common.tail import TailThread
from .blocks import BlockIndex
from .distributed import idle_cores
from .layers import layer_sources
from .step import RequestHistories, VllmStep, build_step
from .support import Support, assess

__all__ = ["ENV_PREFIX", "CanaryOptions", "GroupGeometry", "StepViolation", "VllmCanaryState", "VllmStep",
           "build_step", "sweep_blocks"]

ENV_PREFIX = "KVCANARY_VLLM"

#: The interpreter's switch interval while the TAIL thread runs (:class:`~..common.tail.TailThread`): vLLM's
#: thread waits at most this long for the GIL the TAIL thread's Python holds, against CPython's 5 ms, which made
#: its forward wait for the TAIL work's Python stretches and lose the GIL again to them after a launch.
TAIL_SWITCH_INTERVAL_S = 0.0002


@dataclass
class CanaryOptions(EngineCanaryOptions):
    """What the canary does in vLLM (turned into a runtime :class:`CanaryConfig`).

    ``mode``: ``log`` (per step one warning per group with violations, ``log_rows`` of its rows spelled out),
    ``raise`` (the runtime's ``CanaryViolationError`` one step later, which fails the step) or ``off`` (hooks in
    place, nothing allocated or launched).
    ``real_kv_hash``: ``partial`` (first 16 bytes of each source's row per token), ``all`` or ``none``;
    ``with_v`` adds V endpoints next to K; ``backend`` as for the launchers (``auto``, ``numpy``, ``host``).
    ``sweep_interval``: every N steps verify every slot of the complete blocks the runner has seen and that vLLM
    has not handed out fresh since (what its prefix cache can still hit); 0: never.
    ``allow_untested``: hook a vLLM release outside the tested range anyway (logged; still refused when an
    internal the integration needs is missing; ``KVCANARY_VLLM_ALLOW_UNTESTED=1`` does the same).
    """

    logger: str = "kvcanary_cupy.vllm"
    allow_untested: bool = False

    def validate(self) -> None:
        super().validate()
        bool_arg(self.allow_untested, "CanaryOptions.allow_untested")

    def config(self) -> CanaryConfig:
        self.validate()
        return self.runtime_config()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> CanaryOptions | None:
        """Options from ``KVCANARY_VLLM`` (the mode: ``log``, ``raise`` or ``off``) and ``KVCANARY_VLLM_<FIELD>``
        (``REAL_KV_HASH``, ``WITH_V``, ``BACKEND``, ``RING_CAPACITY``, ``SWEEP_INTERVAL``, ``LOG_ROWS``); None
        when ``KVCANARY_VLLM`` is unset or empty (the plugin then does nothing). Each value is parsed and checked
        by :mod:`kvcanary_cupy.settings` and refused, naming the variable, outside its range; so is a
        ``KVCANARY_VLLM_*`` name the plugin does not know (a misspelt option would otherwise be ignored)."""
        env = os.environ if environ is None else environ
        mode = settings.read(ENV_PREFIX, env)
        if mode is None:
            return None
        unknown = settings.unknown_vllm_variables(env)
        if unknown:
            known = [n for n in settings.SETTINGS if n.startswith(ENV_PREFIX)]
            fail(f"{', '.join(unknown)}: not a variable of the vLLM plugin (known: {', '.join(known)})")
        values: dict[str, Any] = {"mode": mode}
        for f in fields(cls):
            name = f"{ENV_PREFIX}_{f.name.upper()}"
            if name in settings.SETTINGS and f.name != "mode":
                value = settings.read(name, env)
                if value is not None:
                    values[f.name] = value
        opts = cls(**values)
        opts.config()
        return opts


@dataclass
class GroupGeometry:
    """One vLLM KV cache group as the canary sees it."""

    index: int
    name: str
    block_size: int
    num_blocks: int
    layer_names: list[str]
    caches: list[Any]  # one torch tensor per layer
    window: int = 0  # a SlidingWindowSpec group's ``sliding_window`` (0: full attention)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def window_starts(self, query_starts: np.ndarray) -> np.ndarray:
        """Per row, the first position the group's attention reads for a row whose first query is at
        ``query_starts``: ``q - window + 1`` (vLLM's window; the scheduler frees the blocks wholly below it and
        hands them out again, and the null block stands in for those skipped on a prefix hit), 0 for full
        attention."""
        q = np.asarray(query_starts, np.int64)
        return np.maximum(q - self.window + 1, 0) if self.window else np.zeros_like(q)

    def slots_of(self, blocks: list[int] | np.ndarray, length: int, start: int = 0) -> np.ndarray:
        """The slots of positions ``start .. length - 1`` of a sequence whose block table row is ``blocks`` (a 2-D
        ``blocks``: of every row, one row of slots each)."""
        pos = np.arange(start, length, dtype=np.int64)
        return np.asarray(blocks, np.int64)[..., pos // self.block_size] * self.block_size + pos % self.block_size


def _layer_sources(geo: GroupGeometry, layer: Any, cache: Any, which: str, read_bytes: int | None,
                   spec: Any) -> list[RealKvSource]:
    """The real-KV sources of one layer (``which`` "k" or "v"), read in place in the layout vLLM gives the layer
    (:func:`.layers.layer_sources`; one that is not understood is refused, never read wrongly)."""
    return layer_sources(layer, cache, spec, which, read_bytes)


class VllmCanaryState(EngineCanaryState):
    """The runtime over one model runner's KV caches, and the engine step driven through its phases."""

    def __init__(self, runner: Any, opts: CanaryOptions, support: Support | None = None) -> None:
        import torch

        super().__init__()
        self.opts = opts
        self.runner = runner
        # what is checked was decided at install (support.assess): only its checked groups are built here
        self.support = assess(runner) if support is None else support
        if self.support.disabled:
            fail(f"the canary cannot check this engine: {self.support.disabled}")
        if not self.support.sweep:
            opts = dataclasses.replace(opts, sweep_interval=0)
        self.device = torch.device("cpu") if not runner.kv_caches else runner.kv_caches[0].device
        if self.device.type != "cpu":
            fail("the vLLM integration runs on vLLM's CPU build only for now (a CUDA runner's metadata and "
                 "caches need device copies this integration does not make yet)")
        forward_context = runner.compilation_config.static_forward_context
        self.geos: list[GroupGeometry] = []
        groups: list[KvGroup] = []
        read = 16 if opts.real_kv_hash == "partial" else None
        all_groups = runner.kv_cache_config.kv_cache_groups
        for decision in self.support.checked_groups:
            gi, group = decision.index, all_groups[decision.index]
            spec = group.kv_cache_spec
            caches = [forward_context[name].kv_cache for name in group.layer_names]
            geo = GroupGeometry(index=gi, name=f"G{gi}", block_size=int(spec.block_size),
                                num_blocks=int(caches[0].shape[0]), layer_names=list(group.layer_names),
                                caches=caches, window=int(getattr(spec, "sliding_window", None) or 0))
            self.geos.append(geo)
            k: list[RealKvSource] = []
            v: list[RealKvSource] = []
            if opts.real_kv_hash != "none" and decision.real_kv:
                for name, cache in zip(group.layer_names, caches, strict=True):
                    if name in self.support.draft_layers:  # written by the drafter outside the forward
                        continue
                    k += _layer_sources(geo, forward_context[name], cache, "k", read, spec)
                    if opts.with_v:
                        v += _layer_sources(geo, forward_context[name], cache, "v", read, spec)
            chunks = max(1, -(-max(len(k), len(v)) // MAX_REAL_KV_SOURCES))
            # A sliding-window group verifies the last ``window - 1`` positions before a row's first query (the
            # runtime's SWA plan, through an identity LUT: vLLM's slots are the group's own), the first of them
            # unchained (the table holds slot 0 below the window, see _fill_table).
            swa = max(1, geo.window - 1) if geo.window else 0
            lut = np.arange(geo.num_slots, dtype=np.int64) if swa else None
            # The chunks of one KV cache group have the same slots and plan inputs: the first plans and keeps the
            # HEAD records, the others share them (KvGroup.plan_of) and add only their layers' TAIL fingerprints.
            for c in range(chunks):
                lo, hi = c * MAX_REAL_KV_SOURCES, (c + 1) * MAX_REAL_KV_SOURCES
                name = geo.name if chunks == 1 else f"{geo.name}:{c}"
                groups.append(KvGroup(name=name, num_slots=geo.num_slots, k_sources=tuple(k[lo:hi]),
                                      v_sources=tuple(v[lo:hi]) if opts.with_v else None, swa_window=swa,
                                      full_to_swa_index_mapping=lut, model=geo.name, layout=None,
                                      plan_of=None if c == 0 else f"{geo.name}:0"))
        self.max_requests = int(runner.max_num_reqs)
        self.max_len = int(runner.max_model_len) + 1
        rows = self.max_requests + 1
        self.tables = {geo.index: np.zeros((rows, self.max_len), np.int32) for geo in self.geos}
        # each group's in-block offsets 0 .. block_size - 1 (_fill_table)
        self._offsets = {geo.index: np.arange(geo.block_size, dtype=np.int32) for geo in self.geos}
        layouts = {geo.name: TokenTable(self.tables[geo.index]) for geo in self.geos}
        groups = [dataclasses.replace(g, layout=layouts[g.model]) for g in groups]
        self.group_names = [g.name for g in groups]

        # A row that hits blocks a sibling writes in the same step re-stamps them (see build_step): at most every
        # token of the step once more per such row; 4x the step's tokens covers n <= 4 siblings, rows past that
        # wait for a later step (build_step's ``deferred``).
        self.max_tokens = 4 * int(runner.max_num_tokens)
        caps = Capacities(max_batch_size=self.max_requests, max_tokens=self.max_tokens,
                          max_context_len=self.max_len, pool_rows=rows,
                          max_history_tokens=self.max_requests * self.max_len)
        # Where each complete block sits in the sequence that wrote it (the sweep needs positions, which the
        # runner does not keep); a block vLLM hands out fresh is dropped. One sweep verifies at most as many
        # slots as one step may write (its cost per step is bounded by a step's own write).
        self.block_index = BlockIndex([geo.num_blocks for geo in self.geos], [geo.block_size for geo in self.geos],
                                      blocks_per_sweep=sweep_blocks(int(runner.max_num_tokens),
                                                                    self.geos[0].block_size),
                                      group_ids=[geo.index for geo in self.geos])
        # each running request's token history, kept between steps (a step copies what its state gained)
        self.histories = RequestHistories()
        # Per request, the first position a step left unstamped (more same-step re-stamps than the step's
        # capacity, see build_step): a later step of that request re-stamps from there before it verifies.
        self.unstamped: dict[str, int] = {}
        # this step's draft tokens per request (the scheduler's ``scheduled_spec_decode_tokens``; speculative
        # decoding), set by the step hook before the forward
        self.drafts: dict[str, list[int]] = {}
        self.rt = CanaryRuntime.create(opts.config(), KvPools(tuple(groups), layout=None), caps, device="cpu",
                                       framework="numpy", timer=self._timer, sweep_source=self._cached_slots)
        # The runner's own dummy/profile forwards never reach the canary (only execute_model's do), so the
        # write's chain-position assert goes on at once.
        self.rt.mark_init_finished()
        # In log mode a step's TAIL launches and ring read run while vLLM samples and schedules the next step
        # (:class:`TailThread`; the hooks wait for them before the next step starts). Raise mode runs them
        # inline: a violation then fails the step whose ring read found it, not the engine's next request.
        # Where the worker leaves cores to vLLM's engine core (idle while the worker computes), the TAIL thread
        # runs there (:func:`.distributed.idle_cores`): the step's staging and HEAD during its forward, its
        # TAIL work from the forward's end, beside sampling.
        self.tail = (TailThread(cores=idle_cores(runner), switch_interval=TAIL_SWITCH_INTERVAL_S)
                     if opts.mode == "log" else None)
        self.head_deferred = False  # this step's phases 1 and 2 go with its TAIL work (before_forward)

    @property
    def beside_forward(self) -> bool:
        """The TAIL thread has cores of its own: the step's phases 1 and 2 run there during the forward, its
        TAIL work from the forward's end. Where the platform refused them (seen once the thread has started),
        it runs on the worker's and the work goes after sampling again."""
        tail = self.tail
        return tail is not None and tail.cores is not None and (tail.pinned is not None or not tail.started)

    # -- the step --------------------------------------------------------------------------------------------

    def forget_blocks(self, block_ids: list[int] | None) -> None:
        """vLLM handed these blocks out fresh (and zeroed them): they hold nothing the sweep may check."""
        if block_ids:
            self.block_index.forget(block_ids)

    def read_step(self, kwargs: dict[str, Any], metadata: dict[str, Any]) -> VllmStep:
        """This step's plan inputs (:func:`.step.build_step`, with the token histories kept from the last step),
        once the last step's TAIL work is done."""
        self.settle()
        return build_step(self.steps, self.runner, kwargs, metadata, self.geos, self.max_tokens, self.unstamped,
                          self.histories, self.drafts)

    def before_forward(self, batch: VllmStep, *, inline: bool = False) -> None:
        """Phases 1 and 2 of every group: stage the batch (the slot tables, the runtime's staged copies), then
        plan, HEAD verify and HEAD write. With the TAIL thread (unless ``inline``) both run there, beside the
        forward (:attr:`beside_forward`) or with the TAIL work after it (:meth:`_stage_and_plan`): ``batch`` is
        this step's own copy of what it read, the staging writes only the canary's buffers, the plan reads only
        those, and the HEAD launches only the HEAD buffers, none of which the forward touches, so they find
        what they would find before it; the engine thread then only reads the step."""
        b = batch.size
        if b > self.max_requests:
            fail(f"vLLM scheduled {b} requests in one step, more than the {self.max_requests} the canary was "
                 "sized for (max_num_seqs)")
        beside = self.tail is not None and not inline
        self.head_deferred = beside and not self.beside_forward
        if beside and self.beside_forward:
            assert self.tail is not None
            self.tail.submit(self._stage_and_plan_beside, batch)
        elif not beside:
            self._stage_and_plan(batch)

    def _stage_and_plan(self, batch: VllmStep) -> None:
        """Phases 1 and 2, group by group."""
        steps = self._step_batches(batch, [batch.slot_mappings[geo.index] for geo in self.geos], batch.history_ids)
        for geo, step in zip(self.geos, steps, strict=True):
            self._fill_table(geo, batch)
            self.rt.prepare(step, model=geo.name)
            self.rt.pre_forward(model=geo.name)

    def _stage_and_plan_beside(self, batch: VllmStep) -> None:
        """Phases 1 and 2 on the TAIL thread, its host launches on that thread alone (as :meth:`_tail_work_beside`)."""
        from ...hostcuda import threads_on_this_thread

        with threads_on_this_thread(1):
            self._stage_and_plan(batch)

    def _fill_table(self, geo: GroupGeometry, batch: VllmStep) -> None:
        """Rows ``1..B`` of the group's per-position slot table from this step's block table."""
        b = batch.size
        if b == 0:
            return
        width = int((batch.prefix_lens[:b] + batch.extend_lens[:b]).max())
        bs, table = geo.block_size, self.tables[geo.index]
        blocks = -(-width // bs)
        # Every row at once, whole blocks: ``block * block_size + offset`` written in place, one pass over the
        # rows' blocks (the plan reads a row only below its own length, so what lands past it is never read).
        rows = table[1 : b + 1, : blocks * bs]
        if rows.shape[1] == blocks * bs:
            rows = rows.reshape(b, blocks, bs)  # a view: only the last axis, contiguous, is split
            np.multiply(batch.block_tables[geo.index][:b, :blocks, None], bs, out=rows, casting="unsafe")
            rows += self._offsets[geo.index]
        else:  # the row's last block reaches past the table (a sequence at max_model_len)
            np.copyto(table[1 : b + 1, :width], geo.slots_of(batch.block_tables[geo.index][:b], width),
                      casting="unsafe")
        if geo.window:
            # below the window the block table's ids may be stale (freed, handed out again) or the null block:
            # slot 0, which the verify skips and which, as a predecessor, skips the chain check
            starts = geo.window_starts(batch.query_starts[:b])
            table[1 : b + 1, :width][np.arange(width)[None, :] < starts[:, None]] = 0

    def after_forward(self, batch: VllmStep, written: dict[int, np.ndarray], *, inline: bool = False,
                      hold: bool = False) -> None:
        """Phases 3 and 4: TAIL verify and TAIL write (stamped where attention really wrote: ``written``, each
        group's slot mapping as it was when the forward returned), the step's blocks indexed, then the
        one-step-late read of the rings and, when due, the sweep. All of it runs on the TAIL thread unless
        ``inline`` (or raise mode); ``hold``: it starts there at :meth:`release_tail` (the runner has sampled),
        not now, unless the thread has cores of its own (:attr:`beside_forward`: it then takes no time from
        sampling); :meth:`settle` waits for it (and starts it if still held). Nothing here reads the runner:
        ``batch`` and ``written`` are this step's own copies."""
        head, self.head_deferred = self.head_deferred, False
        if self.tail is None or inline:
            self._tail_work(batch, written, head)
        elif hold and not self.beside_forward:
            self.tail.hold(self._tail_work_beside, batch, written, head)
        else:
            self.tail.submit(self._tail_work_beside, batch, written, head)

    def release_tail(self) -> None:
        """Start the TAIL work :meth:`after_forward` held (if any)."""
        if self.tail is not None:
            self.tail.release()

    def _tail_work_beside(self, batch: VllmStep, written: dict[int, np.ndarray], head: bool) -> None:
        """The TAIL work on the TAIL thread: its host launches on that thread alone (it is the parallelism; a
        pool worker would take the core vLLM's own thread needs meanwhile)."""
        from ...hostcuda import threads_on_this_thread

        with threads_on_this_thread(1):
            self._tail_work(batch, written, head)

    def _tail_work(self, batch: VllmStep, written: dict[int, np.ndarray], head: bool = False) -> None:
        if head:  # phases 1 and 2, deferred by before_forward
            self._stage_and_plan(batch)
        for geo in self.geos:
            planned = batch.slot_mappings[geo.index]
            self._post_forward(geo.name, batch.canary_tokens(written[geo.index], planned), planned)
        self._note_complete_blocks(batch)
        for rid in batch.request_ids:
            if rid in batch.deferred:
                self.unstamped[rid] = batch.deferred[rid]
            else:
                self.unstamped.pop(rid, None)
        if len(self.unstamped) > self.max_requests:  # finished requests leave the runner's state
            # (membership tests only: vLLM changes its request map at the start of a step, after settle())
            self.unstamped = {r: u for r, u in self.unstamped.items() if r in self.runner.requests}
        self._finish_step()

    def settle(self) -> None:
        """Wait for the last step's TAIL work (raising what it raised): before the next step, and before any
        read of the canary's state from outside the step."""
        if self.tail is not None:
            self.tail.wait()

    def join_tail(self) -> None:
        """Wait for the last step's TAIL work without taking its error (which the next step raises)."""
        if self.tail is not None:
            self.tail.join()

    def flush(self) -> None:
        self.settle()
        super().flush()

    def close(self) -> None:
        """Stop the TAIL thread (after the work in flight)."""
        if self.tail is not None:
            self.tail.close()

    def _note_complete_blocks(self, batch: VllmStep) -> None:
        """Index every block a request of this step writes: complete ones at their place in the sequence, a
        block still being filled dropped (vLLM may have handed it out again since it was last complete; it does
        not zero reused blocks here, so the runner's own tables are the only record of reuse)."""
        totals = batch.prefix_lens + batch.extend_lens
        provisional = None
        # the row of each canary token, for a step with drafts or deferred rows (most steps: neither)
        rows = (np.repeat(np.arange(batch.size, dtype=np.int64), batch.extend_lens)
                if batch.confirmed_lens is not None or batch.deferred else np.zeros(0, np.int64))
        if batch.confirmed_lens is not None:
            # draft tokens: stamped, but a block is complete only with accepted ones (the blocks past them are
            # dropped like a deferred row's, and no other row stamps a row's draft positions)
            totals = np.minimum(totals, batch.confirmed_lens)
            provisional = batch.expected_positions >= batch.confirmed_lens[rows]
        for geo in self.geos:
            # a row the step left partly unstamped (``deferred``): the forward wrote up to its history's end;
            # its blocks past the stamped ones are dropped, unless another row stamps them in this step
            stamped = stamped_rows = None
            if batch.deferred:
                slots, stamped_rows = batch.slot_mappings[geo.index], rows
                if provisional is not None:
                    slots, stamped_rows = slots[~provisional], stamped_rows[~provisional]
                stamped = slots // geo.block_size
            # a sliding-window row holds only its blocks from the one its window starts in
            first = geo.window_starts(batch.query_starts) // geo.block_size if geo.window else None
            self.block_index.note_step(geo.index, batch.block_tables[geo.index], totals, batch.valid_lens, stamped,
                                       first, stamped_rows)

    def _cached_slots(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The sweep source, per checked KV cache group (a runtime model: each group has its own block table and
        slot numbering): the slots of the next round-robin share of the group's complete blocks still indexed,
        with their positions; predecessors inside a block, none across blocks (prev 0 skips that one chain check,
        a first block anchors at -1)."""
        return {geo.name: self.block_index.sweep_entries(geo.index, geo.block_size, geo.block_size)
                for geo in self.geos}


def sweep_blocks(max_num_tokens: int, block_size: int) -> int:
    """Blocks one sweep verifies: as many slots as one step may write (``max_num_batched_tokens``), whole
    blocks, at least one. Its cost per step, amortised over the sweep interval, is at most that of one full
    step's write divided by the interval."""
    return max(1, max_num_tokens // block_size)
