"""The canary installed in Hugging Face transformers' continuous batching (CPU torch, random-weight models).

Oracles: the tokens ``generate_batch`` returns without the canary; the engine's own per-layer K/V views
(``allocator._kv_token_views``) hashed by the scalar oracle in ``tests/oracle.py``; the fault's own record of
where and when it struck.
"""

from __future__ import annotations

import inspect
import json
import logging

import numpy as np
import pytest
import torch
import transformers
from oracle import fold_source_bytes, splitmix64
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator
from transformers.generation.continuous_batching.cache_allocators.cache_pool import CachePool
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState

from kvcanary_cupy import CanaryArgumentError
from kvcanary_cupy.cli import main
from kvcanary_cupy.integrations.transformers import CanaryOptions, check_version, install
from kvcanary_cupy.integrations.transformers.faults import FAULT_KINDS, make_injector
from kvcanary_cupy.integrations.transformers.simulate import WorkloadStats
from kvcanary_cupy.integrations.transformers.workloads import (
    build_model,
    cb_config,
    generate,
    generation_config,
    workloads,
)

WORKLOADS = workloads()
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models():
    return {arch: build_model(arch) for arch in ("llama", "gemma3")}


def _generate_raw(model, w):
    return w.run(model)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_generation_is_token_exact_and_clean_with_the_canary(models, name):
    w = workloads()[name]  # built here, not the module's copy: mutation testing sees which test reads a workload
    model = models[w.arch]
    reference = generate(model, w)
    canary = install(model)
    stats = WorkloadStats()
    canary.observers.append(stats)
    with_canary = generate(model, w)
    canary.finish()
    canary.remove()
    assert with_canary == reference
    assert canary.violations == []
    # The canary really ran: every token the engine processed was stamped into the HEAD buffer of the full
    # group, and every endpoint of every group verified something; the runtime's health check agrees.
    (state,) = canary.states.values()
    groups = state.rt.groups
    tokens = stats.prefill_tokens + stats.decode_tokens
    assert int(groups["FULL"].endpoints["HEAD"][0].write_ctx.slot_run_counter[0]) == tokens
    for g in groups.values():
        assert all(int(ep.verify_ctx.slot_run_counter[0]) > 0 for ep in g.endpoints["HEAD"] + g.endpoints["TAIL"])
    assert ("SWA" in groups) == (w.arch == "gemma3")
    assert state.health_problems == [] and state.status_bits == 0
    # The workload exercised what it is named after.
    if name == "shared-prefix":
        assert stats.prefix_tokens_reused >= 2 * 24 - 8
    if name == "queueing":
        assert stats.soft_resets > 0 and stats.peak_batch < len(w.prompts)
    if name == "mixed-lengths":
        assert stats.peak_batch > 1
    if name == "forks":
        assert len(with_canary) == w.num_results and any("__child#" in rid for rid in with_canary)


def test_a_bounded_verify_runs_clean_and_verifies_at_most_its_window_per_step(models):
    w = WORKLOADS["mixed-lengths"]
    model = models[w.arch]
    reference = generate(model, w)
    canary = install(model, CanaryOptions(max_verify_entries_per_step=8, sweep_interval=0))
    assert generate(model, w) == reference
    canary.finish()
    canary.remove()
    (state,) = canary.states.values()
    assert canary.violations == [] and state.health_problems == [] and state.status_bits == 0
    stats = state.rt.stats()
    assert stats["verify_entries_per_step"] == 8 and stats["verify_live_max"] > 8
    for g in state.rt.groups.values():
        for ep in g.endpoints["HEAD"] + g.endpoints["TAIL"]:
            verified = int(ep.verify_ctx.slot_run_counter[0])
            assert 0 < verified <= 8 * canary.steps


def test_mode_off_launches_nothing_and_changes_nothing(models):
    w = WORKLOADS["mixed-lengths"]
    model = models[w.arch]
    reference = generate(model, w)
    canary = install(model, mode="off")
    assert generate(model, w) == reference
    canary.finish()
    canary.remove()
    (state,) = canary.states.values()
    assert state.rt.groups == {} and canary.violations == [] and canary.steps > 0


