// kv-canary verify step (SPEC §5): check the first verify_num_valid entries of a plan against the canary.
//
// kvc_verify  persistent grid, any shape (the GPU backend uses 64 x 512). Read-only on the canary buffer.
//             Block b takes the b-th of gridDim.x equal contiguous shares of the entries (on the host one OS
//             thread runs a block: it streams through its own part of the plan arrays, not every other run of
//             them), its threads walk the share as kvc::thread_entries lays out. Slot 0 is skipped, a slot
//             outside the buffer is skipped and reported in `status`; the stored token / position /
//             prev_hash / real_kv_hash are compared with the plan's expected token and position, the
//             predecessor's recomputed chain hash (prev 0 or a prev outside the buffer: unreachable, no chain
//             check; negative: anchor) and the live real-KV bytes. Any mismatch appends one row to the ring.
//             `twin` (may be null; only without real-KV hashing): a canary buffer of the same shape that an
//             earlier verify of this plan checked (HEAD K's, for HEAD V). An entry whose record and
//             predecessor record (when 0 < prev < num_slots) hold the same words in both buffers got its
//             verdict, and its row if any, from that launch: it is skipped, so the chain and token checks of
//             the two run once. Any other entry is checked in full.
//             Counters: kernel_run_counter += 1 always; slot_run_counter += active unless enable == 0.
#include "canary_common.cuh"

extern "C" __global__ void kvc_verify(
    const long long* __restrict__ canary, long long num_slots, long long stride_words,
    const long long* __restrict__ slots, const long long* __restrict__ expected_tokens,
    const long long* __restrict__ expected_positions, const long long* __restrict__ prev_slots,
    const int* __restrict__ num_valid, const int* __restrict__ enable, long long capacity, int check_token,
    long long kernel_kind, long long* __restrict__ ring, long long ring_capacity, int* __restrict__ write_index,
    long long* __restrict__ slot_counter, long long* __restrict__ kernel_counter, int* __restrict__ status,
    const long long* __restrict__ twin, KVC_REAL_KV_PARAMS) {
  using kvc::i64;
  using kvc::u64;
  const bool first_thread = blockIdx.x == 0 && threadIdx.x == 0;
  if (first_thread) atomicAdd(reinterpret_cast<unsigned long long*>(kernel_counter), 1ull);
  if (*enable == 0) return;
  const i64 requested = *num_valid;
  const i64 active = requested < 0 ? 0 : (requested > capacity ? capacity : requested);
  // Every entry in [0, active) counts, slot-0 ones included, so one add of `active` is the whole sum.
  if (first_thread && active > 0) atomicAdd(reinterpret_cast<unsigned long long*>(slot_counter), (u64)active);

  const kvc::RealKvSources sources = KVC_REAL_KV_SOURCES;
  int bits_seen = 0;
  const i64 per_block = (active + gridDim.x - 1) / gridDim.x;
  const i64 lo = (i64)blockIdx.x * per_block;
  const i64 hi = active - lo < per_block ? active : lo + per_block;
  const kvc::EntryWalk walk = kvc::thread_entries(lo, hi);
  for (int ahead = 0; ahead < kvc::kPrefetchStrides; ++ahead) {
    kvc::prefetch_entry(canary, stride_words, num_slots, sources, slots, prev_slots, walk.begin + ahead * walk.step,
                        walk.end);
  }
  for (i64 k = walk.begin; k < walk.end; k += walk.step) {
    kvc::prefetch_entry(canary, stride_words, num_slots, sources, slots, prev_slots,
                        k + kvc::kPrefetchStrides * walk.step, walk.end);
    const i64 slot = slots[k];
    if (slot == 0) continue;
    if (slot < 0 || slot >= num_slots) {
      bits_seen |= kvc::kSlotOutOfRange;
      continue;
    }
    const i64 prev = prev_slots[k];
    const i64* fields = canary + slot * stride_words;
    if (twin != nullptr && prev < num_slots && kvc::same_record(fields, twin + slot * stride_words) &&
        (prev <= 0 || kvc::same_record(canary + prev * stride_words, twin + prev * stride_words))) {
      continue;  // the twin's verify gave this entry the verdict it would get here
    }
    const i64 stored_token = fields[kvc::kFieldToken];
    const i64 stored_position = fields[kvc::kFieldPosition];
    const i64 stored_chain = fields[kvc::kFieldPrevHash];
    const i64 stored_real_kv = fields[kvc::kFieldRealKvHash];
    const i64 expected_token = check_token ? expected_tokens[k] : -1;

    bool reachable = prev != 0;
    if (prev >= num_slots) {
      bits_seen |= kvc::kSlotOutOfRange;
      reachable = false;
    }
    const i64 expected_chain = reachable ? (i64)kvc::slot_hash(canary, stride_words, prev) : stored_chain;
    const i64 expected_real_kv = (i64)kvc::real_kv_fold(sources, slot);

    i64 reasons = 0;
    if (reachable && stored_chain != expected_chain) reasons |= kvc::kVerifyChainHash;
    if (check_token && expected_token != -1 && stored_token != expected_token) reasons |= kvc::kVerifyToken;
    if (stored_position != expected_positions[k]) reasons |= kvc::kVerifyPosition;
    if (stored_real_kv != expected_real_kv) reasons |= kvc::kVerifyRealKv;
    if (reasons) {
      const i64 row[kvc::kViolationFields] = {kernel_kind,    slot,         stored_position, stored_token,
                                               expected_token, stored_chain, expected_chain,  reasons};
      kvc::append_violation(ring, ring_capacity, write_index, row);
    }
  }
  if (bits_seen) atomicOr(status, bits_seen);
}
