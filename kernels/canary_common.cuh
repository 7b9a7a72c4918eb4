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

// Pages of `page_size` slots, `page_stride` apart (both > 0), that fit whole in a buffer of `num_slots` slots:
// page p is in the buffer iff 0 <= p < pages_in_buffer(...), decided before any p * page_stride is formed.
KVC_DEVICE i64 pages_in_buffer(i64 num_slots, i64 page_size, i64 page_stride) {
  return num_slots < page_size ? 0 : (num_slots - page_size) / page_stride + 1;
}

// Copy one canary record (the 4 fields of a slot) from `src` to `dst`; a null `src` stores zeros.
KVC_DEVICE void store_record(i64* dst, const i64* src) {
#pragma unroll
  for (int f = 0; f < kCanaryFieldsPerSlot; ++f) dst[f] = src != nullptr ? src[f] : 0;
}

// Whether two canary records (the 4 fields of a slot) hold the same words.
KVC_DEVICE bool same_record(const i64* a, const i64* b) {
  return a[kFieldToken] == b[kFieldToken] && a[kFieldPosition] == b[kFieldPosition] &&
         a[kFieldPrevHash] == b[kFieldPrevHash] && a[kFieldRealKvHash] == b[kFieldRealKvHash];
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
// KVC_REAL_KV_PARAMS and gathered into this struct by KVC_REAL_KV_SOURCES. A source describes where slot
// s's logical bytes lie (kvcanary_cupy/kv_bytes.py, KvByteLayout): for each head h, for each element e,
// the element_bytes bytes at (s / page_size) * page_stride + token_term(s % page_size) + h * head_stride
// + element_term(e) from `base`, where token_term(o) = o * token_stride unless tokens_per_tile > 0 splits o
// into (o / tokens_per_tile) * tile_stride + (o % tokens_per_tile) * token_stride, and element_term likewise
// with elements_per_group, group_stride and element_stride (tiled and paired layouts such as CPU attention's
// AMX cache). A contiguous source is one head of 16-byte elements, nothing split.
enum { kAccessTokenRun = 0, kAccessHeadRuns = 1, kAccessElements = 2 };

struct RealKvSource {
  const unsigned char* base;
  i64 page_stride;  // bytes between pages (dim-0 rows of a contiguous source)
  i64 page_size;    // slots per page
  i64 token_stride;
  i64 head_stride;
  i64 element_stride;
  i64 elements_per_head;
  i64 element_bytes;  // 1, 2, 4, 8 or 16; every stride is a multiple of it
  i64 read_bytes;     // multiple of 16
  i64 access;         // kAccess*: the widest loads the host found the layout's alignment to allow
  i64 tokens_per_tile;     // 0: token offsets not split
  i64 tile_stride;
  i64 elements_per_group;  // 0: element indices not split; > 0 only with kAccessElements
  i64 group_stride;
};

struct RealKvSources {
  RealKvSource src[kMaxRealKvSources];
  int count;
  int mode;
};

#define KVC_REAL_KV_PARAM(k)                                                                              \
  const unsigned char *kv_base##k, long long kv_page_stride##k, long long kv_page_size##k,                \
      long long kv_token_stride##k, long long kv_head_stride##k, long long kv_element_stride##k,          \
      long long kv_elements_per_head##k, long long kv_element_bytes##k, long long kv_read_bytes##k,       \
      long long kv_access##k, long long kv_tokens_per_tile##k, long long kv_tile_stride##k,               \
      long long kv_elements_per_group##k, long long kv_group_stride##k
#define KVC_REAL_KV_PARAMS \
  KVC_REAL_KV_PARAM(0), KVC_REAL_KV_PARAM(1), KVC_REAL_KV_PARAM(2), KVC_REAL_KV_PARAM(3), int kv_count, int kv_mode
#define KVC_REAL_KV_SOURCE(k)                                                                          \
  kvc::RealKvSource {                                                                                   \
    kv_base##k, kv_page_stride##k, kv_page_size##k, kv_token_stride##k, kv_head_stride##k,              \
        kv_element_stride##k, kv_elements_per_head##k, kv_element_bytes##k, kv_read_bytes##k, kv_access##k, \
        kv_tokens_per_tile##k, kv_tile_stride##k, kv_elements_per_group##k, kv_group_stride##k             \
  }
#define KVC_REAL_KV_SOURCES                                                                           \
  kvc::RealKvSources {                                                                                 \
    {KVC_REAL_KV_SOURCE(0), KVC_REAL_KV_SOURCE(1), KVC_REAL_KV_SOURCE(2), KVC_REAL_KV_SOURCE(3)}, kv_count, \
        kv_mode                                                                                        \
  }

// An index split into the digits (index / radix, index % radix), each times its stride; radix 0 splits nothing.
KVC_DEVICE i64 digit_term(i64 index, i64 radix, i64 high_stride, i64 low_stride) {
  if (radix == 0) return index * low_stride;
  const i64 high = index / radix;
  return high * high_stride + (index - high * radix) * low_stride;
}

// A slot split into (page, offset in the page) for one page size. The sources of one launch usually share their
// page size (one KV cache group's layers), so the division is done once per slot, not once per source.
struct SlotPage {
  i64 page_size, page, offset;
};
KVC_DEVICE void split_slot(SlotPage& at, i64 slot, i64 page_size) {
  if (at.page_size == page_size) return;
  at.page_size = page_size;
  at.page = slot / page_size;
  at.offset = slot - at.page * page_size;
}

// First byte of the token at `at` (its element 0 of head 0 sits at element_term(0) = 0 from here).
KVC_DEVICE const unsigned char* token_address(const RealKvSource& src, const SlotPage& at) {
  return src.base + at.page * src.page_stride +
         digit_term(at.offset, src.tokens_per_tile, src.tile_stride, src.token_stride);
}

// First byte of logical element `element` of a token whose first byte is `token`.
KVC_DEVICE const unsigned char* element_address(const RealKvSource& src, const unsigned char* token, i64 element) {
  const i64 head = element / src.elements_per_head;
  return token + head * src.head_stride +
         digit_term(element - head * src.elements_per_head, src.elements_per_group, src.group_stride,
                    src.element_stride);
}

// The little-endian u64 at logical byte `offset` (a multiple of 8) of a token's stream, for elements of 8 bytes
// or more: the word lies inside one element. Every element is naturally aligned (host-checked).
KVC_DEVICE u64 wide_element_word(const RealKvSource& src, const unsigned char* token, i64 offset) {
  const i64 eb = src.element_bytes;
  const i64 element = offset / eb;
  return *reinterpret_cast<const u64*>(element_address(src, token, element) + (offset - element * eb));
}

// One element of 1, 2 or 4 bytes, zero-extended.
KVC_DEVICE u64 narrow_element(const unsigned char* p, i64 eb) {
  return eb == 4 ? (u64)*reinterpret_cast<const unsigned int*>(p)
       : eb == 2 ? (u64)*reinterpret_cast<const unsigned short*>(p)
                 : (u64)*p;
}

KVC_DEVICE u64 fold_pair(u64 acc, const unsigned char* bytes) {
  const ulonglong2 words = *reinterpret_cast<const ulonglong2*>(bytes);
  return splitmix64(splitmix64(acc ^ words.x) ^ words.y);
}

// One source's fold of the leading `length` logical bytes of `slot`: u64 words in stream order through
// splitmix64. The access kind only picks the loads; the words, hence the hash, are the same for all three.
KVC_DEVICE u64 real_kv_fold_source(const RealKvSource& src, const unsigned char* token, i64 length) {
  u64 acc = 0;
  if (src.access == kAccessTokenRun) {  // the contiguous case: 16-byte aligned runs from the token start
    for (i64 offset = 0; offset < length; offset += 16) acc = fold_pair(acc, token + offset);
  } else if (src.access == kAccessHeadRuns) {  // each head one 16-byte aligned run (e.g. heads before tokens)
    const i64 head_bytes = src.elements_per_head * src.element_bytes;
    i64 done = 0;
    for (const unsigned char* head = token; done < length; head += src.head_stride) {
      for (i64 within = 0; within < head_bytes && done < length; within += 16, done += 16) {
        acc = fold_pair(acc, head + within);
      }
    }
  } else if (src.element_bytes >= 8) {  // any layout of wide elements: each word inside one element
    for (i64 offset = 0; offset < length; offset += 8) acc = splitmix64(acc ^ wide_element_word(src, token, offset));
  } else if (src.element_bytes == 4 && src.elements_per_group == 0 && length / 4 <= src.elements_per_head) {
    // 4-byte elements a stride apart inside one head (fp32 K stored column-major in a block, the bytes PARTIAL
    // hashing reads): two elements a word, with no per-element bookkeeping (the general walk below gives the
    // same words)
    const i64 stride = src.element_stride;
    const unsigned char* p = token;
    for (i64 offset = 0; offset < length; offset += 8, p += 2 * stride) {
      const u64 low = *reinterpret_cast<const unsigned int*>(p);
      const u64 high = *reinterpret_cast<const unsigned int*>(p + stride);
      acc = splitmix64(acc ^ (low | (high << 32)));
    }
  } else {  // any layout of narrow elements (e.g. K stored column-major inside a block): element by element
    // The elements in stream order, packed little-endian into u64 words (8 / eb of them a word; `length` is a
    // multiple of 16, so the last word is full). Without element groups the walk steps from element to element
    // and from head to head by the strides: no division per element.
    const i64 eb = src.element_bytes;
    const i64 per_word = 8 / eb;
    const i64 elements = length / eb;
    const unsigned char* head = token;
    const unsigned char* p = token;
    i64 within = 0;
    i64 packed = 0;
    u64 word = 0;
    // A layout that groups elements (amx: pairs) takes each element's address from its digits instead.
    const bool grouped = src.elements_per_group != 0;
    for (i64 e = 0; e < elements; ++e) {
      if (grouped) p = element_address(src, token, e);
      word |= narrow_element(p, eb) << (8 * eb * packed);
      if (++packed == per_word) {
        acc = splitmix64(acc ^ word);
        word = 0;
        packed = 0;
      }
      if (++within == src.elements_per_head) {
        within = 0;
        head += src.head_stride;
        p = head;
      } else {
        p += src.element_stride;
      }
    }
  }
  return acc;
}

// The entries [lo, hi) of a block as one of its threads walks them: `begin`, `begin + step`, ... below `end`.
// On a GPU consecutive threads take consecutive entries, so a warp's loads of the plan arrays coalesce. On
// the host a block's threads run one after another on one core: each takes a contiguous run instead, so the
// core walks the slots (and the KV rows and pages behind them) in order rather than jumping a block's width.
struct EntryWalk {
  i64 begin, end, step;
};
KVC_DEVICE EntryWalk thread_entries(i64 lo, i64 hi) {
#ifdef __CUDA_ARCH__
  return EntryWalk{lo + (i64)threadIdx.x, hi, (i64)blockDim.x};
#else
  const i64 per_thread = (hi - lo + blockDim.x - 1) / blockDim.x;
  const i64 begin = lo + (i64)threadIdx.x * per_thread;
  return EntryWalk{begin, hi - begin < per_thread ? hi : begin + per_thread, 1};
#endif
}

// Asks for the cache lines that plan entry `index` (if below `active`) will read: its canary record, its
// predecessor's and the first line of the slot's row in every real-KV source. On the host backend one OS
// thread runs a block's entries one after another and live KV is far larger than the caches (and its rows
// sit on distinct pages), so each of those reads misses and stalls the thread; asking kPrefetchStrides of a
// thread's own entries ahead overlaps the misses. On a GPU other warps hide the latency: nothing there.
enum { kPrefetchStrides = 8, kPrefetchElements = 8 };
KVC_DEVICE void prefetch_entry(const i64* canary, i64 stride_words, i64 num_slots, const RealKvSources& sources,
                               const i64* slots, const i64* prev_slots, i64 index, i64 active) {
#ifndef __CUDA_ARCH__
  if (index >= active) return;
  const i64 slot = slots[index];
  if (slot <= 0 || slot >= num_slots) return;
  __builtin_prefetch(canary + slot * stride_words);
  const i64 prev = prev_slots[index];
  if (prev > 0 && prev < num_slots) __builtin_prefetch(canary + prev * stride_words);
  if (sources.mode == kHashNone) return;
  SlotPage at{0, 0, 0};
  for (int k = 0; k < kMaxRealKvSources && k < sources.count; ++k) {
    const RealKvSource& src = sources.src[k];
    split_slot(at, slot, src.page_size);
    const unsigned char* head = token_address(src, at);
    __builtin_prefetch(head);
    // Elements read one by one a wide stride apart (K stored column-major inside a block) sit on a line each,
    // which the block's next tokens share: ask for the lines of the first kPrefetchElements, not the first's
    // alone (a cold TAIL K verify of vLLM's CPU cache then takes 5-7 % less: bench_vllm_verify.py).
    if (src.access == kAccessElements && src.elements_per_group == 0 && src.element_stride >= 64) {
      const i64 eb = src.element_bytes;
      const i64 length = sources.mode == kHashPartial ? 16 : src.read_bytes;
      const i64 end = length < kPrefetchElements * eb ? length : kPrefetchElements * eb;
      const unsigned char* p = head;
      i64 within = 1;  // the next element's index inside its head
      for (i64 offset = eb; offset < end; offset += eb, ++within) {
        if (within == src.elements_per_head) {
          within = 0;
          head += src.head_stride;
          p = head;
        } else {
          p += src.element_stride;
        }
        __builtin_prefetch(p);
      }
    }
  }
#else
  (void)canary, (void)stride_words, (void)num_slots, (void)sources, (void)slots, (void)prev_slots, (void)index,
      (void)active;
#endif
}

// Fingerprint of the real KV bytes of `slot` (SPEC §2.3): per source, fold the slot's logical bytes as
// little-endian u64 words through splitmix64, then fold the source hashes in order. The host checked that
// every source covers all canary slots with every byte inside its tensor, and picked each access kind.
KVC_DEVICE u64 real_kv_fold(const RealKvSources& sources, i64 slot) {
  if (sources.mode == kHashNone || sources.count <= 0) return 0;
  u64 total = 0;
  SlotPage at{0, 0, 0};  // page sizes are >= 1: the first source always splits
#pragma unroll
  for (int k = 0; k < kMaxRealKvSources; ++k) {  // unrolled so `src[k]` stays in registers
    if (k < sources.count) {
      const RealKvSource& src = sources.src[k];
      const i64 length = sources.mode == kHashPartial ? 16 : src.read_bytes;
      split_slot(at, slot, src.page_size);
      total = splitmix64(total ^ real_kv_fold_source(src, token_address(src, at), length));
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