def test_real_kv_fingerprints_are_the_engine_memory(models):
    """TAIL records hold the fingerprint of the bytes the engine's own per-layer views show for that slot."""
    w = WORKLOADS["sliding-window"]
    model = models[w.arch]
    canary = install(model, CanaryOptions(real_kv_hash="all"))
    checked = []

    class Check:
        def before_batch(self, canary, step, kwargs, requests, cache):
            pass

        def on_layer_write(self, canary, step, allocator, layer_idx, write_index):
            return write_index

        def after_forward(self, canary, step, batch, cache):
            state = canary.states[id(cache)]
            for geo in state.geos:
                alloc = geo.allocator
                groups = [g for g in state.rt.groups.values() if g.model == alloc.layer_type]
                for slot in {int(s) for s in batch.head_locs[geo.index] if s >= 0}:
                    for ep in (ep for g in groups for ep in g.endpoints["TAIL"]):
                        total = 0
                        for src in ep.write_ctx.real_kv_sources:
                            layer, kind = _engine_view_of(src, alloc)
                            row = alloc._kv_token_views[layer][kind][slot].contiguous().view(torch.uint8)
                            data = row.numpy().tobytes()
                            total = splitmix64(total ^ fold_source_bytes(data, len(data)))
                        stored = int(np.asarray(ep.write_ctx.canary_buf[slot]).view(np.uint64)[3])
                        assert stored == total, (step, geo.name, slot)
                        checked.append(slot)

    canary.observers.append(Check())
    generate(model, w)
    canary.remove()
    assert len(checked) > 100


def _engine_view_of(src, alloc):
    """(layer, 0 for K / 1 for V) of the engine's own per-layer view starting where the source starts."""
    base = src.byte_rows.ctypes.data
    for layer, views in alloc._kv_token_views.items():
        for kind in (0, 1):
            if views[kind].data_ptr() == base:
                return layer, kind
    raise AssertionError("a real-KV source does not start at any of the engine's K/V views")


EXPECTED_REASONS = {
    "kv-bitflip": {"VERIFY_REAL_KV_HASH_MISMATCH"},
    "block-table": {"VERIFY_TOKEN_MISMATCH", "VERIFY_CHAIN_HASH_MISMATCH", "VERIFY_POSITION_MISMATCH"},
    "kv-write-skip": {"VERIFY_POSITION_MISMATCH", "VERIFY_TOKEN_MISMATCH", "VERIFY_CHAIN_HASH_MISMATCH",
                      "VERIFY_REAL_KV_HASH_MISMATCH"},
    "kv-misdirect": {"VERIFY_REAL_KV_HASH_MISMATCH"},
    "wrong-token": {"WRITE_TOKEN_MISMATCH"},
    "double-alloc": {"VERIFY_POSITION_MISMATCH", "VERIFY_TOKEN_MISMATCH", "VERIFY_REAL_KV_HASH_MISMATCH",
                     "VERIFY_CHAIN_HASH_MISMATCH"},
    "copy-corrupt": {"VERIFY_REAL_KV_HASH_MISMATCH"},
}


@pytest.mark.parametrize("workload,kind", [("mixed-lengths", k) for k in FAULT_KINDS if k != "copy-corrupt"]
                         + [("sliding-window", k) for k in ("kv-bitflip", "wrong-token", "kv-write-skip")]
                         + [("forks", "copy-corrupt")])
def test_each_fault_kind_is_detected_with_reason_and_step(models, workload, kind):
    w = WORKLOADS[workload]
    model = models[w.arch]
    canary = install(model)
    injector = make_injector(kind, at=4, seed=3, vocab_size=int(model.config.vocab_size))
    canary.observers.append(injector)
    _generate_raw(model, w)
    canary.finish()
    canary.remove()
    injector.close()
    fault = injector.fault
    assert fault is not None, f"{kind}: no target found"
    assert fault.step >= 4
    before = [v for v in canary.violations if v.step < fault.step]
    after = [v for v in canary.violations if v.step >= fault.step]
    assert before == []
    assert after, f"{kind} injected at step {fault.step} ({fault.detail}) was not detected"
    first = after[0]
    if kind == "copy-corrupt":  # found when the forked child is first scheduled, at the copied slot
        assert first.violation.slot == fault.slot and first.step <= fault.step + 3
    else:  # found by the launches of the step it struck or the next one
        assert first.step <= fault.step + 1
    assert set(first.violation.reasons) & EXPECTED_REASONS[kind]
    if kind == "wrong-token":
        assert first.step == fault.step and first.violation.launch_tag.startswith("HEAD_K")
        assert first.violation.position == fault.position
    if kind == "kv-bitflip":
        assert first.violation.slot == fault.slot and first.violation.position == fault.position


