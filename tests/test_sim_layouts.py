"""The simulator in each slot layout (``--layout token|block|csr``): the synthetic engine hands the plan
SGLang's req_to_token, a batch-row block table (vLLM-style) or CSR page lists (FlashInfer-style), and every
preset catches every applicable fault kind with zero false positives in all three. In the block layouts the
engine allocates KV in blocks and keeps per-request block lists: the plan reads exactly the slots those lists
describe, the prefix cache shares whole blocks only, and every block's reference count is its number of
holders. Dumped launches of the batch-row layouts carry the layout and replay with it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from test_sim_detection import _check_detected

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.cli import main
from kvcanary_cupy.sim import PRESETS, SimConfig, Simulation, applicable_kinds, load_case, parse_inject, replay_case
from kvcanary_cupy.sim import run_simulation as run

LAYOUTS = ("token", "block", "csr")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_detects_every_applicable_kind_in_each_layout(preset, layout):
    kinds = applicable_kinds(preset)
    report = run(SimConfig(preset=preset, steps=40, requests=10, seed=8, backend="numpy", layout=layout,
                           inject=parse_inject(["all"], kinds)))
    _check_detected(report, kinds)
    assert report["config"]["engine"]["layout"] == layout


def test_a_block_stride_above_the_block_size_detects_every_kind():
    """transformers' physical layout: blocks of 5 tokens, 7 slots apart (the slots between stay unused)."""
    kinds = applicable_kinds("mixed")
    report = run(SimConfig(preset="mixed", steps=120, requests=8, seed=8, backend="numpy", layout="block",
                           block_size=5, block_stride=7, inject=parse_inject(["all"], kinds)))
    _check_detected(report, kinds)
    assert (report["config"]["engine"]["block_size"], report["config"]["engine"]["block_stride"]) == (5, 7)
    assert report["workload"]["swa_evicted_slots"] > 0  # the SWA window still slides over the blocks' slots


def test_block_table_and_page_lists_of_the_same_blocks_read_the_same_violations():
    """The block and csr layouts describe the same engine (same blocks): every kind produces the very same
    violation rows whichever of the two the plan reads."""
    kinds = applicable_kinds("mixed")
    reports = [run(SimConfig(preset="mixed", steps=40, requests=10, seed=4, backend="numpy", layout=layout,
                             inject=parse_inject(["all"], kinds))) for layout in ("block", "csr")]
    assert reports[0]["violations"]["total"] > 0
    assert reports[1]["violations"] == reports[0]["violations"]
    assert reports[1]["faults"] == reports[0]["faults"]


def test_one_token_blocks_make_the_block_engine_the_token_engine():
    """With blocks of one token the block engine allocates, shares and frees exactly what the token engine
    does: every kind whose injection does not depend on the table's granularity (all but the two table faults)
    or on how the expected-token pool is indexed (stale-expected) gives the very same violation rows."""
    kinds = [k for k in applicable_kinds("mixed") if k not in ("double-alloc", "req-to-token", "stale-expected")]
    token, block = (run(SimConfig(preset="mixed", steps=40, requests=10, seed=4, backend="numpy", layout=layout,
                                  block_size=size, inject=parse_inject(["all"], kinds)))
                    for layout, size in (("token", None), ("block", 1)))
    assert token["violations"]["total"] > 0
    assert block["violations"] == token["violations"]
    assert block["faults"] == token["faults"]
    assert block["workload"] == token["workload"]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.shape[0] else n


