"""The canary inside a CUDA graph: bind an engine's persistent buffers once, capture one step, replay it.

    python examples/cuda_graph.py          # on a GPU: plan, verify and write captured in one CUDA graph
    python examples/cuda_graph.py cpu      # anywhere: the same bound launches, called directly (no capture)

The engine keeps every buffer alive at a padded batch size and refills the contents in place each step; a
bound launch reads the contents afresh on every call, so each replay of the graph sees that step's batch. At
step 2 an allocator bug hands one of request 1's slots to request 2; the verify of step 3 catches it.
"""

from __future__ import annotations

import sys

import torch

import kvcanary_cupy as kc
from kvcanary_cupy.bind import bind_plan, bind_verify, bind_write
from kvcanary_cupy.compat.sglang import VerifyOrWriteContext, VerifyPlan, WritePlan

ROWS, WIDTH, BS, TOKENS, CAPACITY = 3, 16, 2, 8, 64  # pool rows (row 0: padding), batch padded to BS / TOKENS
# (req_pool_indices, prefix_lens, extend_seq_lens) per step: prefill two requests, then three decodes
STEPS = [([1, 2], [0, 0], [4, 2]), ([1, 2], [4, 2], [1, 1]), ([1, 2], [5, 3], [1, 1]), ([1, 2], [6, 4], [1, 1])]


def run(device: str) -> kc.ViolationReport:
    i64 = {"dtype": torch.int64, "device": device}
    # The engine's persistent buffers: its slot table (row r, position p -> slot 1 + 16 r + p) and batch tensors
    slots = (torch.arange(ROWS * WIDTH, dtype=torch.int32) + 1).reshape(ROWS, WIDTH)  # host copy of the table
    req_to_token = slots.to(device)
    rpi, prefix, extend = (torch.zeros(BS, **i64) for _ in range(3))
    input_ids, positions = torch.zeros(TOKENS, **i64), torch.zeros(TOKENS, **i64)
    out_cache_loc = torch.full((TOKENS,), -1, **i64)  # -1 marks a padding token: nothing is written for it
    # ... and the canary's: plans, and one endpoint's context (canary buffer, violation ring, counters)
    vp = VerifyPlan.allocate(verify_capacity=CAPACITY, device=device)
    wp = WritePlan.allocate(write_req_capacity=BS, device=device)
    ctx = VerifyOrWriteContext.allocate(num_slots=ROWS * WIDTH + 1, ring_capacity=64, device=device)

    # Bind once, at setup: every argument converted and validated now, none on the steps below.
    plan = bind_plan(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rpi, prefix_lens=prefix,
                     extend_seq_lens=extend, req_to_token=req_to_token, swa_window_size=0,
                     full_to_swa_index_mapping=None, verify_capacity=CAPACITY)
    verify = bind_verify(context=ctx, plan=vp, check_verify_expected_token=False)
    write = bind_write(context=ctx, plan=wp, input_ids=input_ids, positions=positions,
                       out_cache_loc=out_cache_loc, enable_write_input_assert=False)

    def refill(step: int) -> None:
        """Step ``step``'s batch, copied into the bound tensors in place."""
        rows, pre, ext = STEPS[step]
        new = [(r, p) for r, p0, e in zip(rows, pre, ext, strict=True) for p in range(p0, p0 + e)]
        pad = TOKENS - len(new)
        req_to_token.copy_(slots)
        for bound, values in ((rpi, rows), (prefix, pre), (extend, ext),
                              (input_ids, [100 * r + p for r, p in new] + [0] * pad),
                              (positions, [p for _, p in new] + [0] * pad),
                              (out_cache_loc, [int(slots[r, p]) for r, p in new] + [-1] * pad)):
            bound.copy_(torch.tensor(values, dtype=bound.dtype))

    def step_eagerly() -> None:
        plan()
        verify()
        write()

    refill(0)
    step_eagerly()  # step 0 runs eagerly: on a GPU the first calls compile the kernels, which capture forbids
    replay = step_eagerly
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # bound launches follow torch's current stream: here, the capture stream
            step_eagerly()
        replay = graph.replay
    for step in range(1, len(STEPS)):
        if step == 2:  # the allocator bug: request 2's next position gets request 1's slot at position 2
            slots[2, 3] = slots[1, 2]
        refill(step)
        replay()
    return kc.read_violations(ctx)


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    print(run(where).table())