def test_bitflip_in_a_sliding_window_layer_is_found_by_the_swa_group(models):
    w = WORKLOADS["sliding-window"]
    model = models[w.arch]
    canary = install(model)
    injector = make_injector("kv-bitflip", at=4, seed=1)  # this seed picks the sliding-window group
    canary.observers.append(injector)
    w.run(model)
    canary.finish()
    canary.remove()
    fault = injector.fault
    assert fault is not None and fault.group == "SWA"
    assert [v for v in canary.violations if v.step < fault.step] == []
    first = next(v for v in canary.violations if v.step >= fault.step)
    assert first.step == fault.step and first.group == "SWA"
    assert first.violation.launch_tag.startswith("TAIL_") and first.violation.launch_tag.endswith("_SWA")
    assert (first.violation.slot, first.violation.position) == (fault.slot, fault.position)
    assert first.violation.reasons == ("VERIFY_REAL_KV_HASH_MISMATCH",)


def test_the_chain_position_assert_is_on_in_full_attention_groups_only(models):
    """A decode token handed to the forward one position too far: every write flags it against the request
    state (input assert); the full-attention group's writes flag it a second time against the seed slot's
    stored position (chain-position assert), the sliding-window group's, whose assert stays off, do not."""
    w = WORKLOADS["sliding-window"]
    model = models[w.arch]
    canary = install(model)
    hit = {}

    class ShiftPosition:
        def before_batch(self, canary, step, kwargs, requests, cache):
            if hit or step < 4:
                return
            cu = kwargs["cu_seq_lens_q"]
            for i, future in enumerate(requests):
                if int(future.query_length) == 1 and int(future.state.position_offset) > 1:
                    kwargs["position_ids"].view(-1)[int(cu[i])] += 1
                    hit.update(step=step, position=int(future.state.position_offset))  # the true one + 1
                    return

        def on_layer_write(self, canary, step, allocator, layer_idx, write_index):
            return write_index

        def after_forward(self, canary, step, batch, cache):
            pass

    canary.observers.append(ShiftPosition())
    _generate_raw(model, w)
    canary.finish()
    canary.remove()
    assert hit
    rows = [v for v in canary.violations if v.step == hit["step"] and v.violation.launch_tag.startswith("HEAD_K")]
    assert all(v.violation.reasons == ("WRITE_POSITION_MISMATCH",) and v.violation.position == hit["position"]
               for v in rows)
    assert sorted(v.violation.launch_tag for v in rows) == ["HEAD_K_FULL", "HEAD_K_FULL", "HEAD_K_SWA"]
    assert [v for v in canary.violations if v.step < hit["step"]] == []


def test_the_sliding_window_chain_assert_stays_off_because_long_chunks_overwrite_their_seed(models):
    """Why the sliding-window groups keep the assert off: switched on, a clean run trips it, and only in the
    steps where a request writes a chunk of at least ``window`` tokens (its predecessor's ring slot is
    overwritten or skipped within the chunk, so the write seeds from slot 0)."""
    w = WORKLOADS["sliding-window"]
    model = models[w.arch]
    window = int(model.config.sliding_window)
    reference = generate(model, w)
    canary = install(model)
    long_chunks = set()

    class EverythingOn:
        def before_batch(self, canary, step, kwargs, requests, cache):
            if step == 0:
                canary.states[id(cache)].rt.mark_init_finished()
            if any(int(f.query_length) >= window and int(f.state.position_offset) > int(f.query_length)
                   for f in requests):
                long_chunks.add(step)

        def on_layer_write(self, canary, step, allocator, layer_idx, write_index):
            return write_index

        def after_forward(self, canary, step, batch, cache):
            pass

    canary.observers.append(EverythingOn())
    assert generate(model, w) == reference
    canary.finish()
    canary.remove()
    assert canary.violations and long_chunks
    assert {v.step for v in canary.violations} <= long_chunks
    assert all(v.group == "SWA" and v.violation.reasons == ("WRITE_POSITION_MISMATCH",) for v in canary.violations)


