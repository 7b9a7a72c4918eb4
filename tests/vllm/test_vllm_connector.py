"""The canary KV connector around vLLM's ExampleConnector: every connector hook delegated, the records saved
with the KV and restored with it in a new process (token-exact, no row), the chunked-prefill partial save
reported as a true finding at the load's step (and recomputed when the operator hands refused loads back), and
each fault of this path's bug history, injected into the connector's real files and metadata, refused with its
reason before a forward reads the loaded KV.

Each engine runs in a process of its own (tests/vllm/connector_run.py): vLLM keeps one KV transfer group per
process, and a load must come from a process that did not save."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcanary_cupy.integrations.vllm.connector import (
    RECORDS_FILE,
    CanaryConnector,
    CanaryConnectorMetadata,
    LoadReason,
)
from kvcanary_cupy.integrations.vllm.simulate_connector import inject_store_fault

HERE = Path(__file__).resolve().parent
BLOCK = 32
ALL_BYTES = {"KVCANARY_VLLM_REAL_KV_HASH": "all"}  # every byte of a token's K and V fingerprinted


def undelegated(base: type, wrapper: type) -> list[str]:
    """The public members of ``base`` (methods, properties, class methods) and the connector-facing
    ``_get_connector_metadata`` that ``wrapper`` does not define itself."""
    names = [n for n in vars(base) if not n.startswith("__") and (not n.startswith("_")
                                                                  or n == "_get_connector_metadata")]
    members = [n for n in names if callable(getattr(base, n, None)) or isinstance(vars(base)[n], property)]
    return sorted(n for n in members if n not in vars(wrapper))


def test_the_wrapper_defines_every_hook_of_vllms_connector_base_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert undelegated(KVConnectorBase_V1, CanaryConnector) == []


def test_the_delegation_check_fails_when_the_base_class_gains_or_renames_a_hook():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    gained = type("Gained", (KVConnectorBase_V1,), {"start_prefetch_kv": lambda self: None})
    assert undelegated(gained, CanaryConnector) == ["start_prefetch_kv"]
    renamed = dict(vars(KVConnectorBase_V1))
    renamed["wait_for_layer_loaded"] = renamed.pop("wait_for_layer_load")
    assert undelegated(type("Renamed", (), renamed), CanaryConnector) == ["wait_for_layer_loaded"]


class Recorder:
    """A wrapped connector that records each call it gets and answers with a marker."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return {"get_block_ids_with_load_errors": set(), "has_connector_metadata": True}.get(name, f"<{name}>")

        if name in ("supports_divergent_local_hybrid_hits", "requires_kv_delivery", "role"):
            self.calls.append(name)
            return f"<{name}>"
        return call


def test_every_instance_hook_reaches_the_wrapped_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    wrapper = CanaryConnector.__new__(CanaryConnector)
    inner = Recorder()
    wrapper.inner, wrapper.store, wrapper.canary, wrapper.on_refused = inner, None, None, "report"
    wrapper._loads, wrapper._pending, wrapper._refused_blocks, wrapper._connector_metadata = {}, [], set(), None
    wrapper.seconds = {"save": 0.0, "load": 0.0, "inner_save": 0.0, "inner_load": 0.0}
    for name, member in vars(KVConnectorBase_V1).items():
        if name.startswith("__") or isinstance(member, classmethod) or name == "__init__":
            continue
        if isinstance(member, property):
            getattr(wrapper, name)
        elif callable(member):
            params = [p for p in list(inspect.signature(member).parameters)[1:] if p not in ("args", "kwargs")]
            getattr(wrapper, name)(*[0 if p.startswith("num_") else None for p in params])
        else:
            continue
        assert inner.calls and inner.calls[-1] == name, name
    # the wrapper's own metadata reaches the wrapped connector unwrapped
    meta = CanaryConnectorMetadata(inner="<inner metadata>")
    wrapper.bind_connector_metadata(meta)
    assert wrapper._connector_metadata is meta and inner.calls[-1] == "bind_connector_metadata"


# ---- real engines, one process each ---------------------------------------------------------------------------

def run_engine(spec: dict, timeout: int = 420) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_VLLM")}
    env["PYTHONPATH"] = str(HERE.parents[1])  # this checkout's package
    proc = subprocess.run([sys.executable, str(HERE / "connector_run.py"), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, n).tolist() for n in lengths]


def folder_of(store: Path, prompt: list[int]) -> Path:
    """ExampleConnector's folder of a prompt (its own key function: the independent oracle of where it saved)."""
    from vllm.utils.hashing import safe_hash

    n = (len(prompt) - 1) // BLOCK * BLOCK
    return store / safe_hash(np.asarray(prompt[:n], np.int64).tobytes(), usedforsecurity=False).hexdigest()


