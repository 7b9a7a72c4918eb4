// kv-canary plan step (SPEC §3): one batch -> flat verify entries + per-request write offsets and seeds.
//
// kvc_plan_offsets[_paged]  grid (1), block B (multiple of 32, <= 1024). Scans the batch in chunks of 4*B
//                   requests: per-request verify counts (saturated at C+1) and write counts, their exclusive
//                   prefix sums (verify ones into the WritePlan's verify_offsets scratch), totals,
//                   verify_num_valid / enable, write offsets with tail zeroing, seeds, write_num_valid_reqs,
//                   and resets `status` to the seeds' PlanStatus bits. Any batch size; no allocation.
// kvc_plan_entries[_paged]  persistent grid, any shape. Must run after the offsets kernel of the same layout
//                   on the same stream. Each thread grid-strides over the `total` entries, finds its request by
//                   binary search over verify_offsets and gathers slot / expected token / position / prev
//                   slot. Consecutive threads take consecutive positions of one request, so the table loads
//                   of a warp are coalesced (a block table's id is one broadcast load). Returns at once when
//                   the offsets kernel reported overflow (enable == 0).
//
// The layout (how a request's position becomes a slot) is a template parameter: `TokenRows` is SGLang's
// req_to_token, `PagedRows` a block table or CSR page lists (kvcanary_cupy/layouts.py). Everything else is
// shared. `req_pool_indices` may be null for layouts that read batch rows: every row is then active and its
// expected-token pool row is its batch row.
//
// Every gather is bounds-checked; an entry whose gather would leave its buffer becomes
// (slot 0, expected -1, position, prev 0) and sets its PlanStatus bit. Checks run in the order: row, CSR
// range, position inside the row, block id inside the slot space (slot, then predecessor), LUT, pool.
#include "canary_common.cuh"

namespace {

using kvc::i64;
using kvc::u64;

constexpr int kItemsPerThread = 4;

// SWA translation T: negative values pass through, others index the LUT (caller checked the range).
KVC_DEVICE i64 translate(const i64* lut, i64 value) { return value < 0 ? value : lut[value]; }

// Where one request's slots live in its layout: `count` entries of the layout's flat array from `base`.
struct Span {
  i64 base;
  i64 count;
};

// SGLang's token table: the span is row rp of req_to_token, one slot per position.
struct TokenRows {
  const int* table;
  i64 rows;
  i64 width;

  KVC_DEVICE int span(i64 /*r*/, i64 rp, Span* s) const {
    if (rp < 0 || rp >= rows) return kvc::kPlanRowOutOfRange;
    s->base = rp * width;
    s->count = width;
    return 0;
  }
  KVC_DEVICE int slot(const Span& s, i64 pos, i64* raw) const {
    if (pos >= s.count) return kvc::kPlanPrefixBeyondRow;
    *raw = table[s.base + pos];
    return 0;
  }
};

// Block table [rows, width] (row rp, or row r with batch_rows) or CSR page lists (indptr32 or indptr64
// non-null): the span is the request's block ids; position p is slot id[p / size] * stride + p % size.
struct PagedRows {
  const int* ids;
  i64 rows;
  i64 width;
  const int* indptr32;
  const long long* indptr64;
  i64 nnz;
  int batch_rows;
  i64 block_size;
  i64 block_stride;
  i64 num_blocks;  // ids in [0, num_blocks) are inside the slot space

