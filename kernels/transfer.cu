// kv-canary record transfer: move the 32-byte canary records of KV slots between a canary buffer and a
// contiguous record buffer that travels with the KV pages: to another process (disaggregated prefill ->
// decode) or down a cache hierarchy (device -> host memory -> disk) and back. A record holds only content and
// position (token, position, prev_hash, real_kv_hash), never a slot number, so it stays valid under another
// slot numbering and can be verified there against that side's slot table.
//
// Records move in pages: entry k of `pages` names page pages[k], whose slots are
// pages[k] * page_stride + [0, page_size); record i belongs to page i / page_size, slot offset i % page_size.
// A plain slot list is page_size = page_stride = 1. A page is in the buffer iff 0 <= page and
// page * page_stride + page_size <= num_slots (checked before any multiplication, so no overflow).
//
// kvc_gather_records   grid (G), block B, any shape. Threads grid-stride over records i < num_pages * page_size:
//                      records[i] = canary[slot(i)][0:4]. A page outside the buffer is never read: its records
//                      are zero-filled and SLOT_OUT_OF_RANGE is set in `status` (when non-null).
// kvc_scatter_records  grid (G), block B, any shape. Threads grid-stride over records i:
//                      canary[slot(i)][0:4] = records[i]. A page outside the buffer is skipped and reported the
//                      same way. Precondition: the destination slots are distinct (two records for one slot
//                      race, as two writes of one slot do in kvc_write).
// Both read and write whole int64 words only; bytes of a slot past its 4 fields are never touched.
#include "canary_common.cuh"

extern "C" __global__ void kvc_gather_records(const long long* __restrict__ canary, long long num_slots,
                                              long long stride_words, const long long* __restrict__ pages,
                                              long long num_pages, long long page_size, long long page_stride,
                                              long long* __restrict__ records, int* __restrict__ status) {
  using kvc::i64;
  int bits_seen = 0;
  const i64 in_buffer = kvc::pages_in_buffer(num_slots, page_size, page_stride);
  const i64 n = num_pages * page_size;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const i64 page = pages[i / page_size];
    i64* out = records + i * kvc::kCanaryFieldsPerSlot;
    if (!kvc::slot_in_range(page, in_buffer)) {
      bits_seen |= kvc::kSlotOutOfRange;
      kvc::store_record(out, nullptr);
      continue;
    }
    kvc::store_record(out, canary + (page * page_stride + i % page_size) * stride_words);
  }
  if (bits_seen && status != nullptr) atomicOr(status, bits_seen);
}

extern "C" __global__ void kvc_scatter_records(const long long* __restrict__ records,
                                               const long long* __restrict__ pages, long long num_pages,
                                               long long page_size, long long page_stride,
                                               long long* __restrict__ canary, long long num_slots,
                                               long long stride_words, int* __restrict__ status) {
  using kvc::i64;
  int bits_seen = 0;
  const i64 in_buffer = kvc::pages_in_buffer(num_slots, page_size, page_stride);
  const i64 n = num_pages * page_size;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const i64 page = pages[i / page_size];
    if (!kvc::slot_in_range(page, in_buffer)) {
      bits_seen |= kvc::kSlotOutOfRange;
      continue;
    }
    kvc::store_record(canary + (page * page_stride + i % page_size) * stride_words,
                      records + i * kvc::kCanaryFieldsPerSlot);
  }
  if (bits_seen && status != nullptr) atomicOr(status, bits_seen);
}
