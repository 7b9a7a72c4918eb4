"""The engine's KV pools as the canary sees them: attention groups (:class:`KvGroup`) and the slot layout
they share (:class:`KvPools`).

A group is one canary buffer pair (HEAD and TAIL) per K/V over one slot space: a full-attention pool, a
sliding-window pool reached through its full-to-SWA LUT, or an EAGLE draft pool whose slot ``p`` holds the KV
of token ``p + 1``. Each group belongs to the forward (``model``) that writes its KV, and has its own
violation ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import fail
from .._validate import int_arg
from ..context import RealKvSource, real_kv_sources_arg
from ..layouts import BlockTable, PageList

_INT32_MAX = (1 << 31) - 1


def _sources(value: Any, name: str, *, optional: bool) -> tuple[RealKvSource, ...] | None:
    """A group's sources: one RealKvSource or a tuple of them (checked as the contexts check them)."""
    if value is None:
        if optional:
            return None
        fail(f"{name} must be a tuple of RealKvSource, got None")
    return real_kv_sources_arg((value,) if isinstance(value, RealKvSource) else value, name)


@dataclass(frozen=True)
class KvGroup:
    """One attention group (SGLang's ``CanaryBufferGroup``).

    Attributes:
        name: unique label ("FULL", "SWA", "DRAFT", ...), used in reports, logs and stats.
        num_slots: canary slots, the group's KV pool size (slot 0 is the padding slot).
        k_sources: the real K bytes fingerprinted by TAIL and SWEEP (at most 4, e.g. one per layer).
        v_sources: the real V bytes; None means no V endpoints (MLA-like models), ``()`` V endpoints without
            real-KV fingerprints.
        swa_window: > 0 for a sliding-window group: the plan verifies only the last ``swa_window`` positions
            and every slot goes through ``full_to_swa_index_mapping``.
        full_to_swa_index_mapping: int64 ``[full_slots + 1]`` LUT (0 = evicted), any DLPack producer, read
            in place every step.
        kv_token_id_vs_position_offset: +1 for an EAGLE draft pool, 0 otherwise.
        model: the forward that writes this group's KV ("target", "draft", ...); the step phases run per model.
        layout: this group's slot layout (a ``kvcanary_cupy.layouts`` object); None uses the pools'.
        plan_of: the name of an earlier group of the same model, slot space, layout, window, LUT and offset
            whose plan and HEAD records this group shares (an engine's layers split into groups of at most 4
            sources per K/V): it gets no plan launch and no HEAD endpoints, whose records would be that group's
            word for word, only TAIL and SWEEP endpoints over its own sources and its own ring. None: its own.
    """

    name: str
    num_slots: int
    k_sources: tuple[RealKvSource, ...] = ()
    v_sources: tuple[RealKvSource, ...] | None = None
    swa_window: int = 0
    full_to_swa_index_mapping: Any = None
    kv_token_id_vs_position_offset: int = 0
    model: str = "target"
    layout: Any = None
    plan_of: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            fail(f"KvGroup.name must be a non-empty str, got {self.name!r}")
        where = f"KvGroup {self.name!r}"
        int_arg(self.num_slots, f"{where}.num_slots", minimum=1)
        object.__setattr__(self, "k_sources", _sources(self.k_sources, f"{where}.k_sources", optional=False))
        object.__setattr__(self, "v_sources", _sources(self.v_sources, f"{where}.v_sources", optional=True))
        window = int_arg(self.swa_window, f"{where}.swa_window", minimum=0)
        if window > 0 and self.full_to_swa_index_mapping is None:
            fail(f"{where}.swa_window={window} needs full_to_swa_index_mapping (the full-to-SWA slot LUT)")
        if window == 0 and self.full_to_swa_index_mapping is not None:
            fail(f"{where}.full_to_swa_index_mapping is set but swa_window is 0 (use KvGroup.swa)")
        int_arg(self.kv_token_id_vs_position_offset, f"{where}.kv_token_id_vs_position_offset",
                minimum=-_INT32_MAX - 1, maximum=_INT32_MAX)
        if not isinstance(self.model, str) or not self.model:
            fail(f"{where}.model must be a non-empty str, got {self.model!r}")
        if self.plan_of is not None and (not isinstance(self.plan_of, str) or self.plan_of == self.name):
            fail(f"{where}.plan_of must name another group, got {self.plan_of!r}")

    @property
    def has_head(self) -> bool:
        """Whether the group has HEAD endpoints and a plan of its own (not shared through ``plan_of``)."""
        return self.plan_of is None

    @classmethod
    def full(cls, name: str, num_slots: int, k_sources: Any = (), v_sources: Any = None, *,
             model: str = "target", layout: Any = None) -> KvGroup:
        """A full-attention group."""
        return cls(name, num_slots, k_sources, v_sources, model=model, layout=layout)

    @classmethod
    def swa(cls, name: str, num_slots: int, *, window: int, lut: Any, k_sources: Any = (), v_sources: Any = None,
            model: str = "target", layout: Any = None) -> KvGroup:
        """A sliding-window group over its own slot pool, reached through ``lut`` (full slot -> SWA slot)."""
        return cls(name, num_slots, k_sources, v_sources, swa_window=window, full_to_swa_index_mapping=lut,
                   model=model, layout=layout)

    @classmethod
    def draft(cls, name: str, num_slots: int, k_sources: Any = (), v_sources: Any = None, *, offset: int = 1,
              model: str = "draft", layout: Any = None) -> KvGroup:
        """An EAGLE draft group: its own forward, slot ``p`` holding the KV of token ``p + offset``."""
        return cls(name, num_slots, k_sources, v_sources, kv_token_id_vs_position_offset=offset, model=model,
                   layout=layout)

    @property
    def is_swa(self) -> bool:
        return self.swa_window > 0

    @property
    def regime(self) -> str:
        """The launch-tag suffix: SWA or FULL."""
        return "SWA" if self.is_swa else "FULL"


