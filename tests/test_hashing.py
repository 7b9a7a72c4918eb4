"""The package's vectorized hash functions against SPEC §2's published vectors."""

from __future__ import annotations

import numpy as np

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
    data = np.zeros((4, 32), np.uint8)
    data[2, :16] = [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF]
    for mode in (RealKvHashMode.PARTIAL, RealKvHashMode.ALL):
        got = hashing.fold_real_kv(np.array([2, 3], np.int64), [(data, 1, 16, 16)], mode)
        assert got.tolist() == [0x6041580849E6407D, 0]  # all-zero bytes fold to 0, then one round of 0
    assert hashing.fold_real_kv(np.array([2]), [(data, 1, 16, 16)], RealKvHashMode.NONE).tolist() == [0]


def test_real_kv_reads_the_paged_layout_and_skips_holes():
    # 2 slots per row, 16 bytes each, then a 16-byte hole that must never be read.
    data = np.zeros((2, 48), np.uint8)
    data[1, 16:32] = 7  # slot 3
    data[1, 32:] = 99  # hole of row 1
    got = hashing.fold_real_kv(np.array([2, 3], np.int64), [(data, 2, 16, 16)], RealKvHashMode.ALL)
    reference = np.zeros((1, 16), np.uint8)
    reference[0, :] = 7
    want = hashing.fold_real_kv(np.array([0]), [(reference, 1, 16, 16)], RealKvHashMode.ALL)
    assert got[0] == 0 and got[1] == want[0]


def test_source_order_matters():
    a = np.arange(64, dtype=np.uint8).reshape(2, 32)
    b = (np.arange(64, dtype=np.uint8) * 3).reshape(2, 32)
    slots = np.array([0, 1], np.int64)
    ab = hashing.fold_real_kv(slots, [(a, 1, 32, 32), (b, 1, 32, 32)], RealKvHashMode.ALL)
    ba = hashing.fold_real_kv(slots, [(b, 1, 32, 32), (a, 1, 32, 32)], RealKvHashMode.ALL)
    assert (ab != ba).all()
