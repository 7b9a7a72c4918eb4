"""The bytes a runtime's creation allocates, computed from its config, pools and capacities alone, so that
:meth:`CanaryRuntime.create` can refuse a creation above the allocation limit (:mod:`kvcanary_cupy._limits`)
before it allocates anything.

Each term mirrors one buffer (or one family of buffers) that ``CanaryRuntime._build``, ``build_group`` and the
staged batches allocate, device and host copies alike, and is charged to the argument that sizes it, so a refusal
names the argument that asked for most. The 1-element words (counters, flags) are a few hundred bytes per group
and are left out.
"""

from __future__ import annotations

from collections import defaultdict

from ..constants import CANARY_FIELDS_PER_SLOT, CANARY_SLOT_BYTES, VIOLATION_FIELDS
from .batch import StagedBatch
from .config import CanaryConfig, Capacities
from .pools import KvPools

_I64 = 8


def runtime_footprint(config: CanaryConfig, pools: KvPools, caps: Capacities,
                      pool_shape: tuple[int, int] | None) -> dict[str, int]:
    """Bytes per argument that sizes them (``pool_shape``: the expected-token pool's, None without one)."""
    by: dict[str, int] = defaultdict(int)
    batch, tokens = caps.max_batch_size, caps.max_tokens
    batch_arg = f"Capacities.max_batch_size={batch}"
    tokens_arg = f"Capacities.max_tokens={tokens}"
    ring_arg = f"CanaryConfig.ring_capacity={config.ring_capacity}"
    sweep = caps.max_sweep_slots or max(g.num_slots for g in pools.groups)
    sweep_arg = (f"Capacities.max_sweep_slots={sweep}" if caps.max_sweep_slots
                 else f"the largest KvGroup's num_slots={sweep} (the default max_sweep_slots)")
    ring_row = VIOLATION_FIELDS * _I64

    # staged batches, one per model
    rows = len(StagedBatch.ROW_FIELDS) - (0 if config.verify_token_assert else 1)
    token_fields = len(StagedBatch.TOKEN_FIELDS) - (0 if config.write_input_assert else 2)
    by[batch_arg] += len(pools.models) * rows * batch * _I64
    by[tokens_arg] += len(pools.models) * token_fields * tokens * _I64

    # the expected-token pool and the history scattered into it
    if pool_shape is not None:
        pool_rows, width = pool_shape
        by[f"Capacities.pool_rows={pool_rows} x max_context_len={width}"] += pool_rows * width * 4
        history = caps.max_history_tokens or pool_rows * width
        by[f"Capacities.max_history_tokens={history}" if caps.max_history_tokens
           else f"Capacities.pool_rows={pool_rows} x max_context_len={width}"] += history * _I64
        by[batch_arg] += (2 * batch + 1) * _I64

    for group in pools.groups:
        kvs = 2 if group.v_sources is not None else 1
        buffers = 2 if group.has_head else 1  # HEAD and TAIL; a group sharing another's plan has no HEAD
        by[f"KvGroup {group.name!r} num_slots={group.num_slots}"] += buffers * kvs * group.num_slots * CANARY_SLOT_BYTES
        by[ring_arg] += 3 * config.ring_capacity * ring_row  # ring, its drain scratch, its host copy
        by[sweep_arg] += 4 * sweep * _I64
        if group.has_head:  # the forward plans (a group sharing another's plan reads that one's)
            verify = caps.verify_capacity or 3 * group.num_slots
            by[f"Capacities.verify_capacity={verify}" if caps.verify_capacity
               else f"KvGroup {group.name!r} num_slots={group.num_slots} (3 x, the default verify_capacity)"] \
                += 4 * verify * _I64
            by[batch_arg] += (3 * batch + 2) * _I64
            window = config.max_verify_entries_per_step
            if window:  # the bounded verify's window plan, its index and arange scratch
                by[f"CanaryConfig.max_verify_entries_per_step={window}"] += 6 * window * _I64
        if group.is_swa:
            scratch = max(tokens, sweep)
            by[tokens_arg] += tokens * _I64
            by[tokens_arg if tokens >= sweep else sweep_arg] += scratch * (_I64 + 1)

    # sweep staging (host and device), copy_slots staging (host, device, LUT gathers, records in flight)
    by[sweep_arg] += 2 * 3 * sweep * _I64
    by[tokens_arg] += 3 * 2 * tokens * _I64 + tokens * CANARY_FIELDS_PER_SLOT * _I64
    return dict(by)