  KVC_DEVICE int span(i64 r, i64 rp, Span* s) const {
    if (indptr32 != nullptr || indptr64 != nullptr) {
      const i64 a = indptr64 != nullptr ? indptr64[r] : (i64)indptr32[r];
      const i64 b = indptr64 != nullptr ? indptr64[r + 1] : (i64)indptr32[r + 1];
      if (a < 0 || b < a || b > nnz) return kvc::kPlanIndptrInvalid;
      s->base = a;
      s->count = b - a;
      return 0;
    }
    const i64 row = batch_rows ? r : rp;
    if (row < 0 || row >= rows) return kvc::kPlanRowOutOfRange;
    s->base = row * width;
    s->count = width;
    return 0;
  }
  KVC_DEVICE int slot(const Span& s, i64 pos, i64* raw) const {
    const i64 j = pos / block_size;
    if (j >= s.count) return kvc::kPlanBeyondBlocks;
    const i64 id = ids[s.base + j];
    if (id < 0 || id >= num_blocks) return kvc::kPlanBlockOutsideSlots;
    *raw = id * block_stride + (pos - j * block_size);  // id < 2**31 and stride < 2**31: no overflow
    return 0;
  }
};

template <class Rows>
KVC_DEVICE void plan_offsets(const Rows& layout, const long long* __restrict__ req_pool_indices,
                             const long long* __restrict__ prefix_lens, const long long* __restrict__ extend_seq_lens,
                             i64 bs, const long long* __restrict__ lut, i64 lut_len, i64 window, i64 verify_capacity,
                             i64 write_capacity, long long* __restrict__ verify_offsets,
                             long long* __restrict__ write_offsets, long long* __restrict__ seeds,
                             int* __restrict__ verify_num_valid, int* __restrict__ enable,
                             int* __restrict__ write_num_valid_reqs, int* __restrict__ status, u64* warp_sums,
                             int* block_status) {
  if (threadIdx.x == 0) *block_status = 0;
  __syncthreads();

  const i64 chunk = (i64)blockDim.x * kItemsPerThread;
  u64 verify_carry = 0;  // running totals, identical in every thread
  u64 write_carry = 0;
  int bits = 0;
  for (i64 base = 0; base < bs; base += chunk) {
    u64 verify_count[kItemsPerThread];
    u64 write_count[kItemsPerThread];
    u64 verify_sum = 0;
    u64 write_sum = 0;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      const i64 r = base + (i64)threadIdx.x * kItemsPerThread + k;
      verify_count[k] = 0;
      write_count[k] = 0;
      if (r < bs) {
        const i64 rp = req_pool_indices != nullptr ? req_pool_indices[r] : r;
        const bool active = req_pool_indices == nullptr || rp != 0;
        const i64 prefix = prefix_lens[r];
        const i64 extend = extend_seq_lens[r];
        if (active) {
          const i64 clamped = prefix > 0 ? prefix : 0;
          const i64 count = window > 0 && clamped > window ? window : clamped;
          // Saturating at C+1 keeps sums far from overflow; such a request forces overflow anyway.
          verify_count[k] = (u64)(count > verify_capacity ? verify_capacity + 1 : count);
          write_count[k] = extend > 0 ? (u64)extend : 0;
        }
        i64 seed = -1;
        if (active && extend > 0 && prefix > 0) {
          Span span;
          i64 raw = 0;
          int bit = layout.span(r, rp, &span);
          if (bit == 0) bit = layout.slot(span, prefix - 1, &raw);
          if (bit == 0 && lut_len > 0 && raw >= lut_len) bit = kvc::kPlanSlotOutsideLut;
          if (bit == 0) {
            seed = lut_len > 0 ? translate(lut, raw) : raw;
          } else {
            bits |= bit;
          }
        }
        seeds[r] = seed;
      }
      verify_sum += verify_count[k];
      write_sum += write_count[k];
    }
    u64 verify_chunk_total = 0;
    u64 write_chunk_total = 0;
    u64 verify_prefix = kvc::block_exclusive_scan(verify_sum, warp_sums, &verify_chunk_total) + verify_carry;
    u64 write_prefix = kvc::block_exclusive_scan(write_sum, warp_sums, &write_chunk_total) + write_carry;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      const i64 r = base + (i64)threadIdx.x * kItemsPerThread + k;
      if (r < bs) {
        verify_offsets[r] = (i64)verify_prefix;
        write_offsets[r] = (i64)write_prefix;  // modulo 2**64, like the reference
      }
      verify_prefix += verify_count[k];
      write_prefix += write_count[k];
    }
    verify_carry += verify_chunk_total;
    write_carry += write_chunk_total;
  }

  // write_offsets[bs] holds the total and (bs, W] is zeroed so a shrinking batch leaves no stale offsets.
  for (i64 k = bs + 1 + threadIdx.x; k <= write_capacity; k += blockDim.x) write_offsets[k] = 0;
  if (bits) atomicOr(block_status, bits);
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool overflow = verify_carry > (u64)verify_capacity;
    verify_offsets[bs] = (i64)verify_carry;
    write_offsets[bs] = (i64)write_carry;
    *verify_num_valid = (int)(overflow ? verify_capacity : (i64)verify_carry);
    *enable = overflow ? 0 : 1;
    *write_num_valid_reqs = (int)bs;
    *status = *block_status;
  }
}