def by_prompt(result: dict) -> list[list[dict]]:
    """The connector's findings of each prompt, in prompt order (vLLM suffixes the request ids it is given)."""
    out: list[list[dict]] = [[] for _ in result["request_ids"]]
    for f in result["findings"]:
        (i,) = [i for i, rid in enumerate(result["request_ids"])
                if f["request_id"] == rid or f["request_id"].startswith(f"{rid}-")]
        out[i].append(f)
    return out


@pytest.fixture(scope="module")
def clean_store(tiny_model, tmp_path_factory):
    """A store saved by one process (no chunking: whole prompts in a step) and the prompts and completions."""
    store = tmp_path_factory.mktemp("kvstore") / "store"
    # lengths: a partial last block, 2 equal lengths (one sequence's files under another's key); none 1 more than
    # a multiple of the block size (ExampleConnector looks a prompt up by its first len - 1 tokens)
    ps = prompts(11, [40, 70, 99, 80, 80, 66, 50, 120, 45, 60, 100])
    saved = run_engine({"model": str(tiny_model), "store": str(store), "prompts": ps, "max_tokens": 5,
                        "engine": {"max_num_batched_tokens": 512}, "env": ALL_BYTES})
    assert saved["violations"] == [] and saved["findings"] == [] and saved["internal_errors"] == 0
    assert saved["saved_files"] == len(ps)
    return store, ps, saved


def test_records_are_saved_next_to_the_kv_and_hold_each_prompts_tokens_and_positions(clean_store):
    store, ps, _ = clean_store
    for p in ps:
        folder = folder_of(store, p)
        n = (len(p) - 1) // BLOCK * BLOCK
        assert sorted(x.name for x in folder.iterdir()) == [
            RECORDS_FILE, "model.layers.0.self_attn.attn.safetensors", "model.layers.1.self_attn.attn.safetensors"]
        with np.load(folder / RECORDS_FILE) as z:
            assert z["tokens"].tolist() == p[:n] and int(z["written"][0]) == n
            buffers = [z[k] for k in z.files if k.startswith("records_")]
        assert len(buffers) == 4  # HEAD and TAIL, K and V
        for rec in buffers:
            assert rec.shape == (n, 4)
            assert rec[:, 0].tolist() == p[:n] and rec[:, 1].tolist() == list(range(n))
            assert np.unique(rec[:, 2]).shape[0] == n  # a chain hash per position