@pytest.mark.parametrize(("layout", "size", "stride"), [("block", 4, 6), ("csr", 16, None)])
def test_requests_keep_blocks_of_block_size_tokens_and_share_whole_blocks(layout, size, stride):
    """Checked at every step of a clean run, from the engine's block lists and an independent bookkeeping:

    * the plan's verify slots are ``blocks[p // B] * stride + p % B`` for each request's positions below its
      prefix, and a request holds exactly the blocks its assigned positions need;
    * a block's reference count is the number of its holders (live block lists and cached paths), and a block
      with none is free;
    * a new request shares the longest cached prefix cut back to whole blocks: a match that ends inside a block
      is recomputed from the block's start (the cache holds only the whole blocks of finished requests)."""
    sim = Simulation(SimConfig(preset="decode", steps=60, requests=16, seed=3, backend="numpy", layout=layout,
                               block_size=size, block_stride=stride))
    eng, rt, step_of = sim.engine, sim.runtime, stride or size
    batches, cached_prefixes, cut_matches = [], [], []
    schedule, pre_forward, finish_step = eng.schedule, rt.pre_forward, eng.finish_step

    def scheduled(step):
        batch = schedule(step)
        for req in batch.admitted:
            prompt = req.tokens[: req.prompt_len - 1]
            best = max([_common(prompt, done) for done in cached_prefixes] or [0])
            assert req.tree_len % size == 0 and req.tree_len <= best - best % size
            if req.tree_len and best % size:
                cut_matches.append(req.tree_len == best - best % size)
        batches.append(batch)
        return batch

    def planned(*, model="target"):
        pre_forward(model=model)
        batch = batches[-1]
        expected = []
        for req, prefix in zip(batch.reqs, batch.prefix_h.tolist(), strict=True):
            assert len(req.blocks) == -(-req.assigned // size)
            expected += [req.blocks[p // size] * step_of + p % size for p in range(prefix)]
        plan = rt.groups["FULL"].verify_plan
        assert int(plan.verify_num_valid[0]) == len(expected)
        assert plan.verify_slot_indices[: len(expected)].tolist() == expected

    def finished(batch):
        done = finish_step(batch)
        for req in done:
            n = req.computed - req.computed % size  # only whole blocks are cached
            cached_prefixes.append(req.tokens[:n])
        holders = Counter(b for req in eng.running for b in req.blocks)
        slots, positions, _ = eng.tree.walk()
        holders.update((slots[positions % size == 0] // step_of).tolist())
        refs = eng.alloc.refs
        assert {b: int(refs[b]) for b in np.flatnonzero(refs).tolist()} == dict(holders)
        assert eng.alloc.available == refs.shape[0] - 1 - len(holders)
        return done

    eng.schedule, rt.pre_forward, eng.finish_step = scheduled, planned, finished
    report = sim.run()
    assert report["passed"] and report["violations"]["total"] == 0
    assert report["workload"]["prefix_tokens_reused"] > 0
    assert cut_matches and any(cut_matches)  # some match ended inside a block and was cut back to its start


@pytest.mark.skipif(unavailable_reason("host") is not None, reason=f"host backend: {unavailable_reason('host')}")
@pytest.mark.parametrize("layout", ["block", "csr"])
def test_a_clean_host_backend_run_in_a_batch_row_layout_reads_nothing(layout):
    report = run(SimConfig(preset="mixed", steps=20, requests=6, seed=11, backend="host", layout=layout))
    assert report["passed"] and report["violations"]["total"] == 0 and report["violations"]["status"] == []


@pytest.mark.parametrize("layout", ["block", "csr"])
def test_dumped_launches_carry_the_layout_and_replay_with_it(tmp_path, layout):
    sim = Simulation(SimConfig(preset="mixed", steps=30, requests=8, seed=6, backend="numpy", layout=layout,
                               inject=parse_inject(["req-to-token", "double-alloc"]), dump_dir=str(tmp_path)))
    assert sim.run()["passed"]
    assert sim.recorder.dumped
    for path in sim.recorder.dumped.values():
        case = load_case(path)
        if case.meta["role"] != "SWEEP":
            assert "in_req_to_token" not in case.arrays
            assert any(k.startswith("in_layout_") for k in case.arrays)
        outcome = replay_case(case, "numpy")
        assert outcome.reproduced, path.name
        if outcome.plan_check is not None:
            assert "identical" in outcome.plan_check, outcome.plan_check


def test_the_command_line_takes_a_layout(capsys):
    assert main(["simulate", "--preset", "decode", "--steps", "12", "--requests", "3", "--layout", "csr",
                 "--backend", "numpy", "--quiet", "--plain"]) == 0
    assert "backend numpy, csr layout, 16-token blocks" in " ".join(capsys.readouterr().out.split())  # may wrap
    assert main(["simulate", "--preset", "decode", "--steps", "12", "--requests", "3", "--layout", "block",
                 "--block-size", "4", "--block-stride", "6", "--backend", "numpy", "--quiet", "--plain"]) == 0
    assert "block layout, 4-token blocks 6 slots apart" in " ".join(capsys.readouterr().out.split())
    assert main(["simulate", "--block-size", "4"]) == 2
    assert "--block-size applies to --layout block or csr" in capsys.readouterr().err
    assert main(["simulate", "--layout", "csr", "--block-stride", "32"]) == 2
    assert "--block-stride applies to --layout block" in capsys.readouterr().err
    assert main(["simulate", "--layout", "block", "--block-size", "8", "--block-stride", "4"]) == 2
    assert "must lie in [block size 8, 4096], got 4" in capsys.readouterr().err
    assert main(["simulate", "--layout", "paged"]) == 2
    assert "argument --layout: invalid choice: 'paged'" in capsys.readouterr().err
    assert main(["simulate", "--disaggregated", "--layout", "csr"]) == 2
    assert "--layout does not apply to --disaggregated: its engines keep req_to_token" in capsys.readouterr().err


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("layout", "size", "stride"), [("block", 4, 6), ("block", 5, 5), ("csr", 16, None)])
def test_a_block_table_fault_names_the_first_slot_and_position_of_the_block_it_redirects(layout, size, stride,
                                                                                          seed):
    import re

    report = run(SimConfig(preset="mixed", steps=40, requests=10, seed=seed, backend="numpy", layout=layout,
                           block_size=size, block_stride=stride, inject={"req-to-token": 0.2}))
    _check_detected(report, ["req-to-token"])
    assert len(report["faults"]) >= 2
    for fault in report["faults"]:
        # "req_to_block[row, k] of request R set to block W (...)": block k of the request now reads block W, whose
        # slots are W * stride + [0, size), from the request's position k * size on
        k, wrong = map(int, re.search(r"req_to_block\[\d+, (\d+)\] .* set to block (\d+) ", fault["detail"]).groups())
        assert (fault["slot"], fault["position"]) == (wrong * (stride or size), k * size), fault
