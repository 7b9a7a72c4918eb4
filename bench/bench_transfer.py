"""Record transfer benchmarks: gather and scatter of canary records against a plain copy of the same bytes.

Disaggregated serving ships each request's canary records with its KV pages (kvcanary_cupy.transfer).
One group per (direction, records): the NumPy reference through the public launcher, the same already
validated, the host backend, and the **floor**: one contiguous copy of the same ``n × 32`` bytes
(``np.copyto`` between preallocated buffers), what moving the records costs without the slot indirection.
Slots are a random permutation of a pool twice the record count, so every record is a separate cache line.

Canary bytes per KV byte, for a typical model (32 layers × 8 KV heads × 128 dims × bf16, K and V): the KV
of one token is 32 × 8 × 128 × 2 B × 2 = 131,072 B; its records are 32 B per canary buffer, so one buffer
(TAIL K) adds 0.024 % and the four of SGLang's layout (HEAD/TAIL × K/V) 128 B = 0.098 %.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.backends import resolve_backend, unavailable_reason
from kvcanary_cupy.dlpack import CPU
from kvcanary_cupy.transfer import RECORD_BYTES, prepare_record_transfer

KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x bf16 x (K, V)
RECORD_COUNTS = (512, 8192, 65536)  # one 512-token request; a 8k prompt; a batch of long prompts
HOST_REASON = unavailable_reason("host")
needs_host = pytest.mark.skipif(HOST_REASON is not None, reason=f"host backend: {HOST_REASON}")


def setup(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    num_slots = 2 * n + 1
    canary = rng.integers(0, 256, size=(num_slots, RECORD_BYTES), dtype=np.uint8)
    slots = (rng.permutation(num_slots - 1)[:n] + 1).astype(np.int64)
    records = rng.integers(-(1 << 62), 1 << 62, size=(n, 4), dtype=np.int64)
    return {"canary": canary, "slots": slots, "records": records, "copy_src": records.copy()}


def run(measure, n: int, direction: str, impl: str) -> None:
    s = setup(n)
    if direction == "gather":
        def call(backend):
            return lambda: kc.gather_canary_records(canary_buf=s["canary"], slots=s["slots"],
                                                    records_out=s["records"], backend=backend)
        launch = prepare_record_transfer(canary_buf=s["canary"], records=s["records"], slots=s["slots"], status=None,
                                         records_written=True)
    else:
        def call(backend):
            return lambda: kc.scatter_canary_records(records=s["records"], slots=s["slots"], canary_buf=s["canary"],
                                                     backend=backend)
        launch = prepare_record_transfer(canary_buf=s["canary"], records=s["records"], slots=s["slots"], status=None,
                                         records_written=False)
    labels = {"numpy": "NumPy reference", "numpy-backend": "NumPy reference, backend call only",
              "host": "host backend (kernels on CPU fibers)", "floor": "floor: contiguous copy of the same bytes"}
    if impl == "numpy":
        fn, role = call("numpy"), "subject"
    elif impl == "numpy-backend":
        backend = resolve_backend("numpy", CPU)
        fn, role = (lambda: backend.gather_records(launch)) if direction == "gather" else (
            lambda: backend.scatter_records(launch)), "subject"
    elif impl == "host":
        fn, role = call("host"), "info"
    else:
        fn, role = (lambda: np.copyto(s["records"], s["copy_src"])), "floor"
    measure(fn, group=f"transfer {direction} records={n}", label=labels[impl], role=role, entries=n,
            key=f"transfer-{direction}-{n}-{impl}", canary_bytes=n * RECORD_BYTES,
            kv_bytes_typical=n * KV_BYTES_PER_TOKEN)


@pytest.mark.parametrize("n", RECORD_COUNTS)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("impl", ["numpy", "numpy-backend", "floor"])
def test_transfer(measure, direction, n, impl):
    run(measure, n, direction, impl)


@needs_host
@pytest.mark.parametrize("n", RECORD_COUNTS)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_transfer_host(measure, direction, n):
    run(measure, n, direction, "host")


def test_canary_share_of_kv_bytes_for_a_typical_model():
    """The figure the module docstring states, computed (not timed)."""
    assert KV_BYTES_PER_TOKEN == 131072
    assert round(100 * RECORD_BYTES / KV_BYTES_PER_TOKEN, 3) == 0.024
    assert round(100 * 4 * RECORD_BYTES / KV_BYTES_PER_TOKEN, 3) == 0.098
