"""KV hierarchy benchmarks: what carrying canary records down a tier costs per KV byte moved, and what the restore
verify costs per restored token.

* **offload** (group ``tier offload tokens=N``): :func:`kvcanary_cupy.offload_canary_records` of N tokens in
  16-token pages scattered over a pool twice as large (subject), against the **floor**: the engine's own copy
  of the same pages' KV to host memory for a typical model (32 layers × 8 KV heads × 128 dims × bf16, K and V:
  131,072 B per token), one ``np.take`` of whole pages. The ratio subject / floor is the time the records add
  per KV byte moved (their bytes add 32 B per canary buffer per token: 0.024 %, see bench_transfer.py).
* **restore** (group ``tier restore tokens=N``): :meth:`kvcanary_cupy.PrefixRestorer.restore` of N restored
  tokens (scatter the records into 16-token pages, plan, verify chain, position, expected token and the real-KV
  fingerprint re-hashed from one layer's restored K: 2,048 B per token), against the **floor**: copying that
  layer's restored K back into its pages. ``ns_per_entry`` of the subject is the cost per restored token.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.backends import unavailable_reason

PAGE = 16
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x bf16 x (K, V)
LAYER_K_BYTES = 8 * 128 * 2  # the K of one layer for one token: what the restore verify re-hashes
OFFLOAD_TOKENS = (256, 1024)  # the floor copies 32 MiB and 128 MiB of KV
RESTORE_TOKENS = (512, 4096)
HOST_REASON = unavailable_reason("host")


def _pages(n: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """n tokens' worth of page ids spread over a pool of twice as many pages (+1 for the padding page)."""
    num_pages = 2 * (n // PAGE) + 1
    return (rng.permutation(num_pages - 1)[: n // PAGE] + 1).astype(np.int64), num_pages


@pytest.mark.parametrize("n", OFFLOAD_TOKENS)
@pytest.mark.parametrize("impl", ["records", "floor"])
def test_tier_offload(measure, n, impl):
    rng = np.random.default_rng(n)
    pages, num_pages = _pages(n, rng)
    if impl == "records":
        canary = rng.integers(0, 256, size=(num_pages * PAGE, 32), dtype=np.uint8)
        out = np.empty((n, 4), np.int64)

        def fn():
            kc.offload_canary_records(canary_buf=canary, pages=pages, page_size=PAGE, records_out=out,
                                      backend="numpy")
        label, role = "offload_canary_records (NumPy reference)", "subject"
    else:
        kv = np.zeros((num_pages, PAGE * KV_BYTES_PER_TOKEN), np.uint8)  # the device pool, one row per page
        host = np.empty((n // PAGE, PAGE * KV_BYTES_PER_TOKEN), np.uint8)

        def fn():
            np.take(kv, pages, axis=0, out=host)
        label, role = "floor: the engine's copy of the pages' KV (typical model)", "floor"
    measure(fn, group=f"tier offload tokens={n}", label=label, role=role, entries=n, key=f"tier-offload-{n}-{impl}",
            kv_bytes=n * KV_BYTES_PER_TOKEN, record_bytes=n * 32, rounds=5)


class _Restore:
    """A device with one TAIL buffer over one layer's K, a token table and records to restore."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(n)
        self.pages, num_pages = _pages(n, rng)
        slots = (self.pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
        self.kv = rng.integers(0, 256, size=(num_pages, PAGE * LAYER_K_BYTES), dtype=np.uint8)
        source = kc.RealKvSource(self.kv, page_size=PAGE, num_bytes_per_token=LAYER_K_BYTES, read_bytes=LAYER_K_BYTES)
        self.ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_pages * PAGE, ring_capacity=64,
                                                    real_kv_sources=(source,),
                                                    real_kv_hash_mode=kc.RealKvHashMode.ALL)
        tokens = rng.integers(1, 32000, size=n).astype(np.int64)
        wp = kc.WritePlan.allocate(write_req_capacity=1)
        wp.write_offsets[:2] = [0, n]
        wp.write_seed_slot_indices[0] = -1
        wp.write_num_valid_reqs[0] = 1
        kc.launch_canary_write_kernel(context=self.ctx, plan=wp, input_ids=tokens,
                                      positions=np.arange(n, dtype=np.int64), out_cache_loc=slots,
                                      enable_write_input_assert=False, backend="numpy")
        self.records = np.empty((n, 4), np.int64)
        kc.offload_canary_records(canary_buf=self.ctx.canary_buf, pages=self.pages, page_size=PAGE,
                                  records_out=self.records, backend="numpy")
        self.table = np.zeros((2, n // PAGE), np.int32)
        self.table[1] = self.pages
        self.pool = np.zeros((2, n), np.int32)
        self.pool[1] = tokens
        self.lens = np.array([n], np.int64)
        self.restorer = kc.PrefixRestorer(verify_capacity=n, max_requests=1)
        self.host_k = self.kv[self.pages].copy()
        self.n = n

    def restore(self, backend: str = "numpy") -> None:
        self.restorer.restore(context=self.ctx, records=self.records, pages=self.pages, page_size=PAGE,
                              restored_lens=self.lens, req_pool_indices=np.array([1], np.int64),
                              layout=kc.BlockTable(self.table, PAGE), req_to_verify_expected_tokens=self.pool,
                              req_to_verify_expected_tokens_valid_lens=self.lens, backend=backend)

    def copy_back(self) -> None:
        self.kv[self.pages] = self.host_k


@pytest.mark.parametrize("n", RESTORE_TOKENS)
@pytest.mark.parametrize("impl", ["restore", "restore-host", "floor"])
def test_tier_restore(measure, n, impl):
    if impl == "restore-host" and HOST_REASON is not None:
        pytest.skip(f"host backend: {HOST_REASON}")
    r = _Restore(n)
    if impl.startswith("restore"):
        backend = "host" if impl == "restore-host" else "numpy"
        r.restore(backend)
        assert int(r.ctx.violation_write_index[0]) == 0  # a clean restore: the timed call verifies, finds nothing
        fn = lambda: r.restore(backend)  # noqa: E731
        where = "host backend" if backend == "host" else "NumPy reference"
        label = f"PrefixRestorer.restore: scatter + plan + verify ({where})"
        role = "subject" if backend == "numpy" else "info"
    else:
        fn, label, role = r.copy_back, "floor: the engine's copy of one layer's K back into its pages", "floor"
    measure(fn, group=f"tier restore tokens={n}", label=label, role=role, entries=n, key=f"tier-restore-{n}-{impl}",
            rounds=5)