template <class Rows>
KVC_DEVICE void plan_entries(const Rows& layout, const long long* __restrict__ req_pool_indices,
                             const long long* __restrict__ prefix_lens, i64 bs, const long long* __restrict__ lut,
                             i64 lut_len, i64 window, const int* __restrict__ pool, i64 pool_rows, i64 pool_width,
                             const long long* __restrict__ valid_lens, int has_pool, int position_offset,
                             const long long* __restrict__ verify_offsets, const int* __restrict__ enable,
                             i64 verify_capacity, long long* __restrict__ out_slots,
                             long long* __restrict__ out_tokens, long long* __restrict__ out_positions,
                             long long* __restrict__ out_prev_slots, int* __restrict__ status) {
  const i64 total = verify_offsets[bs];
  if (*enable == 0 || total <= 0 || total > verify_capacity) return;
  int bits = 0;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
    // Owner: the largest r in [0, bs) with verify_offsets[r] <= k (empty requests share offsets).
    i64 lo = 0;
    i64 hi = bs;
    while (hi - lo > 1) {
      const i64 mid = lo + (hi - lo) / 2;
      if (verify_offsets[mid] <= k) lo = mid; else hi = mid;
    }
    const i64 r = lo;
    const i64 rp = req_pool_indices != nullptr ? req_pool_indices[r] : r;
    const i64 prefix = prefix_lens[r] > 0 ? prefix_lens[r] : 0;
    const i64 count = window > 0 && prefix > window ? window : prefix;
    const i64 pos = prefix - count + (k - verify_offsets[r]);

    i64 slot = 0;
    i64 prev = 0;
    i64 token = -1;
    Span span;
    i64 raw = 0;
    i64 raw_prev = -1;
    int bit = layout.span(r, rp, &span);
    if (bit == 0) bit = layout.slot(span, pos, &raw);
    if (bit == 0 && pos > 0) bit = layout.slot(span, pos - 1, &raw_prev);
    if (bit == 0 && lut_len > 0) {
      if (raw >= lut_len || raw_prev >= lut_len) {
        bit = kvc::kPlanSlotOutsideLut;
      } else {
        raw = translate(lut, raw);
        raw_prev = translate(lut, raw_prev);
      }
    }
    if (bit == 0 && has_pool) {
      const i64 source_pos = pos + position_offset;
      if (source_pos >= 0 && source_pos < valid_lens[r]) {
        if (rp < 0 || rp >= pool_rows || source_pos >= pool_width) {
          bit = kvc::kPlanExpectedBeyondPool;
        } else {
          token = pool[rp * pool_width + source_pos];
        }
      }
    }
    if (bit == 0) {
      slot = raw;
      prev = raw_prev;
    } else {
      token = -1;
    }
    bits |= bit;
    out_slots[k] = slot;
    out_tokens[k] = token;
    out_positions[k] = pos;
    out_prev_slots[k] = prev;
  }
  if (bits) atomicOr(status, bits);
}

}  // namespace

#define KVC_PLAN_OFFSETS_TAIL                                                                                   \
  const long long *__restrict__ lut, long long lut_len, long long window, long long verify_capacity,          \
      long long write_capacity, long long *__restrict__ verify_offsets, long long *__restrict__ write_offsets, \
      long long *__restrict__ seeds, int *__restrict__ verify_num_valid, int *__restrict__ enable,              \
      int *__restrict__ write_num_valid_reqs, int *__restrict__ status
