"""The canary KV connector's records file (kvcanary_cupy/integrations/vllm/connector.py) without vLLM: what is
written reads back field by field, and each way a file can be unusable is refused with its own reason, over many
seeds (never a silent pass)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary_cupy.integrations.vllm.connector import (
    LoadReason,
    SavedRecords,
    read_records,
    write_records,
)

SEEDS = range(12)


def saved(tmp_path, seed: int):
    """A records file of a random prompt (tokens, records of 1 to 3 canary buffers, 0 to 2 KV files), and what
    went into it."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    count = int(rng.integers(0, n + 1))
    written = int(rng.integers(0, count + 1))
    tokens = rng.integers(0, 50_000, n).tolist()
    records = {(f"G{g}", b): rng.integers(-(1 << 62), 1 << 62, (count, 4), dtype=np.int64)
               for g in range(int(rng.integers(1, 3))) for b in range(int(rng.integers(1, 3)))}
    kv = []
    for i in range(int(rng.integers(0, 3))):
        f = tmp_path / f"layer{i}.safetensors"
        f.write_bytes(rng.bytes(int(rng.integers(1, 4096))))
        kv.append(f)
    path = tmp_path / "records.npz"
    size = write_records(path, model="G0", profile=f"p{seed}", tokens=tokens, written=written, records=records,
                         kv_files=kv)
    assert size == path.stat().st_size
    return path, tokens, written, records, kv


@pytest.mark.parametrize("seed", SEEDS)
def test_a_records_file_reads_back_what_was_written(tmp_path, seed):
    path, tokens, written, records, kv = saved(tmp_path, seed)
    got = read_records(path)
    assert isinstance(got, SavedRecords)
    assert got.model == "G0" and got.profile == f"p{seed}"
    assert got.tokens.tolist() == tokens and got.written == written
    assert sorted(got.records) == sorted(records)
    for key, arr in records.items():
        assert np.array_equal(got.records[key], arr)
    assert got.kv_names == [f.name for f in kv]
    assert got.kv_stats.tolist() == [[f.stat().st_size, f.stat().st_mtime_ns] for f in kv]
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed over the target


@pytest.mark.parametrize("seed", SEEDS)
def test_a_truncated_records_file_is_refused_as_damaged(tmp_path, seed):
    path, *_ = saved(tmp_path, seed)
    raw = path.read_bytes()
    cut = int(np.random.default_rng(seed).integers(0, len(raw)))
    path.write_bytes(raw[:cut])
    got = read_records(path)
    assert isinstance(got, tuple) and got[0] is LoadReason.LOAD_RECORDS_DAMAGED


@pytest.mark.parametrize("seed", SEEDS)
def test_one_flipped_bit_anywhere_in_the_records_file_is_refused_as_damaged(tmp_path, seed):
    path, tokens, written, records, _ = saved(tmp_path, seed)
    raw = bytearray(path.read_bytes())
    rng = np.random.default_rng(seed)
    at = int(rng.integers(0, len(raw)))
    raw[at] ^= 1 << int(rng.integers(0, 8))
    path.write_bytes(bytes(raw))
    got = read_records(path)
    if isinstance(got, tuple):
        assert got[0] is LoadReason.LOAD_RECORDS_DAMAGED
    else:  # a flip in a zip field no reader uses (a timestamp): the content is whole and reads as written
        assert got.tokens.tolist() == tokens and got.written == written
        assert all(np.array_equal(got.records[k], a) for k, a in records.items())


def test_a_missing_records_file_is_refused_as_missing(tmp_path):
    got = read_records(tmp_path / "nothing.npz")
    assert isinstance(got, tuple) and got[0] is LoadReason.LOAD_RECORDS_MISSING


def test_a_file_that_is_not_a_records_file_is_refused_as_damaged(tmp_path):
    path = tmp_path / "records.npz"
    np.savez(path, tokens=np.arange(4))
    got = read_records(path)
    assert isinstance(got, tuple) and got[0] is LoadReason.LOAD_RECORDS_DAMAGED


def test_more_written_positions_than_saved_records_are_refused_as_damaged(tmp_path):
    path = tmp_path / "records.npz"
    write_records(path, model="G0", profile="p", tokens=[1, 2, 3], written=3,
                  records={("G0", 0): np.zeros((2, 4), np.int64)}, kv_files=[])
    got = read_records(path)
    assert isinstance(got, tuple) and got[0] is LoadReason.LOAD_RECORDS_DAMAGED
