"""The package's vectorized hash functions against SPEC §2's published vectors and the scalar oracle."""

from __future__ import annotations

import numpy as np
import oracle as o

from kvcanary_cupy import hashing
from kvcanary_cupy.constants import CANARY_CHAIN_ANCHOR, CANARY_CHAIN_ANCHOR_HASH, RealKvHashMode


def u64(values) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def test_splitmix64_of_the_anchor():
    assert int(hashing.splitmix64(u64([CANARY_CHAIN_ANCHOR]))[0]) == 0xDE7FAE23A9A1B716 == CANARY_CHAIN_ANCHOR_HASH
    assert hashing.ANCHOR_HASH_I64 == -2414019407054260458


def test_zero_is_a_fixed_point():
    assert int(hashing.splitmix64(u64([0]))[0]) == 0
    assert int(hashing.mix3(u64([0]), u64([0]), u64([0]))[0]) == 0


def test_splitmix64_does_not_modify_its_input():
    x = u64([1, 2, 3])
    hashing.splitmix64(x)
    assert x.tolist() == [1, 2, 3]


def test_published_five_step_chain():
    expected = [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1,
                0xC749AFFE5A5A9634]
    running = u64([expected[0]])
    chain = [int(running[0])]
    for token, position in zip([101, 202, 303, 404], range(4), strict=True):
        running = hashing.mix3(running, u64([token]), u64([position]))
        chain.append(int(running[0]))
    assert chain == expected


def test_chain_hash_of_slots_and_heads():
    fields = np.zeros((3, 4), np.int64)
    fields[1] = [101, 0, np.uint64(0xDE7FAE23A9A1B716).view(np.int64), 0]
    got = hashing.chain_hash(fields, np.array([1, -1, 2], np.int64))
    assert got.tolist() == [0x542FE5061275A6AB, 0xDE7FAE23A9A1B716, 0]  # slot 2 is all zeros: hashes to 0


def test_published_real_kv_vector_in_partial_and_all_modes():
    """32 bytes per token: PARTIAL folds the first 16 (the published vector), ALL all 32 (the oracle's value,
    which the published vector is not: the second 16 bytes are not zero)."""
    data = np.zeros((4, 32), np.uint8)
    data[2, :16] = [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF]
    data[2, 16:] = np.arange(16, dtype=np.uint8) * 17 + 3
    source = (data, 1, 32, 32)
    slots = np.array([2, 3], np.int64)
    partial = hashing.fold_real_kv(slots, [source], RealKvHashMode.PARTIAL).tolist()
    assert partial == [0x6041580849E6407D, 0]  # all-zero bytes fold to 0, then one round of 0
    full = hashing.fold_real_kv(slots, [source], RealKvHashMode.ALL).tolist()
    assert full == [o.real_kv_hash(2, [source], o.MODE_ALL), 0]
    assert full[0] != partial[0]
    assert hashing.fold_real_kv(np.array([2]), [source], RealKvHashMode.NONE).tolist() == [0]


def test_real_kv_reads_the_paged_layout_and_skips_holes():
    """Rows of 2 slots of 16 bytes then a 16-byte hole: every slot hashes its own bytes (the oracle's value,
    distinct per slot), and the hole's bytes never matter."""
    data = np.zeros((2, 48), np.uint8)
    for s in range(4):
        row, col = divmod(s, 2)
        data[row, col * 16 : col * 16 + 16] = np.arange(16, dtype=np.uint8) + 40 * s + 1
    slots = np.arange(4, dtype=np.int64)
    got = hashing.fold_real_kv(slots, [(data, 2, 16, 16)], RealKvHashMode.ALL).tolist()
    assert got == [o.real_kv_hash(s, [(data, 2, 16, 16)], o.MODE_ALL) for s in range(4)]
    assert len(set(got)) == 4
    data[:, 32:] = 99  # the holes
    assert hashing.fold_real_kv(slots, [(data, 2, 16, 16)], RealKvHashMode.ALL).tolist() == got


def test_source_order_matters():
    a = np.arange(64, dtype=np.uint8).reshape(2, 32)
    b = (np.arange(64, dtype=np.uint8) * 3).reshape(2, 32)
    slots = np.array([0, 1], np.int64)
    ab = hashing.fold_real_kv(slots, [(a, 1, 32, 32), (b, 1, 32, 32)], RealKvHashMode.ALL).tolist()
    ba = hashing.fold_real_kv(slots, [(b, 1, 32, 32), (a, 1, 32, 32)], RealKvHashMode.ALL).tolist()
    assert ab == [o.real_kv_hash(s, [(a, 1, 32, 32), (b, 1, 32, 32)], o.MODE_ALL) for s in (0, 1)]
    assert ba == [o.real_kv_hash(s, [(b, 1, 32, 32), (a, 1, 32, 32)], o.MODE_ALL) for s in (0, 1)]
    assert ab[0] != ba[0] and ab[1] != ba[1]
