// kv-canary: device helpers shared by every kernel in this folder.
//
// The kernels are compiled twice from the same text: by NVRTC for the GPU and by g++ through the host shim
// (kvcanary_cupy/hostcuda) for the CPU. Hence: no standard headers, and integers are `long long` /
// `unsigned long long` / `int` only (NVRTC and g++ disagree on the fixed-width typedefs).
#pragma once

#define KVC_DEVICE __device__ __forceinline__

namespace kvc {

typedef long long i64;
typedef unsigned long long u64;

// splitmix64(CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890): the prev_hash of every chain head.
constexpr u64 kAnchorHash = 0xDE7FAE23A9A1B716ull;

// Canary slot fields (int64 words), violation row columns and reason / status bits (SPEC §1).
enum { kFieldToken = 0, kFieldPosition = 1, kFieldPrevHash = 2, kFieldRealKvHash = 3 };
enum { kCanaryFieldsPerSlot = 4 };
enum { kViolationFields = 8 };
enum {
  kVerifyChainHash = 1,
  kVerifyPosition = 2,
  kVerifyRealKv = 4,
  kWriteToken = 8,
  kWritePosition = 16,
  kVerifyToken = 32,
};
enum {
  kPlanRowOutOfRange = 1,
  kPlanPrefixBeyondRow = 2,
  kPlanSlotOutsideLut = 4,
  kPlanExpectedBeyondPool = 8,
  kPlanBlockOutsideSlots = 16,
  kPlanBeyondBlocks = 32,
  kPlanIndptrInvalid = 64,
};
enum { kSlotOutOfRange = 1, kTokenRangeOutOfBounds = 2, kScatterOutOfRange = 4, kWriteOffsetsOutOfOrder = 8 };
enum { kHashNone = 0, kHashPartial = 1, kHashAll = 2 };
enum { kMaxRealKvSources = 4 };

// splitmix64 finalizer only (no golden-ratio increment), so a zero-filled slot hashes to 0.
KVC_DEVICE u64 splitmix64(u64 x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// Whether `slot` indexes a row of a buffer of `num_slots` rows (any device value may arrive here).
KVC_DEVICE bool slot_in_range(i64 slot, i64 num_slots) { return slot >= 0 && slot < num_slots; }

// Copy one canary record (the 4 fields of a slot) from `src` to `dst`; a null `src` stores zeros.
KVC_DEVICE void store_record(i64* dst, const i64* src) {
#pragma unroll
  for (int f = 0; f < kCanaryFieldsPerSlot; ++f) dst[f] = src != nullptr ? src[f] : 0;
}

// One chain step: (prev_hash, token, position) of a slot -> the prev_hash its successor stores.
KVC_DEVICE u64 mix3(u64 a, u64 b, u64 c) { return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c); }

// Chain hash of slot `slot` (caller guarantees 0 <= slot < num_slots); negative slots are chain heads.
KVC_DEVICE u64 slot_hash(const i64* canary, i64 stride_words, i64 slot) {
  if (slot < 0) return kAnchorHash;
  const i64* f = canary + slot * stride_words;
  return mix3((u64)f[kFieldPrevHash], (u64)f[kFieldToken], (u64)f[kFieldPosition]);
}

// Real-KV sources arrive as plain scalar kernel parameters (graph-safe: baked at capture), declared by
// KVC_REAL_KV_PARAMS and gathered into this struct by KVC_REAL_KV_SOURCES.
struct RealKvSource {
  const unsigned char* base;
  i64 row_stride;  // bytes between dim-0 rows
  i64 page_size;   // slots per row
  i64 bytes_per_token;
  i64 read_bytes;  // multiple of 16
};

struct RealKvSources {
  RealKvSource src[kMaxRealKvSources];
  int count;
  int mode;
};

#define KVC_REAL_KV_PARAM(k)                                                                          \
  const unsigned char *kv_base##k, long long kv_row_stride##k, long long kv_page_size##k,             \
      long long kv_bytes_per_token##k, long long kv_read_bytes##k
#define KVC_REAL_KV_PARAMS \
  KVC_REAL_KV_PARAM(0), KVC_REAL_KV_PARAM(1), KVC_REAL_KV_PARAM(2), KVC_REAL_KV_PARAM(3), int kv_count, int kv_mode
#define KVC_REAL_KV_SOURCE(k) \
  kvc::RealKvSource { kv_base##k, kv_row_stride##k, kv_page_size##k, kv_bytes_per_token##k, kv_read_bytes##k }
#define KVC_REAL_KV_SOURCES                                                                           \
  kvc::RealKvSources {                                                                                 \
    {KVC_REAL_KV_SOURCE(0), KVC_REAL_KV_SOURCE(1), KVC_REAL_KV_SOURCE(2), KVC_REAL_KV_SOURCE(3)}, kv_count, \
        kv_mode                                                                                        \
  }

// Fingerprint of the real KV bytes of `slot` (SPEC §2.3): per source, fold 16-byte little-endian
// (lo, hi) word pairs through splitmix64, then fold the source hashes in order. The host checked that
// every source covers all canary slots and that every access is a 16-byte aligned 128-bit load.
KVC_DEVICE u64 real_kv_fold(const RealKvSources& sources, i64 slot) {
  if (sources.mode == kHashNone || sources.count <= 0) return 0;
  u64 total = 0;
#pragma unroll
  for (int k = 0; k < kMaxRealKvSources; ++k) {  // unrolled so `src[k]` stays in registers
    if (k < sources.count) {
      const RealKvSource& src = sources.src[k];
      const unsigned char* bytes =
          src.base + (slot / src.page_size) * src.row_stride + (slot % src.page_size) * src.bytes_per_token;
      const i64 length = sources.mode == kHashPartial ? 16 : src.read_bytes;
      u64 acc = 0;
      for (i64 offset = 0; offset < length; offset += 16) {
        const ulonglong2 words = *reinterpret_cast<const ulonglong2*>(bytes + offset);
        acc = splitmix64(acc ^ words.x);
        acc = splitmix64(acc ^ words.y);
      }
      total = splitmix64(total ^ acc);
    }
  }
  return total;
}

// Fill-once violation ring (SPEC §1.2): the counter always advances; a row lands only in a free slot.
KVC_DEVICE void append_violation(i64* ring, i64 ring_capacity, int* write_index, const i64 (&row)[kViolationFields]) {
  const int seq = atomicAdd(write_index, 1);
  if (seq >= 0 && seq < ring_capacity) {
    i64* dst = ring + (i64)seq * kViolationFields;
#pragma unroll
    for (int c = 0; c < kViolationFields; ++c) dst[c] = row[c];
    __threadfence_system();  // the host may read the ring while later kernels still run
  }
}

// Exclusive scan of one u64 per thread across the block. Needs blockDim.x a multiple of 32 (<= 1024) and
// 32 u64 of shared scratch; every thread of the block must call it. Returns this thread's exclusive
// prefix and stores the block total in *block_total.
KVC_DEVICE u64 block_exclusive_scan(u64 value, u64* warp_sums, u64* block_total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  u64 inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const u64 up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    u64 sum = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const u64 up = __shfl_up_sync(0xffffffffu, sum, d);
      if (lane >= d) sum += up;
    }
    warp_sums[lane] = sum;
  }
  __syncthreads();
  const u64 before = warp == 0 ? 0 : warp_sums[warp - 1];
  *block_total = warp_sums[warps - 1];
  __syncthreads();  // the scratch is reused by the next call
  return before + inclusive - value;
}

}  // namespace kvc
