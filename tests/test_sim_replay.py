"""Dumped failing launches replay to the same violation rows, on the host backend (the CUDA kernels on the CPU)
and on the NumPy reference, also from the command line and under AddressSanitizer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcanary_cupy.backends import unavailable_reason
from kvcanary_cupy.cli import main
from kvcanary_cupy.sim import FAULT_KINDS, SimConfig, Simulation, load_case, parse_inject, replay_case

HOST = unavailable_reason("host")
needs_host = pytest.mark.skipif(HOST is not None, reason=f"host backend: {HOST}")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("dumps")
    sim = Simulation(SimConfig(preset="mixed", steps=40, requests=10, seed=6, backend="numpy",
                               inject=parse_inject(["all"]), dump_dir=str(directory)))
    report = sim.run()
    assert report["passed"]
    return dict(sim.recorder.dumped)


def test_the_first_failing_launch_of_every_kind_is_dumped(dumps):
    assert set(dumps) == set(FAULT_KINDS)
    for kind, path in dumps.items():
        case = load_case(path)
        assert case.meta["kind"] == kind and case.meta["op"] in ("verify", "write")
        assert case.arrays["expected_rows"].shape[0] >= 1
        assert "canary_buf" in case.arrays
        if case.meta["role"] != "SWEEP":
            assert "in_req_to_token" in case.arrays  # the plan inputs travel with the launch


@pytest.mark.parametrize("backend", ["numpy", pytest.param("host", marks=needs_host)])
def test_replay_reproduces_the_dumped_violations(dumps, backend):
    for path in dumps.values():
        case = load_case(path)
        outcome = replay_case(case, backend)
        assert outcome.reproduced, (path.name, outcome.rows, case.arrays["expected_rows"].tolist())
        assert sorted(outcome.rows) == sorted(map(tuple, case.arrays["expected_rows"].tolist()))
        # a launch dumped with its plan inputs has its plan recomputed and compared too
        assert (outcome.plan_check is not None) == ("in_req_to_token" in case.arrays), path.name
        if outcome.plan_check is not None:
            assert "identical" in outcome.plan_check, outcome.plan_check


@needs_host
def test_dumps_recorded_on_the_host_backend_replay_exactly(tmp_path):
    sim = Simulation(SimConfig(preset="swa", steps=30, requests=8, seed=2, backend="host",
                               inject={"kv-bitflip": 0.1, "position-shift": 0.1}, dump_dir=str(tmp_path)))
    assert sim.run()["passed"]
    assert set(sim.recorder.dumped) == {"kv-bitflip", "position-shift"}
    for path in sim.recorder.dumped.values():
        assert replay_case(load_case(path), "host").reproduced


def test_replay_notices_a_changed_launch(dumps, tmp_path):
    path = dumps["kv-bitflip"]
    case = load_case(path)
    arrays = dict(case.arrays)
    arrays["expected_rows"] = arrays["expected_rows"][:0]  # pretend the launch had been clean
    arrays["meta"] = np.array(json.dumps(case.meta))
    forged = tmp_path / "forged.npz"
    np.savez(forged, **arrays)
    assert not replay_case(load_case(forged), "numpy").reproduced
    assert main(["replay", str(forged), "--backend", "numpy"]) == 1


def test_the_replay_command_prints_the_violations(dumps, capsys):
    backend = "host" if HOST is None else "numpy"
    assert main(["replay", str(dumps["double-alloc"]), "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert "double-alloc" in out and "reproduced" in out and "violation(s)" in out
    assert "slot" in out and "reasons" in out


def test_the_replay_command_refuses_bad_files(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.npz"), "--backend", "numpy"]) == 2
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    assert main(["replay", str(junk), "--backend", "numpy"]) == 2
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    assert main(["replay", str(tmp_path / "other.npz"), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "not a kvcanary replay file" in err and "Traceback" not in err


@needs_host
def test_replay_under_address_sanitizer(dumps):
    from kvcanary_cupy.hostcuda import sanitizer_preload

    if not os.path.isfile(sanitizer_preload()):
        pytest.skip("the compiler has no AddressSanitizer runtime")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "replay", str(dumps["kv-misdirect"]),
                           "--backend", "host", "--sanitize"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "AddressSanitizer + UBSan" in done.stdout and "reproduced" in done.stdout


def _forge(case, tmp_path, name="forged.npz", *, meta=None, **arrays):
    """A copy of ``case`` with meta keys and arrays replaced (``None`` deletes an entry)."""
    out = {k: v for k, v in case.arrays.items()}
    for key, value in arrays.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    out["meta"] = np.array(json.dumps(meta if meta is not None else case.meta))
    path = tmp_path / name
    np.savez_compressed(path, **out)
    return path


def _meta(case, **changes):
    meta = json.loads(json.dumps(case.meta))
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


@pytest.mark.parametrize(("forgery", "field"), [
    (lambda c: {"meta": _meta(c, ring_capacity=None)}, "meta.ring_capacity is missing"),
    (lambda c: {"meta": _meta(c, ring_capacity="64")}, "meta.ring_capacity must be int"),
    (lambda c: {"meta": _meta(c, ring_capacity=1 << 40)}, "meta.ring_capacity must lie in"),
    (lambda c: {"meta": _meta(c, op="erase")}, "meta.op must be 'verify' or 'write'"),
    (lambda c: {"meta": _meta(c, real_kv_hash_mode=7)}, "meta.real_kv_hash_mode must be one of"),
    (lambda c: {"meta": _meta(c, tag=True)}, "meta.tag must be int"),
    (lambda c: {"meta": _meta(c, plan={**c.meta["plan"], "write_req_capacity": 0})},
     "meta.plan.write_req_capacity must lie in [1, "),
    (lambda c: {"meta": _meta(c, sources=[{"page_size": 1}] * len(c.meta["sources"]) or [{"page_size": 1}])},
     "meta.sources[0]."),
    (lambda c: {"canary_buf": c.arrays["canary_buf"].astype(np.float64)}, "entry 'canary_buf' must be a 2-D uint8"),
    (lambda c: {"canary_buf": c.arrays["canary_buf"][:, :24].copy()}, "entry 'canary_buf' must be [slots"),
    (lambda c: {"expected_rows": c.arrays["expected_rows"][:, :7].copy()}, "entry 'expected_rows' must have shape"),
    (lambda c: {"plan_slots": None}, "entry 'plan_slots' is missing"),
    (lambda c: {"plan_prev_slots": c.arrays["plan_prev_slots"][:-1].copy()}, "entry 'plan_prev_slots' must have"),
    (lambda c: {"plan_num_valid": c.arrays["plan_num_valid"].astype(np.int64)}, "entry 'plan_num_valid' must be"),
], ids=["ring-missing", "ring-str", "ring-too-large", "op", "hash-mode", "tag-bool", "write-capacity-0",
        "sources-fields", "canary-dtype", "canary-narrow", "rows-shape", "plan-slots-missing", "prev-slots-short",
        "num-valid-dtype"])  # plain ids: mutmut selects tests by id, which must hold no spaces
def test_replay_refuses_malformed_dumps_naming_file_and_field(dumps, tmp_path, capsys, forgery, field):
    case = load_case(dumps["kv-bitflip"])  # a TAIL verify: real-KV sources, plan inputs
    assert case.meta["op"] == "verify"
    path = _forge(case, tmp_path, **forgery(case))
    with pytest.raises(ValueError, match=r"forged\.npz: ") as excinfo:
        load_case(path)
    assert field in str(excinfo.value)
    assert main(["replay", str(path), "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "forged.npz" in err and field in err and "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("backend", ["numpy", pytest.param("host", marks=needs_host)])
def test_a_dump_whose_sources_carry_a_kv_byte_layout_replays_the_same_rows(dumps, tmp_path, backend):
    # The recorded rows re-described as strided sources (4-byte elements, pages one row apart) over the
    # tensors' bytes as one run: the fingerprints, hence the violation rows, must not change.
    case = load_case(dumps["kv-bitflip"])
    meta, arrays = _meta(case), {}
    assert meta["sources"]
    for i, source in enumerate(meta["sources"]):
        rows = case.arrays[f"source_{i}"]
        arrays[f"source_{i}"] = np.ascontiguousarray(rows).reshape(1, -1)
        source["layout"] = {"page_stride": int(rows.shape[1]), "token_stride": source["num_bytes_per_token"],
                            "head_stride": 0, "element_stride": 4, "num_heads": 1,
                            "elements_per_head": source["num_bytes_per_token"] // 4, "element_bytes": 4}
    strided = load_case(_forge(case, tmp_path, meta=meta, **arrays))
    outcome = replay_case(strided, backend)
    assert outcome.reproduced
    assert sorted(outcome.rows) == sorted(map(tuple, case.arrays["expected_rows"].tolist()))
    meta["sources"][0]["layout"].pop("element_bytes")
    with pytest.raises(ValueError, match=r"meta\.sources\[0\]\.layout must have exactly the keys"):
        load_case(_forge(case, tmp_path, "bad.npz", meta=meta, **arrays))


@pytest.mark.parametrize("backend", ["numpy", pytest.param("host", marks=needs_host)])
def test_a_dump_whose_layouts_split_tokens_and_elements_replays_the_same_rows(dumps, tmp_path, backend):
    # The recorded rows as strided sources whose token offsets are split into tiles of 2 and element indices
    # into pairs, each digit strided so that the address is unchanged: same fingerprints, same rows.
    case = load_case(dumps["kv-bitflip"])
    meta, arrays = _meta(case), {}
    for i, source in enumerate(meta["sources"]):
        rows = case.arrays[f"source_{i}"]
        arrays[f"source_{i}"] = np.ascontiguousarray(rows).reshape(1, -1)
        per_token = source["num_bytes_per_token"]
        source["layout"] = {"page_stride": int(rows.shape[1]), "token_stride": per_token, "head_stride": 0,
                            "element_stride": 4, "num_heads": 1, "elements_per_head": per_token // 4,
                            "element_bytes": 4, "tokens_per_tile": 2, "tile_stride": 2 * per_token,
                            "elements_per_group": 2, "group_stride": 8}
    outcome = replay_case(load_case(_forge(case, tmp_path, meta=meta, **arrays)), backend)
    assert outcome.reproduced
    assert sorted(outcome.rows) == sorted(map(tuple, case.arrays["expected_rows"].tolist()))
    meta["sources"][0]["layout"]["tiles"] = 2
    with pytest.raises(ValueError, match=r"meta\.sources\[0\]\.layout must have exactly the keys"):
        load_case(_forge(case, tmp_path, "bad.npz", meta=meta, **arrays))


LAYOUT_FIELDS = ["page_stride", "token_stride", "head_stride", "element_stride", "num_heads", "elements_per_head",
                 "element_bytes", "tokens_per_tile", "tile_stride", "elements_per_group", "group_stride"]


@pytest.mark.parametrize("field", LAYOUT_FIELDS)
def test_replay_refuses_a_layout_field_outside_zero_to_two_to_the_48_by_its_name(dumps, tmp_path, field):
    case = load_case(dumps["kv-bitflip"])
    meta = _meta(case)
    per_token = meta["sources"][0]["num_bytes_per_token"]
    meta["sources"][0]["layout"] = {"page_stride": 4096, "token_stride": per_token, "head_stride": 0,
                                    "element_stride": 4, "num_heads": 1, "elements_per_head": per_token // 4,
                                    "element_bytes": 4, "tokens_per_tile": 1, "tile_stride": 0,
                                    "elements_per_group": 1, "group_stride": 0}
    for value, shown in ((-1, "-1"), ((1 << 48) + 1, "281474976710657")):
        meta["sources"][0]["layout"][field] = value
        with pytest.raises(ValueError, match=re.escape(
                f"forged.npz: meta.sources[0].layout.{field} must lie in [0, 281474976710656], got {shown}")):
            load_case(_forge(case, tmp_path, meta=meta))


def test_replay_refuses_a_malformed_write_dump(dumps, tmp_path):
    writes = [case for case in map(load_case, dumps.values()) if case.meta["op"] == "write"]
    assert writes, "no fault kind's first detection was a write: the run dumped no write launch to forge"
    case = writes[0]
    path = _forge(case, tmp_path, positions=case.arrays["positions"][:-1].copy())
    with pytest.raises(ValueError, match=r"forged\.npz: entry 'positions' must have shape"):
        load_case(path)


def test_replay_refuses_meta_that_is_not_json(dumps, tmp_path):
    case = load_case(dumps["kv-bitflip"])
    arrays = dict(case.arrays, meta=np.array("{not json"))
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=r"bad\.npz: entry 'meta' is not JSON"):
        load_case(tmp_path / "bad.npz")
    np.savez(tmp_path / "list.npz", **dict(case.arrays, meta=np.array("[1, 2]")))
    with pytest.raises(ValueError, match=r"list\.npz: entry 'meta' must be a JSON object"):
        load_case(tmp_path / "list.npz")


def test_replay_refuses_a_member_that_unpacks_too_large(dumps, tmp_path, monkeypatch):
    import kvcanary_cupy.sim.replay as replay

    case = load_case(dumps["kv-bitflip"])
    path = _forge(case, tmp_path, padding=np.zeros(1 << 20, np.uint8))  # compresses to about a kilobyte
    monkeypatch.setattr(replay, "MAX_MEMBER_BYTES", 1 << 19)
    with pytest.raises(ValueError, match=r"forged\.npz: .*entry 'padding' unpacks to \d+ bytes"):
        load_case(path)


def _verify_dumps_with_plan_inputs(dumps):
    cases = [(kind, load_case(path)) for kind, path in sorted(dumps.items())]
    cases = [(kind, c) for kind, c in cases if c.meta["op"] == "verify" and "in_req_to_token" in c.arrays]
    assert len(cases) >= 4  # HEAD and TAIL launches of several kinds
    return cases


def test_the_plan_check_notices_a_recorded_write_plan_whose_seeds_or_offsets_alone_differ(dumps, tmp_path):
    differs = "plan: recomputed on numpy, DIFFERS from the recorded plan in write offsets/seeds"
    for kind, case in _verify_dumps_with_plan_inputs(dumps):
        seeds, offsets = case.arrays["write_seeds"].copy(), case.arrays["write_offsets"].copy()
        seeds[0] += 1
        offsets[1] += 1
        for name, forged in (("seeds", {"write_seeds": seeds}), ("offsets", {"write_offsets": offsets})):
            outcome = replay_case(load_case(_forge(case, tmp_path, f"{kind}-{name}.npz", **forged)), "numpy")
            assert outcome.reproduced and outcome.plan_check == differs, (kind, name, outcome.plan_check)


def test_a_verify_dump_needs_no_write_plan_but_write_offsets_need_their_seeds(dumps, tmp_path):
    for kind, case in _verify_dumps_with_plan_inputs(dumps):
        bare = load_case(_forge(case, tmp_path, f"{kind}-bare.npz", write_offsets=None, write_seeds=None))
        outcome = replay_case(bare, "numpy")
        n, rows = int(case.arrays["plan_num_valid"][0]), case.arrays["in_req_pool_indices"].shape[0]
        assert outcome.reproduced and outcome.plan_check == (
            f"plan: recomputed on numpy ({n} verify entries, {rows} batch rows), identical to the recorded plan")
        with pytest.raises(ValueError, match=rf"{kind}-half\.npz: entry 'write_seeds' is missing"):
            load_case(_forge(case, tmp_path, f"{kind}-half.npz", write_seeds=None))