def test_sweep_verifies_cached_blocks_cleanly_and_finds_a_flipped_bit_in_one(models):
    """The blocks the engine keeps for prefix reuse are swept; a bit flipped in one is found there."""
    w = WORKLOADS["shared-prefix"]
    model = models[w.arch]
    canary = install(model, CanaryOptions(sweep_interval=1))
    generate(model, w)
    canary.finish()
    canary.remove()
    (state,) = canary.states.values()
    assert canary.violations == [] and state.rt.stats()["swept_slots"] > 0

    flipped = {}

    class FlipCachedBlock:
        def before_batch(self, canary, step, kwargs, requests, cache):
            pass

        def on_layer_write(self, canary, step, allocator, layer_idx, write_index):
            return write_index

        def after_forward(self, canary, step, batch, cache):
            state = canary.states[id(cache)]
            geo = state.geos[0]
            cached = [b for b in geo.allocator.ledger.cached_blocks if b in state.block_index]
            if flipped or not cached:
                return
            slot = cached[0] * geo.stride + 1
            byte = slot * geo.row_bytes  # K of the group's first layer, first byte of the row
            cache.cache_tensor[byte] ^= 4
            flipped.update(step=step, slot=slot)

    w = WORKLOADS["mixed-lengths"]
    canary = install(model, CanaryOptions(sweep_interval=1))
    canary.observers.append(FlipCachedBlock())
    generate(model, w)
    canary.finish()
    canary.remove()
    assert flipped, "no block was ever cached"
    assert [v for v in canary.violations if v.step <= flipped["step"]] == []
    hits = [v for v in canary.violations if v.violation.slot == flipped["slot"]]
    assert hits and hits[0].violation.launch_tag == "SWEEP_K_FULL"
    assert hits[0].violation.reasons == ("VERIFY_REAL_KV_HASH_MISMATCH",)
    assert hits[0].step == flipped["step"] + 1


def test_raise_mode_stops_the_engine_loop_with_the_violation(models):
    w = WORKLOADS["mixed-lengths"]
    model = models[w.arch]
    canary = install(model, mode="raise")
    canary.observers.append(make_injector("kv-bitflip", at=3, seed=1))
    out = _generate_raw(model, w)
    canary.remove()
    errors = [str(r.error) for r in out.values() if r.error is not None]
    assert errors and all("new violation(s)" in e for e in errors)
    assert "reasons=verify_real_kv_hash" in errors[0]


def test_a_backend_the_models_device_cannot_run_is_refused_at_install_with_nothing_hooked(models):
    model = models["llama"]
    w = WORKLOADS["mixed-lengths"]
    reference = generate(model, w)
    hooks_before = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    with pytest.raises(CanaryArgumentError, match=r"^kv-canary: backend='cuda': .*on cpu"):
        install(model, CanaryOptions(backend="cuda"))
    assert "_kvcanary" not in vars(model) and "init_continuous_batching" not in vars(model)
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks_before
    assert generate(model, w) == reference  # the engine runs as before


def test_remove_restores_the_engine_methods(models):
    model = models["llama"]
    w = WORKLOADS["mixed-lengths"]
    reference = generate(model, w)
    canary = install(model)
    assert "init_continuous_batching" in vars(model)
    with pytest.raises(CanaryArgumentError, match="already installed"):
        install(model)
    generate(model, w)
    (state,) = canary.states.values()
    allocators = [geo.allocator for geo in state.geos]
    assert all("update" in vars(a) for a in allocators)
    canary.remove()
    assert generate(model, w) == reference  # the engine runs as before
    assert "init_continuous_batching" not in vars(model) and "_kvcanary" not in vars(model)
    assert model.init_continuous_batching.__func__ is type(model).init_continuous_batching
    assert not model._forward_pre_hooks and not model._forward_hooks
    for a in allocators:
        assert "update" not in vars(a)
        assert a.update.__func__ is type(a).update


