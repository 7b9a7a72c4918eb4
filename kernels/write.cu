// kv-canary write step (SPEC §4): stamp the canary of every token written this step.
//
// kvc_write  grid (G), block B (any size). Blocks grid-stride over requests r < clamp(
//            write_num_valid_reqs, 0, W). For a request with entries [offsets[r], offsets[r+1]):
//            - all threads in parallel store token, position and the real-KV fingerprint of each entry
//              (the parallel, memory-heavy part);
//            - thread 0 walks the entries in order: seeds the chain from the seed slot (or the anchor),
//              stores each slot's prev_hash, emits input-assert and chain-position rows, and advances the
//              chain on the actual (token, position) - the serial part.
//            Negative slots are skipped silently; slots or seeds outside the buffer, and a token range
//            outside the token arrays, are skipped and reported in `status`. Offsets out of order: from the
//            first request whose offsets run backwards (write_offsets[r+1] < write_offsets[r]) on, every
//            request is skipped and kWriteOffsetsOutOfOrder is set, so the ranges written are disjoint, each
//            token is written at most once and the work stays proportional to the tokens passed. Each block
//            finds that request once, all its threads scanning the offsets, before its first request.
//            kernel_run_counter += 1 (block 0); slot_run_counter += written entries (one atomic per block).
//            Preconditions (as in SGLang):
//            write slots are distinct and no request's seed slot is written by the same launch.
#include "canary_common.cuh"

extern "C" __global__ void kvc_write(
    long long* __restrict__ canary, long long num_slots, long long stride_words,
    const long long* __restrict__ write_offsets, const long long* __restrict__ seed_slots,
    const int* __restrict__ write_num_valid_reqs, long long write_capacity, const long long* __restrict__ input_ids,
    const long long* __restrict__ positions, const long long* __restrict__ out_cache_loc, long long num_tokens,
    int input_assert, const long long* __restrict__ expected_tokens, const long long* __restrict__ expected_positions,
    const int* __restrict__ chain_position_assert, long long kernel_kind, long long* __restrict__ ring,
    long long ring_capacity, int* __restrict__ write_index, long long* __restrict__ slot_counter,
    long long* __restrict__ kernel_counter, int* __restrict__ status, KVC_REAL_KV_PARAMS) {
  using kvc::i64;
  using kvc::u64;
  __shared__ unsigned long long block_written;
  __shared__ int block_status;
  __shared__ long long block_first_backward;
  const i64 requested = *write_num_valid_reqs;
  const i64 active = requested < 0 ? 0 : (requested > write_capacity ? write_capacity : requested);
  if (threadIdx.x == 0) {
    block_written = 0;
    block_status = 0;
    block_first_backward = active;
    if (blockIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(kernel_counter), 1ull);
  }
  __syncthreads();

  // The first request whose offsets run backwards: a thread's first hit is its smallest (j increases).
  for (i64 j = threadIdx.x; j < active; j += blockDim.x) {
    if (write_offsets[j + 1] < write_offsets[j]) {
      atomicMin(&block_first_backward, j);
      break;
    }
  }
  __syncthreads();
  const i64 first_backward = block_first_backward;

  const kvc::RealKvSources sources = KVC_REAL_KV_SOURCES;
  const bool chain_check_enabled = *chain_position_assert != 0;
  u64 written = 0;
  int bits_seen = 0;
  if (first_backward < active) bits_seen |= kvc::kWriteOffsetsOutOfOrder;
  for (i64 r = blockIdx.x; r < first_backward; r += gridDim.x) {
    const i64 lo = write_offsets[r];
    const i64 hi = write_offsets[r + 1];
    if (!(hi > lo)) continue;  // compared, never subtracted: garbage offsets must not overflow
    if (lo < 0 || hi > num_tokens) {
      bits_seen |= kvc::kTokenRangeOutOfBounds;
      continue;
    }

    // Parallel part: token, position and real-KV fingerprint of every entry.
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const i64 slot = out_cache_loc[i];
      if (slot < 0) continue;
      if (slot >= num_slots) {
        bits_seen |= kvc::kSlotOutOfRange;
        continue;
      }
      i64* fields = canary + slot * stride_words;
      fields[kvc::kFieldToken] = input_ids[i];
      fields[kvc::kFieldPosition] = positions[i];
      fields[kvc::kFieldRealKvHash] = (i64)kvc::real_kv_fold(sources, slot);
      ++written;
    }

    // Serial part: the chain.
    if (threadIdx.x == 0) {
      i64 seed = seed_slots[r];
      if (seed >= num_slots) {
        bits_seen |= kvc::kSlotOutOfRange;
        seed = -1;
      }
      u64 running = kvc::slot_hash(canary, stride_words, seed);
      const bool chain_check = seed >= 0 && chain_check_enabled;
      i64 running_position = chain_check ? canary[seed * stride_words + kvc::kFieldPosition] : 0;
      for (i64 i = lo; i < hi; ++i) {
        const i64 slot = out_cache_loc[i];
        if (slot < 0 || slot >= num_slots) continue;
        const i64 token = input_ids[i];
        const i64 position = positions[i];
        if (input_assert) {
          const i64 want_token = expected_tokens[i];
          const i64 want_position = expected_positions[i];
          i64 reasons = 0;
          if (token != want_token) reasons |= kvc::kWriteToken;
          if (position != want_position) reasons |= kvc::kWritePosition;
          if (reasons) {
            const i64 row[kvc::kViolationFields] = {kernel_kind, slot,          position,      token,
                                                     want_token,  (i64)running, want_position, reasons};
            kvc::append_violation(ring, ring_capacity, write_index, row);
          }
        }
        if (chain_check) {
          const i64 want_position = (i64)((u64)running_position + 1);  // wraps like the reference
          if (position != want_position) {
            const i64 row[kvc::kViolationFields] = {kernel_kind,  slot,          position, token, token,
                                                     (i64)running, want_position, kvc::kWritePosition};
            kvc::append_violation(ring, ring_capacity, write_index, row);
          }
          running_position = position;
        }
        canary[slot * stride_words + kvc::kFieldPrevHash] = (i64)running;
        running = kvc::mix3(running, (u64)token, (u64)position);
      }
    }
  }

  if (written) atomicAdd(&block_written, written);
  if (bits_seen) atomicOr(&block_status, bits_seen);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (block_written) atomicAdd(reinterpret_cast<unsigned long long*>(slot_counter), block_written);
    if (block_status) atomicOr(status, block_status);
  }
}
