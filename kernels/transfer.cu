// kv-canary record transfer: move the 32-byte canary records of a request's slots between two canary
// buffers that live in different processes (disaggregated prefill -> decode). A record holds only content
// and position (token, position, prev_hash, real_kv_hash), never a slot number, so it stays valid under the
// receiver's own slot numbering and can be verified there against the receiver's slot table.
//
// kvc_gather_records   grid (G), block B, any shape. Threads grid-stride over records i < n:
//                      records[i] = canary[slots[i]][0:4]. A slot outside [0, num_slots) is never read:
//                      its record is zero-filled and SLOT_OUT_OF_RANGE is set in `status` (when non-null).
// kvc_scatter_records  grid (G), block B, any shape. Threads grid-stride over records i < n:
//                      canary[slots[i]][0:4] = records[i]. A slot outside [0, num_slots) is skipped and
//                      reported the same way. Precondition: the destination slots are distinct (two
//                      records for one slot race, as two writes of one slot do in kvc_write).
// Both read and write whole int64 words only; bytes of a slot past its 4 fields are never touched.
#include "canary_common.cuh"

extern "C" __global__ void kvc_gather_records(const long long* __restrict__ canary, long long num_slots,
                                              long long stride_words, const long long* __restrict__ slots,
                                              long long n, long long* __restrict__ records,
                                              int* __restrict__ status) {
  using kvc::i64;
  int bits_seen = 0;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const i64 slot = slots[i];
    i64* out = records + i * kvc::kCanaryFieldsPerSlot;
    if (!kvc::slot_in_range(slot, num_slots)) {
      bits_seen |= kvc::kSlotOutOfRange;
      kvc::store_record(out, nullptr);
      continue;
    }
    kvc::store_record(out, canary + slot * stride_words);
  }
  if (bits_seen && status != nullptr) atomicOr(status, bits_seen);
}

extern "C" __global__ void kvc_scatter_records(const long long* __restrict__ records, long long n,
                                               const long long* __restrict__ slots, long long* __restrict__ canary,
                                               long long num_slots, long long stride_words,
                                               int* __restrict__ status) {
  using kvc::i64;
  int bits_seen = 0;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const i64 slot = slots[i];
    if (!kvc::slot_in_range(slot, num_slots)) {
      bits_seen |= kvc::kSlotOutOfRange;
      continue;
    }
    kvc::store_record(canary + slot * stride_words, records + i * kvc::kCanaryFieldsPerSlot);
  }
  if (bits_seen && status != nullptr) atomicOr(status, bits_seen);
}
