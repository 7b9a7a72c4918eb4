// kv-canary expected-token scatter (SPEC §6): pool[rp_r, 0:n] = int32(flat_in[offsets[r] : offsets[r] + n]),
// n = min(offsets[r+1] - offsets[r], pool_width).
//
// kvc_scatter  grid (X, Y), block B. Blocks grid-stride over requests along x and over column tiles of
//              B columns along y, so any grid covers any batch. A request whose pool row or token segment
//              lies outside its buffer writes nothing and, when `status` is non-null, sets
//              SCATTER_OUT_OF_RANGE there.
#include "canary_common.cuh"

extern "C" __global__ void kvc_scatter(const long long* __restrict__ flat_in, long long total,
                                       const long long* __restrict__ offsets,
                                       const long long* __restrict__ req_pool_indices, long long bs,
                                       int* __restrict__ pool, long long pool_rows, long long pool_width,
                                       int* __restrict__ status) {
  using kvc::i64;
  for (i64 r = blockIdx.x; r < bs; r += gridDim.x) {
    const i64 start = offsets[r];
    const i64 end = offsets[r + 1];
    if (!(end > start)) continue;
    const i64 rp = req_pool_indices[r];
    if (rp < 0 || rp >= pool_rows || start < 0 || end > total) {
      if (status != nullptr && blockIdx.y == 0 && threadIdx.x == 0) atomicOr(status, kvc::kScatterOutOfRange);
      continue;
    }
    const i64 n = end - start < pool_width ? end - start : pool_width;
    int* row = pool + rp * pool_width;
    for (i64 c = (i64)blockIdx.y * blockDim.x + threadIdx.x; c < n; c += (i64)gridDim.y * blockDim.x) {
      // Two's-complement truncation to int32, as the reference.
      row[c] = (int)(unsigned int)(unsigned long long)flat_in[start + c];
    }
  }
}