def test_install_on_a_manager(models):
    w = WORKLOADS["mixed-lengths"]
    model = models["llama"]
    reference = generate(model, w)
    manager = model.init_continuous_batching(generation_config(w.max_new_tokens), cb_config(**w.cb))
    canary = install(manager)
    manager.warmup()
    manager.start()
    try:
        ids = manager.add_requests(inputs=[list(p) for p in w.prompts], max_new_tokens=w.max_new_tokens)
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=30)
            assert r is not None
            if r.is_finished():
                results[r.request_id] = list(r.generated_tokens)
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    canary.finish()
    canary.remove()
    assert results == reference
    assert canary.steps > 0 and canary.violations == []


# Internal transformers methods the integration patches or calls: a change in any of them must fail here,
# loudly, before it silently breaks the hooks (see docs/transformers.md).
INTERNAL_SIGNATURES = {
    FullAttentionCacheAllocator.update: ["self", "key_states", "value_states", "layer_idx", "read_index",
                                         "write_index"],
    SlidingAttentionCacheAllocator.update: ["self", "key_states", "value_states", "layer_idx", "read_index",
                                            "write_index"],
    CachePool.get_free_blocks: ["self", "index", "num_blocks"],
    CacheAllocator.copy_blocks: ["self", "source_block_ids", "dest_block_ids"],
    PagedAttentionCache.update: ["self", "key_states", "value_states", "layer_idx", "kwargs"],
}


def test_internal_transformers_api_is_the_one_the_hooks_were_written_for(models):
    for fn, params in INTERNAL_SIGNATURES.items():
        assert list(inspect.signature(fn).parameters) == params, fn.__qualname__
    assert FutureRequestState.__slots__ == ("state", "has_new_token", "complete_blocks", "query_length")
    fields = set(RequestState.__dataclass_fields__)
    assert {"request_id", "initial_tokens", "generated_tokens", "position_offset", "max_new_tokens"} <= fields
    w = WORKLOADS["sliding-window"]
    manager = models["gemma3"].init_continuous_batching(generation_config(4), cb_config(**w.cb))
    manager.warmup()  # builds the batch processor and its cache in this thread, runs no forward on CPU
    try:
        processor = manager.batch_processor
        assert isinstance(processor.cache, PagedAttentionCache)
        assert isinstance(processor.inputs_and_outputs.requests_in_batch, list)
        cache = processor.cache
        assert cache.cache_tensor.dtype == torch.uint8 and cache.cache_tensor.dim() == 1
        assert [type(a) for a in cache.cache_allocators.values()] == [SlidingAttentionCacheAllocator,
                                                                      FullAttentionCacheAllocator]
        for a in cache.cache_allocators.values():
            for attr in ("tokens_per_page", "block_physical_stride", "layer_indices", "num_key_value_heads",
                         "head_dim", "bytes_per_block", "write_trash_index", "block_table", "pool", "index"):
                assert hasattr(a, attr), attr
        assert cache.cache_allocators["sliding_attention"].sliding_window == 8
        assert isinstance(cache.cache_allocators["full_attention"].ledger.cached_blocks, dict)
    finally:
        manager.destroy()


def test_unsupported_transformers_versions_are_refused_naming_the_range():
    assert check_version() == transformers.__version__
    assert check_version("5.24.7") == "5.24.7"
    for bad in ("5.23.0", "5.25.0", "4.57.1", "6.0"):
        with pytest.raises(CanaryArgumentError, match=r"supported: transformers>=5\.24,<5\.25"):
            check_version(bad)