#define KVC_PLAN_OFFSETS_ARGS                                                                                  \
  req_pool_indices, prefix_lens, extend_seq_lens, bs, lut, lut_len, window, verify_capacity, write_capacity,  \
      verify_offsets, write_offsets, seeds, verify_num_valid, enable, write_num_valid_reqs, status, warp_sums, \
      &block_status
#define KVC_PLAN_ENTRIES_TAIL                                                                                  \
  const long long *__restrict__ lut, long long lut_len, long long window, const int *__restrict__ pool,       \
      long long pool_rows, long long pool_width, const long long *__restrict__ valid_lens, int has_pool,      \
      int position_offset, const long long *__restrict__ verify_offsets, const int *__restrict__ enable,       \
      long long verify_capacity, long long *__restrict__ out_slots, long long *__restrict__ out_tokens,        \
      long long *__restrict__ out_positions, long long *__restrict__ out_prev_slots, int *__restrict__ status
#define KVC_PLAN_ENTRIES_ARGS                                                                                  \
  req_pool_indices, prefix_lens, bs, lut, lut_len, window, pool, pool_rows, pool_width, valid_lens, has_pool, \
      position_offset, verify_offsets, enable, verify_capacity, out_slots, out_tokens, out_positions,         \
      out_prev_slots, status

extern "C" __global__ void __launch_bounds__(1024) kvc_plan_offsets(
    const long long* __restrict__ req_pool_indices, const long long* __restrict__ prefix_lens,
    const long long* __restrict__ extend_seq_lens, long long bs, const int* __restrict__ req_to_token,
    long long rtt_rows, long long rtt_width, KVC_PLAN_OFFSETS_TAIL) {
  __shared__ u64 warp_sums[32];
  __shared__ int block_status;
  plan_offsets(TokenRows{req_to_token, rtt_rows, rtt_width}, KVC_PLAN_OFFSETS_ARGS);
}

extern "C" __global__ void __launch_bounds__(1024) kvc_plan_offsets_paged(
    const long long* __restrict__ req_pool_indices, const long long* __restrict__ prefix_lens,
    const long long* __restrict__ extend_seq_lens, long long bs, const int* __restrict__ ids, long long rows,
    long long width, const int* __restrict__ indptr32, const long long* __restrict__ indptr64, long long nnz,
    int batch_rows, long long block_size, long long block_stride, long long num_blocks, KVC_PLAN_OFFSETS_TAIL) {
  __shared__ u64 warp_sums[32];
  __shared__ int block_status;
  plan_offsets(PagedRows{ids, rows, width, indptr32, indptr64, nnz, batch_rows, block_size, block_stride, num_blocks},
               KVC_PLAN_OFFSETS_ARGS);
}

extern "C" __global__ void kvc_plan_entries(
    const long long* __restrict__ req_pool_indices, const long long* __restrict__ prefix_lens, long long bs,
    const int* __restrict__ req_to_token, long long rtt_rows, long long rtt_width, KVC_PLAN_ENTRIES_TAIL) {
  plan_entries(TokenRows{req_to_token, rtt_rows, rtt_width}, KVC_PLAN_ENTRIES_ARGS);
}

extern "C" __global__ void kvc_plan_entries_paged(
    const long long* __restrict__ req_pool_indices, const long long* __restrict__ prefix_lens, long long bs,
    const int* __restrict__ ids, long long rows, long long width, const int* __restrict__ indptr32,
    const long long* __restrict__ indptr64, long long nnz, int batch_rows, long long block_size,
    long long block_stride, long long num_blocks, KVC_PLAN_ENTRIES_TAIL) {
  plan_entries(PagedRows{ids, rows, width, indptr32, indptr64, nnz, batch_rows, block_size, block_stride, num_blocks},
               KVC_PLAN_ENTRIES_ARGS);
}