@dataclass(frozen=True)
class KvPools:
    """Every attention group of the engine and the slot layout the plan reads.

    Exactly one of ``req_to_token`` (SGLang's int32 ``[rows, max_seq_len]`` table, the same as
    ``layout=TokenTable(req_to_token)``) and ``layout`` (a :mod:`kvcanary_cupy.layouts` object: ``TokenTable``,
    ``BlockTable``, ``PageList``) is given, unless every group has its own layout. The layout's arrays are bound
    once, at the runtime's padded batch size: the engine refills them in place and never reallocates them
    (``BlockTable(batch_rows=True)`` needs ``max_batch_size`` table rows, ``PageList`` a ``kv_page_indptr`` of
    ``max_batch_size + 1`` entries whose unused tail repeats the last value).
    """

    groups: tuple[KvGroup, ...]
    req_to_token: Any = None
    layout: Any = None

    def __post_init__(self) -> None:
        groups = self.groups
        if isinstance(groups, KvGroup):
            groups = (groups,)
        if not isinstance(groups, (tuple, list)) or not groups:
            fail("KvPools.groups must be a non-empty tuple of KvGroup")
        for i, g in enumerate(groups):
            if not isinstance(g, KvGroup):
                fail(f"KvPools.groups[{i}] must be a KvGroup, got {type(g).__name__}")
        names = [g.name for g in groups]
        for name in names:
            if names.count(name) > 1:
                fail(f"KvPools.groups: group name {name!r} is used twice")
        object.__setattr__(self, "groups", tuple(groups))
        for i, g in enumerate(groups):
            if g.plan_of is not None:
                _check_plan_sharing(g, {h.name: h for h in groups[:i]}, self.layout_of)
        if self.req_to_token is not None and self.layout is not None:
            fail("KvPools: give req_to_token or layout, not both")
        if self.req_to_token is None and self.layout is None:
            missing = [g.name for g in groups if g.layout is None]
            if missing:
                fail(f"KvPools: req_to_token or layout is required (groups without their own layout: "
                     f"{', '.join(missing)})")

    @property
    def models(self) -> tuple[str, ...]:
        """The forwards, in the order their first group appears."""
        return tuple(dict.fromkeys(g.model for g in self.groups))

    def engine_arrays(self) -> list[Any]:
        """Every engine-owned array the canary reads in place (slot tables, LUTs, real-KV tensors)."""
        out = [self.req_to_token, self.layout]
        for g in self.groups:
            out += [g.full_to_swa_index_mapping, g.layout, *(s.tensor for s in g.k_sources),
                    *(s.tensor for s in g.v_sources or ())]
        return [a for a in out if a is not None]

    def layout_of(self, group: KvGroup) -> tuple[str, Any]:
        """``("req_to_token", table)`` or ``("layout", layout)``: the plan keyword for ``group``."""
        if group.layout is not None:
            return "layout", group.layout
        if self.layout is not None:
            return "layout", self.layout
        return "req_to_token", self.req_to_token


def _check_plan_sharing(group: KvGroup, earlier: dict[str, KvGroup], layout_of: Any) -> None:
    """A group's ``plan_of`` names an earlier group with its own plan whose plan inputs are the group's own."""
    where = f"KvPools.groups: group {group.name!r}.plan_of={group.plan_of!r}"
    leader = earlier.get(group.plan_of or "")
    if leader is None:
        fail(f"{where} must name an earlier group")
    if not leader.has_head:
        fail(f"{where} names a group that shares another's plan itself (name {leader.plan_of!r})")
    same = (leader.model == group.model and leader.num_slots == group.num_slots
            and leader.swa_window == group.swa_window
            and leader.full_to_swa_index_mapping is group.full_to_swa_index_mapping
            and leader.kv_token_id_vs_position_offset == group.kv_token_id_vs_position_offset
            and layout_of(leader)[1] is layout_of(group)[1])
    if not same:
        fail(f"{where}: the two groups' plans would differ (model, num_slots, window, LUT, offset and layout "
             "must be the same)")


def row_less(layout: Any) -> bool:
    """Whether a layout's table rows are batch rows, so that the plan takes no ``req_pool_indices``
    (``BlockTable(batch_rows=True)`` and ``PageList``)."""
    return isinstance(layout, PageList) or (isinstance(layout, BlockTable) and layout.batch_rows is True)