def test_simulate_engine_transformers_reports_and_exits_zero(tmp_path, capsys, caplog):
    import kvcanary_cupy.backends as backends

    path = tmp_path / "tf.json"
    backends.log_auto_choice.cache_clear()  # logged once per process: let this run's launches log their choice
    with caplog.at_level(logging.INFO, logger="kvcanary_cupy.backends"):
        status = main(["simulate", "--engine", "transformers", "--inject", "kv-bitflip", "--quiet", "--plain",
                       "--json", str(path)])
    out = capsys.readouterr().out
    assert status == 0, out
    # the default backend the engine's launches ran: host where g++ builds it, the report saying the same
    ran = {r.getMessage().split(": ")[1].split(" ")[0] for r in caplog.records
           if r.getMessage().startswith("kv-canary backend auto: ")}
    want = "host" if backends.unavailable_reason("host") is None else "numpy"
    assert ran == {want}
    report = json.loads(path.read_text())
    assert report["cost"]["backend"] == want
    assert report["passed"] and report["violations"]["false_positives"] == 0
    assert [k["kind"] for k in report["kinds"]] == ["kv-bitflip"]
    assert all(k["detected"] == k["injected"] >= len(WORKLOADS) - 1 for k in report["kinds"])
    assert all(w["token_exact"] for w in report["workloads"]) and len(report["workloads"]) == len(WORKLOADS)
    assert "fault kind" in out and "PASS" in out


def test_simulate_engine_transformers_refuses_what_it_cannot_run(capsys):
    assert main(["simulate", "--engine", "transformers", "--backend", "cuda", "--quiet"]) == 2
    assert "not available with --engine transformers" in capsys.readouterr().err
    assert main(["simulate", "--engine", "transformers", "--inject", "swa-early-evict", "--quiet"]) == 2
    assert "unknown fault kind 'swa-early-evict' for --engine transformers" in capsys.readouterr().err


def test_the_report_has_one_row_per_workload_with_each_clean_runs_counts_under_its_key():
    from kvcanary_cupy.integrations.transformers.report import build_report
    from kvcanary_cupy.integrations.transformers.results import (
        RunResult,
        SimulationRecord,
        TransformersSimConfig,
    )

    # two clean runs whose counts are all different numbers, so that a count under another key shows
    sim = SimulationRecord(TransformersSimConfig(model_size="small", seed=3, backend="numpy"))
    chosen = workloads(seed=3)
    for i, name in enumerate(("queueing", "forks")):
        stats = WorkloadStats()
        stats.prefill_tokens, stats.decode_tokens, stats.prefix_tokens_reused = 101 + i, 203 + i, 307 + i
        stats.soft_resets, stats.peak_batch = 409 + i, 503 + i
        sim.runs.append(RunResult(workload=name, kind=None, steps=11 + i, step_offset=40 * i, violations=[],
                                  fault=None, stats=stats, seconds={}, wall=1.23456 + i, counters={}, status_bits=0,
                                  dropped=0, health_problems=[], tokens={}, errors={f"r{j}": "x" for j in range(i)}))
        sim.token_exact[name] = i == 0
        sim.reference_wall[name] = 0.98761 + i
    sim.total_steps = 80
    rows = build_report(sim)["workloads"]
    assert rows == [
        {"name": "queueing", "description": chosen["queueing"].description, "arch": chosen["queueing"].arch,
         "requests": chosen["queueing"].num_results, "max_new_tokens": chosen["queueing"].max_new_tokens,
         "steps": 11, "token_exact": True, "violations": 0, "prefill_tokens": 101, "decode_tokens": 203,
         "prefix_tokens_reused": 307, "soft_resets": 409, "peak_batch": 503, "requests_failed": 0,
         "wall_s": 1.2346, "reference_wall_s": 0.9876},
        {"name": "forks", "description": chosen["forks"].description, "arch": chosen["forks"].arch,
         "requests": chosen["forks"].num_results, "max_new_tokens": chosen["forks"].max_new_tokens,
         "steps": 12, "token_exact": False, "violations": 0, "prefill_tokens": 102, "decode_tokens": 204,
         "prefix_tokens_reused": 308, "soft_resets": 410, "peak_batch": 504, "requests_failed": 1,
         "wall_s": 2.2346, "reference_wall_s": 1.9876}]


