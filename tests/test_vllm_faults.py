"""Fault injectors of the vLLM integration that need no engine: what they write stays a value vLLM can run (a
fault must corrupt what the canary checks, never crash the model before it)."""

from __future__ import annotations

import types

import numpy as np

from kvcanary_cupy.integrations.vllm.faults import _Row, _slot_mappings, injector


def _canary(vocab: int) -> types.SimpleNamespace:
    config = types.SimpleNamespace(get_vocab_size=lambda: vocab)
    return types.SimpleNamespace(runner=types.SimpleNamespace(model_config=config))


def test_wrong_token_replaces_an_id_with_another_id_inside_the_vocabulary_on_every_seed():
    vocab = 512
    for seed in range(200):
        for old in (0, 3, vocab - 100, vocab - 2, vocab - 1):
            ids = np.array([7, old], np.int64)
            fault = injector("wrong-token", seed=seed)
            fault.fire(_canary(vocab), 4, {"input_ids": ids, "positions": np.array([0, 9])}, {},
                       [_Row("r", 0, 2, 8)], None)
            assert ids[0] == 7 and 0 <= ids[1] < vocab and ids[1] != old, (seed, old, ids)
            assert fault.fault is not None and fault.fault.detail == f"token {old} -> {int(ids[1])}"


def test_slot_mappings_skip_the_metadata_of_layers_without_one():
    attention = types.SimpleNamespace(slot_mapping=np.arange(3))
    gdn = types.SimpleNamespace(num_prefills=1)  # a Mamba/GDN layer's metadata: per-request state, no slots
    assert _slot_mappings({"attn": attention, "gdn": gdn}) == [attention.slot_mapping]
