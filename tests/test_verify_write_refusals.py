"""The NumPy verify and write on out-of-range device values: the exact refusal in "raise" mode (nothing
changed), and in "flag" mode the status bit with the offending entry skipped and every other entry processed.

Expected values are worked out by hand (SPEC §4, §5; the context holds 64 slots, slot 0 is padding).
"""

from __future__ import annotations

import numpy as np
import pytest
from chain_helpers import context, fields, rows, verify_plan, write

import kvcanary_cupy as kc

R = kc.FailReason
SLOT_OUT_OF_RANGE = int(kc.CanaryStatus.SLOT_OUT_OF_RANGE)


def state(ctx) -> list[bytes]:
    return [a.tobytes() for a in (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index, ctx.status,
                                  ctx.kernel_run_counter, ctx.slot_run_counter)]


def written_chain() -> kc.VerifyOrWriteContext:
    """Slots 1, 2 hold a clean chain (tokens 5, 6 at positions 0, 1)."""
    ctx = context()
    write(ctx, [2], [-1], [1, 2], [5, 6], [0, 1])
    return ctx


def refuse_verify(ctx, slots, positions, prevs) -> str:
    before = state(ctx)
    with pytest.raises(kc.CanaryArgumentError) as info:
        kc.launch_canary_verify_kernel(context=ctx, plan=verify_plan(slots, positions, prevs),
                                       check_verify_expected_token=False)
    assert state(ctx) == before, "a refused verify changed the context"
    return str(info.value)


@pytest.mark.parametrize(("slot", "index"), [(64, 1), (-3, 1), (1 << 40, 1)], ids=["at-the-end", "negative", "far"])
def test_verify_refuses_a_slot_outside_the_buffer_and_names_it(slot, index):
    message = refuse_verify(written_chain(), [1, slot, 2], [0, 9, 1], [-1, 0, 1])
    assert message == f"kv-canary: plan.verify_slot_indices[{index}]={slot} is outside canary_buf's 64 slots"


def test_verify_names_a_predecessor_outside_the_buffer_by_its_plan_index_after_padding():
    # Entry 0 is padding (slot 0): the predecessor problem is at plan index 2, not at its compacted index 1.
    message = refuse_verify(written_chain(), [0, 1, 2], [0, 0, 1], [0, -1, 64])
    assert message == "kv-canary: plan.verify_prev_slot_indices[2]=64 is outside canary_buf's 64 slots"


def test_verify_names_a_predecessor_outside_the_buffer_without_padding():
    message = refuse_verify(written_chain(), [1, 2], [0, 1], [-1, 64])
    assert message == "kv-canary: plan.verify_prev_slot_indices[1]=64 is outside canary_buf's 64 slots"


def test_verify_flags_an_outside_slot_and_still_checks_the_others():
    ctx = written_chain()
    runs, slots_run = int(ctx.kernel_run_counter[0]), int(ctx.slot_run_counter[0])
    fields(ctx)[2, 1] = 7  # slot 2's stored position is now wrong: the one violation expected
    vp = verify_plan([1, 64, 2], [0, 9, 1], [-1, 0, 1])
    kc.launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False, on_invalid="flag",
                                   backend="numpy")
    assert int(ctx.status[0]) == SLOT_OUT_OF_RANGE
    (row,) = rows(ctx)
    assert (row[1], row[2], row[7]) == (2, 7, R.VERIFY_POSITION_MISMATCH)
    assert int(ctx.kernel_run_counter[0]) == runs + 1
    assert int(ctx.slot_run_counter[0]) == slots_run + 3  # every active entry counts, skipped ones too


def test_verify_of_in_range_slots_leaves_the_status_word_alone():
    ctx = written_chain()
    ctx.status[0] = 1 << 20  # a bit an earlier launch set: verify only ORs bits in
    kc.launch_canary_verify_kernel(context=ctx, plan=verify_plan([1, 2], [0, 1], [-1, 1]),
                                   check_verify_expected_token=False)
    assert int(ctx.status[0]) == 1 << 20 and rows(ctx) == []
    assert np.array_equal(fields(ctx)[1:3, :2], [[5, 0], [6, 1]])


def refuse_write(offsets, seeds, locs, tokens=3) -> str:
    ctx = written_chain()
    before = state(ctx)
    wp = kc.WritePlan.from_tensors(write_offsets=np.asarray(offsets, np.int64),
                                   write_seed_slot_indices=np.asarray(seeds, np.int64),
                                   write_num_valid_reqs=np.array([len(seeds)], np.int32))
    with pytest.raises(kc.CanaryArgumentError) as info:
        kc.launch_canary_write_kernel(context=ctx, plan=wp, input_ids=np.arange(10, 10 + tokens, dtype=np.int64),
                                      positions=np.arange(tokens, dtype=np.int64),
                                      out_cache_loc=np.asarray(locs, np.int64), enable_write_input_assert=False)
    assert state(ctx) == before, "a refused write changed the context"
    return str(info.value)


def test_write_refuses_offsets_running_backwards_and_names_the_first_pair():
    message = refuse_write([0, 2, 1, 3], [-1, -1, -1], [3, 4, 5])
    assert message == ("kv-canary: plan.write_offsets[1:3]=(2, 1) runs backwards (the offsets must not decrease: "
                       "later token ranges could overlap earlier ones)")


def test_write_refuses_a_token_range_outside_input_ids_before_backwards_offsets():
    message = refuse_write([0, 2, 5, 4], [-1, -1, -1], [3, 4, 5])
    assert message == "kv-canary: plan.write_offsets[1:3]=(2, 5) leaves the 3 tokens of input_ids"


def test_write_refuses_a_seed_outside_the_buffer_and_names_its_request():
    message = refuse_write([0, 1, 3], [-1, 64], [3, 4, 5])
    assert message == "kv-canary: plan.write_seed_slot_indices[1]=64 is outside canary_buf's 64 slots"


def test_write_refuses_a_slot_outside_the_buffer_and_names_its_token():
    message = refuse_write([0, 3], [-1], [3, 64, 5])
    assert message == "kv-canary: out_cache_loc[1]=64 is outside canary_buf's 64 slots"