def test_a_simulation_reports_its_progress_once_per_run_with_the_canary(capsys):
    from kvcanary_cupy.integrations.transformers.results import TransformersSimConfig
    from kvcanary_cupy.integrations.transformers.simulate import run_quietly

    # one workload, one fault kind: its reference run, the clean run and the fault run make 3, two with the canary
    cfg = TransformersSimConfig(model_size="small", inject=("kv-bitflip",), backend="numpy",
                                workloads=("mixed-lengths",))
    report = run_quietly(cfg)
    assert [w["name"] for w in report["workloads"]] == ["mixed-lengths"]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["run 2/3: mixed-lengths: clean run, 0 violation(s)", "run 3/3: mixed-lengths: kv-bitflip"]


def test_the_report_puts_a_fault_and_its_first_detection_on_the_global_step_count():
    from types import SimpleNamespace

    from kvcanary_cupy.integrations.common.state import StepViolation
    from kvcanary_cupy.integrations.transformers.report import build_report
    from kvcanary_cupy.integrations.transformers.results import (
        RunResult,
        SimulationRecord,
        TransformersSimConfig,
    )

    sim = SimulationRecord(TransformersSimConfig(model_size="small", inject=("kv-bitflip",), backend="numpy"))

    def run(kind, offset, steps, violations, fault):
        return RunResult(workload="forks", kind=kind, steps=steps, step_offset=offset, violations=violations,
                         fault=fault, stats=WorkloadStats(), seconds={}, wall=1.0, counters={}, status_bits=0,
                         dropped=0, health_problems=[], tokens={}, errors={})

    row = SimpleNamespace(launch_tag="TAIL_K_FULL", reasons=("VERIFY_CHAIN_HASH_MISMATCH",), reason_bits=1)
    fault = SimpleNamespace(step=2, request="r1", position=5, slot=33, detail="bit 3", group="FULL")
    # the fault run starts at global step 11: injected at its step 2 (global 13), its first row appended by its
    # step 4's launches and read one step later (global 11 + 4 + 1 = 16): latency 3
    sim.runs = [run(None, 0, 10, [], None),
                run("kv-bitflip", 11, 9, [StepViolation(4, "FULL", row), StepViolation(6, "FULL", row)], fault)]
    sim.token_exact["forks"], sim.reference_wall["forks"] = True, 0.5
    sim.total_steps = 21
    report = build_report(sim)
    (f,) = report["faults"]
    assert (f["step"], f["detection_step"], f["latency_steps"], f["detected_by"], f["violations"]) == (
        13, 16, 3, "TAIL_K_FULL", 2)
    assert [s for s, n in enumerate(report["timeline"]["injected"]) if n] == [13]
    assert [s for s, n in enumerate(report["timeline"]["detected"]) if n] == [16]
    assert report["kinds"][0]["latency_steps"] == {"min": 3, "median": 3.0, "max": 3}
    assert {k: report["kinds"][0][k] for k in ("injected", "detected", "missed", "status", "violations")} == {
        "injected": 1, "detected": 1, "missed": 0, "status": "detected", "violations": 2}