def test_a_new_process_loads_the_kv_with_its_records_token_exact_and_without_a_row(clean_store, tiny_model):
    store, ps, saved = clean_store
    # saved through the plugin's setting, loaded through the other route: kv_connector_module_path and install()
    loaded = run_engine({"model": str(tiny_model), "store": str(store), "prompts": ps, "max_tokens": 5,
                         "engine": {"max_num_batched_tokens": 512}, "env": ALL_BYTES, "route": "install"})
    assert loaded["connector"] == "CanaryConnector" and loaded["unchecked"] is None
    assert loaded["outputs"] == saved["outputs"]
    assert loaded["violations"] == [] and loaded["findings"] == [] and loaded["internal_errors"] == 0
    assert loaded["restored_tokens"] == sum((len(p) - 1) // BLOCK * BLOCK for p in ps)  # every load restored


def test_a_prefill_instance_hands_its_kv_and_records_to_a_decode_instance(clean_store, tiny_model, tmp_path):
    _, ps, saved = clean_store
    store = tmp_path / "handoff"
    common = {"model": str(tiny_model), "store": str(store), "prompts": ps,
              "engine": {"max_num_batched_tokens": 512}, "env": ALL_BYTES}
    producer = run_engine({**common, "role": "kv_producer", "max_tokens": 1})
    assert producer["saved_files"] == len(ps) and producer["violations"] == [] and producer["findings"] == []
    consumer = run_engine({**common, "role": "kv_consumer", "max_tokens": 5})
    assert consumer["outputs"] == saved["outputs"]  # decoded from the producer's KV, token-exact
    assert consumer["restored_tokens"] == sum((len(p) - 1) // BLOCK * BLOCK for p in ps)
    assert consumer["violations"] == [] and consumer["findings"] == [] and consumer["internal_errors"] == 0


def test_each_fault_of_the_connector_path_is_refused_with_its_reason_before_a_forward_reads_it(
        clean_store, tiny_model, tmp_path):
    src, ps, saved = clean_store
    store = tmp_path / "store"
    shutil.copytree(src, store)
    folders = [folder_of(store, p) for p in ps]
    faults = {1: "kv-layout", 2: "kv-swap", 3: "foreign-files", 5: "records-truncated", 6: "kv-bitrot",
              7: "records-bitrot", 8: "stale-kv", 9: "records-missing"}
    for i, kind in faults.items():  # prompt 4's KV and records under 3's key: the prompts of equal length
        inject_store_fault(kind, folders[i], block_size=BLOCK, donor=folders[4])
    # 10: the connector's metadata sends the load one block over (a load into the wrong block ids)
    result = run_engine({"model": str(tiny_model), "store": str(store), "prompts": ps, "max_tokens": 5,
                         "engine": {"max_num_batched_tokens": 512}, "wrong_blocks": [10],
                         "env": ALL_BYTES})
    assert result["internal_errors"] == 0
    want = {1: LoadReason.LOAD_VERIFY_FAILED, 2: LoadReason.LOAD_VERIFY_FAILED, 3: LoadReason.LOAD_RECORDS_FOREIGN,
            5: LoadReason.LOAD_RECORDS_DAMAGED, 6: LoadReason.LOAD_VERIFY_FAILED, 7: LoadReason.LOAD_RECORDS_DAMAGED,
            8: LoadReason.LOAD_RECORDS_STALE, 9: LoadReason.LOAD_RECORDS_MISSING, 10: LoadReason.LOAD_VERIFY_FAILED}
    found = by_prompt(result)
    for i in range(len(ps)):
        reasons = sorted({f["reason"] for f in found[i]})
        assert reasons == ([want[i].name] if i in want else []), (i, found[i])
    for i in want:
        for f in found[i]:
            blocks = set(f["blocks"])
            assert blocks and max(blocks) < 24, f
            # found at the load's step, before that step's forward began
            assert result["findings_before_forward"][f["step"]] >= result["findings"].index(f) + 1, f
    # the clean prompts among them (0 and 4) load token-exact; the damaged ones are not all token-exact
    assert result["outputs"][0] == saved["outputs"][0] and result["outputs"][4] == saved["outputs"][4]
    assert any(result["outputs"][i] != saved["outputs"][i] for i in want)


@pytest.fixture(scope="module")
def chunked_store(tiny_model, tmp_path_factory):
    """A 150-token prompt prefilled in chunks next to a 5-token one (128-token steps): ExampleConnector saves
    its 4 blocks at the first step, when positions 123-127 are not written yet (a real bug of the connector)."""
    store = tmp_path_factory.mktemp("kvstore-chunked") / "store"
    ps = prompts(2, [5, 150])
    saved = run_engine({"model": str(tiny_model), "store": str(store), "prompts": ps, "max_tokens": 4,
                        "batch": True, "engine": {"max_num_batched_tokens": 128}})
    assert saved["violations"] == [] and saved["findings"] == []
    return store, ps, saved


@pytest.mark.parametrize("on_refused", ["report", "load-error"])
def test_blocks_saved_before_they_were_written_are_reported_at_the_load_and_recomputed_on_request(
        chunked_store, tiny_model, tmp_path, on_refused):
    src, ps, saved = chunked_store
    store = tmp_path / "store"
    shutil.copytree(src, store)
    result = run_engine({"model": str(tiny_model), "store": str(store), "prompts": ps, "max_tokens": 4,
                         "batch": True, "engine": {"max_num_batched_tokens": 512}, "policy": "recompute",
                         "env": {"KVCANARY_VLLM_CONNECTOR_ON_REFUSED": on_refused}})
    (finding,) = result["findings"]
    assert finding["reason"] == LoadReason.LOAD_SAVED_BEFORE_WRITTEN.name
    assert finding["positions"] == [123, 128] and len(finding["blocks"]) == 1  # the 4th block of the prompt
    assert finding["step"] == 0 and result["findings_before_forward"][0] == 1  # before the load's forward
    # the unwritten positions' slots hold no record: the load step's HEAD verify reports them too (and the
    # write of position 128, which chains from them, its own row)
    rows = [v for v in result["violations"] if v["step"] == 0 and any(r.startswith("verify") for r in v["reasons"])]
    assert rows and {v["slot"] // BLOCK for v in rows} == set(finding["blocks"])
    if on_refused == "report":  # the bug itself: the load run's tokens differ from the run that computed them
        assert result["outputs"][1] != saved["outputs"][1]
    else:  # handed back to vLLM as a load error: recomputed, token-exact, and no row after the load's step
        assert result["outputs"] == saved["outputs"]
        assert all(v["step"] == 0 for v in result["violations"])


@pytest.mark.parametrize("wrap", ["", "OffloadingConnector"])
def test_a_connector_the_canary_does_not_wrap_leaves_the_engine_unchecked_saying_what_to_set(tiny_model, tmp_path,
                                                                                              wrap):
    ps = prompts(3, [40])
    result = run_engine({"model": str(tiny_model), "store": str(tmp_path / "store"), "prompts": ps, "max_tokens": 2,
                         "wrap": wrap, "engine": {"max_num_batched_tokens": 512}})
    assert result["connector"] is None and result["violations"] == [] and result["steps"] == 0
    assert "KVCANARY_VLLM_CONNECTOR=<kv_connector>" in result["unchecked"]
    assert ("names another connector" in result["unchecked"]) == bool(wrap)
    assert not (folder_of(tmp_path / "store", ps[0]) / RECORDS_FILE).exists()  # the KV saved, no records
    assert (folder_of(tmp_path / "store", ps[0]) / "model.layers.0.self_attn.attn.safetensors").exists()