def test_the_report_states_the_canarys_cost_per_step_and_share_of_the_generate_time():
    from types import SimpleNamespace

    from kvcanary_cupy.integrations.transformers.report import build_report, summary_lines
    from kvcanary_cupy.integrations.transformers.results import (
        RunResult,
        SimulationRecord,
        TransformersSimConfig,
    )

    sim = SimulationRecord(TransformersSimConfig(model_size="small", inject=("kv-bitflip",), backend="numpy"))

    def run(kind, offset, steps, seconds, wall, counters, fault):
        return RunResult(workload="forks", kind=kind, steps=steps, step_offset=offset, violations=[], fault=fault,
                         stats=WorkloadStats(), seconds=seconds, wall=wall, counters=counters, status_bits=0,
                         dropped=0, health_problems=[], tokens={}, errors={})

    fault = SimpleNamespace(step=2, request="r1", position=5, slot=33, detail="bit 3", group="FULL")
    # "forward" is the engine's own time, not a canary phase
    sim.runs = [run(None, 0, 12, {"verify": 0.5, "write": 0.25, "batch": 0.125, "forward": 3.0}, 4.0,
                    {"verify_entries": 300, "write_entries": 40, "launches": 20}, None),
                run("kv-bitflip", 12, 8, {"verify": 0.25, "sweep": 0.125, "read": 0.375, "forward": 3.0}, 4.0,
                    {"verify_entries": 200, "write_entries": 24, "launches": 12}, fault)]
    sim.token_exact["forks"], sim.reference_wall["forks"] = True, 0.5
    sim.total_steps, sim.wall = 20, 9.5
    cost = build_report(sim)["cost"]
    # 20 steps: a phase's ms per step is 50 x its seconds; the canary's 1.625 s of the runs' 8 s is 0.203125
    assert cost == {
        "backend": "numpy", "wall_s": 9.5,
        "ms_per_step": {"batch": 6.25, "stage": 0.0, "scatter": 0.0, "plan": 0.0, "verify": 37.5, "write": 12.5,
                        "sweep": 6.25, "read": 18.75, "engine": 318.75},
        "canary_ms_per_step": 81.25, "canary_share_of_generate": 0.2031,
        "verify_entries": 500, "write_entries": 64, "launches": 32, "verify_entries_per_s": 666.7}
    (line,) = [x for x in summary_lines(build_report(sim)) if x.startswith("canary cost per step")]
    assert line == ("canary cost per step (numpy): batch 6.25 ms, stage 0.00 ms, plan 0.00 ms, verify 37.50 ms, "
                    "write 12.50 ms, sweep 6.25 ms, read 18.75 ms = 81.25 ms (engine 318.75 ms); "
                    "20.3 % of generate_batch wall time")


def _future(query_length, max_new_tokens, generated):
    from types import SimpleNamespace

    return SimpleNamespace(query_length=query_length,
                           state=SimpleNamespace(max_new_tokens=max_new_tokens, generated_tokens=[7] * generated))


# a request still prefilling (4 query tokens) and one decoding with 2 tokens to go (the injector wants 3)
PREFILLING, FINISHING = _future(4, 10, 0), _future(1, 5, 3)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("others", [[PREFILLING], [FINISHING], [PREFILLING, FINISHING]],
                         ids=["prefilling", "finishing", "both"])
def test_the_kv_bitflip_strikes_the_first_request_that_keeps_decoding(seed, others):
    from types import SimpleNamespace

    page_size, row_bytes, layers = 32, 32, 2  # the cache: 2 x layers planes (K, V per layer) of page_size rows
    geo = SimpleNamespace(name="FULL", window=0, page_size=page_size, row_bytes=row_bytes,
                          layer_indices=list(range(layers)))
    cache = SimpleNamespace(cache_tensor=torch.zeros(2 * layers * page_size * row_bytes, dtype=torch.uint8))
    canary = SimpleNamespace(states={id(cache): SimpleNamespace(geos=[geo])})
    requests = [*others, _future(1, 10, 2)]  # the last one decodes with 8 tokens to go
    n = len(requests)
    base = [10 * i for i in range(n)]  # request i's position p lives in slot 10 i + p
    batch = SimpleNamespace(prefix_lens=np.array([0] * (n - 1) + [5]), extend_lens=np.array([4] * (n - 1) + [1]),
                            request_ids=[f"r{i}" for i in range(n)], slot=lambda g, i, pos: base[i] + pos)
    injector = make_injector("kv-bitflip", at=3, seed=seed)
    injector.before_batch(canary, 3, {"cu_seq_lens_q": torch.zeros(n + 1, dtype=torch.int32)}, requests, cache)
    injector.after_forward(canary, 3, batch, cache)
    (byte,) = torch.nonzero(cache.cache_tensor).flatten().tolist()
    assert bin(int(cache.cache_tensor[byte])).count("1") == 1
    slot = byte % (page_size * row_bytes) // row_bytes
    # the decoding request holds positions 0 to 5; the injector strikes one below the newest, which the next step
    # verifies
    assert base[-1] <= slot < base[-1] + 5 and byte % row_bytes < 16
    fault = injector.fault
    assert (fault.kind, fault.step, fault.group, fault.request, fault.slot, fault.position) == (
        "kv-bitflip", 4, "FULL", f"r{n - 1}", slot, slot - base[-1])
