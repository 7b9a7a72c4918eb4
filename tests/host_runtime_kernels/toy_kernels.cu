// Toy kernels for tests/test_host_runtime.py: each exercises one feature of the host runtime and writes
// results that the tests compare with values computed in Python. Plain CUDA C++ (NVRTC-compatible).

struct ToyParams {
    long long scale;
    int offset;
    int pad;
};

extern "C" __global__ void grid_stride_axpy(const long long* __restrict__ x, const long long* __restrict__ y,
                                            long long* __restrict__ out, long long a, long long n) {
    const long long stride = static_cast<long long>(blockDim.x) * gridDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = a * x[i] + y[i];
    }
}

// Inclusive scan of 4 * blockDim.x values by one block: per-thread serial scan of 4 items, then a
// Hillis-Steele scan of the per-thread totals in shared memory.
extern "C" __global__ void __launch_bounds__(1024) block_scan4(const long long* in, long long* out) {
    __shared__ long long totals[1024];
    const unsigned t = threadIdx.x;
    long long items[4];
    long long acc = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        acc += in[t * 4 + k];
        items[k] = acc;
    }
    totals[t] = acc;
    __syncthreads();
    for (unsigned off = 1; off < blockDim.x; off <<= 1) {
        const long long add = t >= off ? totals[t - off] : 0;
        __syncthreads();
        totals[t] += add;
        __syncthreads();
    }
    const long long prefix = t > 0 ? totals[t - 1] : 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) out[t * 4 + k] = items[k] + prefix;
}

template <typename T>
__device__ void shuffle_body(const T* in, T* out, int mode, int arg, int width) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const T v = in[i];
    T r;
    switch (mode) {
        case 0: r = __shfl_sync(0xffffffffu, v, arg, width); break;
        case 1: r = __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(arg), width); break;
        case 2: r = __shfl_down_sync(0xffffffffu, v, static_cast<unsigned>(arg), width); break;
        default: r = __shfl_xor_sync(0xffffffffu, v, arg, width); break;
    }
    out[i] = r;
}

extern "C" __global__ void shuffle_i32(const int* in, int* out, int mode, int arg, int width) {
    shuffle_body(in, out, mode, arg, width);
}
extern "C" __global__ void shuffle_u32(const unsigned* in, unsigned* out, int mode, int arg, int width) {
    shuffle_body(in, out, mode, arg, width);
}
extern "C" __global__ void shuffle_i64(const long long* in, long long* out, int mode, int arg, int width) {
    shuffle_body(in, out, mode, arg, width);
}
extern "C" __global__ void shuffle_u64(const unsigned long long* in, unsigned long long* out, int mode, int arg,
                                       int width) {
    shuffle_body(in, out, mode, arg, width);
}
extern "C" __global__ void shuffle_f32(const float* in, float* out, int mode, int arg, int width) {
    shuffle_body(in, out, mode, arg, width);
}
extern "C" __global__ void shuffle_f64(const double* in, double* out, int mode, int arg, int width) {
    shuffle_body(in, out, mode, arg, width);
}

// Warp sum with the default width (32) and a butterfly, plus the broadcast from lane 0.
extern "C" __global__ void warp_allreduce(const int* in, int* sums, int* firsts) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = in[i];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    sums[i] = v;
    firsts[i] = __shfl_sync(0xffffffffu, in[i], 0);
}

// Votes over the full warp, then over the lower half with a half mask (only lanes < 16 take part).
extern "C" __global__ void votes(const int* pred, unsigned* ballots, int* anys, int* alls, unsigned* half_ballots) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned lane = threadIdx.x & 31u;
    const int p = pred[i];
    ballots[i] = __ballot_sync(0xffffffffu, p);
    anys[i] = __any_sync(0xffffffffu, p);
    alls[i] = __all_sync(0xffffffffu, p);
    if (lane < 16) {
        half_ballots[i] = __ballot_sync(0x0000ffffu, p);
    } else {
        half_ballots[i] = 0;
    }
}

// Lanes >= 16 exit at once; the rest still use full masks (exited lanes named in a mask are not waited for,
// and a shuffle reading one returns the poison word).
extern "C" __global__ void half_warp_exits(const int* in, int* down16, int* xor1, unsigned* active) {
    const unsigned lane = threadIdx.x & 31u;
    if (lane >= 16) return;
    const int v = in[threadIdx.x];
    active[threadIdx.x] = __activemask();
    xor1[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 1);
    down16[threadIdx.x] = __shfl_down_sync(0xffffffffu, v, 16);
}

extern "C" __global__ void atomics(int* i32_counter, unsigned long long* u64_counter, float* f32_sum,
                                   double* f64_sum, int* max_min, unsigned* bits, unsigned* cas_counter,
                                   unsigned* wrap, unsigned* sub_counter, unsigned long long* last) {
    const unsigned gid = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(i32_counter, 1);
    atomicAdd(u64_counter, static_cast<unsigned long long>(gid));
    atomicAdd(f32_sum, 1.0f);
    atomicAdd(f64_sum, 0.5);
    atomicMax(&max_min[0], static_cast<int>(gid));
    atomicMin(&max_min[1], -static_cast<int>(gid));
    atomicOr(&bits[0], 1u << (gid % 32u));
    atomicAnd(&bits[1], ~(1u << (gid % 31u)));
    atomicXor(&bits[2], gid);
    unsigned seen = *cas_counter;
    for (;;) {
        const unsigned prev = atomicCAS(cas_counter, seen, seen + 2u);
        if (prev == seen) break;
        seen = prev;
    }
    atomicInc(wrap, 9u);
    atomicSub(sub_counter, 3u);
    atomicExch(last, 7ull);
}

// Reverses each block's slice through dynamic shared memory declared at namespace scope.
extern __shared__ long long dyn_buffer[];

extern "C" __global__ void dynamic_reverse(const long long* in, long long* out) {
    const unsigned base = blockIdx.x * blockDim.x;
    dyn_buffer[threadIdx.x] = in[base + threadIdx.x];
    __syncthreads();
    out[base + threadIdx.x] = dyn_buffer[blockDim.x - 1 - threadIdx.x];
}

// Reads shared memory (static, static in a template, dynamic) before writing it, then writes it, so every
// block must see the poison again.
template <int N>
__device__ int read_then_write_template(unsigned t) {
    __shared__ int tmpl[N];
    const int seen = tmpl[t % N];
    __syncthreads();
    tmpl[t % N] = 77;
    return seen;
}

extern "C" __global__ void poison_probe(int* seen_static, float* seen_float, int* seen_template, int* seen_dynamic) {
    static __shared__ int plain[64];
    __shared__ __align__(16) float as_float[64], second[2];
    extern __shared__ int dyn_words[];
    const unsigned t = threadIdx.x;
    const unsigned i = blockIdx.x * blockDim.x + t;
    seen_static[i] = plain[t];
    seen_float[i] = t < 2 ? second[t] : as_float[t];
    seen_dynamic[i] = dyn_words[t];
    seen_template[i] = read_then_write_template<32>(t);
    __syncthreads();
    plain[t] = 12345;
    as_float[t] = 1.0f;
    dyn_words[t] = 54321;
    second[t % 2] = 2.0f;
}

extern "C" __global__ void block_votes(const int* pred, int* results) {
    const int p = pred[threadIdx.x];
    const int count = __syncthreads_count(p);
    const int any = __syncthreads_or(p);
    const int all = __syncthreads_and(p);
    if (threadIdx.x == 0) {
        results[blockIdx.x * 3 + 0] = count;
        results[blockIdx.x * 3 + 1] = any;
        results[blockIdx.x * 3 + 2] = all;
    }
}

// Writes the linear thread and block ids seen through threadIdx/blockIdx in 3-D launches.
extern "C" __global__ void coordinates(unsigned* out) {
    const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
    const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    __syncthreads();  // threadIdx must survive fiber switches
    out[bid * threads + tid] = bid * 100000u + tid;
}

extern "C" __global__ void early_exit_warp(int* out) {
    if (threadIdx.x >= 32 && threadIdx.x < 64) return;  // exited threads do not hold up __syncthreads
    out[threadIdx.x] = 1;
    __syncthreads();
    out[threadIdx.x] += 1;
}

extern "C" __global__ void with_struct(__grid_constant__ const ToyParams p, const int* in, long long* out,
                                       double d, unsigned char flag) {
    out[threadIdx.x] = p.scale * in[threadIdx.x] + p.offset + static_cast<long long>(d) + flag;
}

extern "C" __global__ void no_params() {}

extern "C" __global__ void maybe_trap(int* out, int bad_block, int bad_thread) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
    __syncthreads();
    if (static_cast<int>(blockIdx.x) == bad_block && static_cast<int>(threadIdx.x) == bad_thread) __trap();
}

extern "C" __global__ void maybe_assert(const int* values, int limit) {
    const int v = values[threadIdx.x];
    assert(v < limit);
}

extern "C" __global__ void skip_barrier_warp(int* out) {
    __shared__ int s[64];
    s[threadIdx.x] = static_cast<int>(threadIdx.x);
    if (threadIdx.x / 32 != 1) __syncthreads();
    out[threadIdx.x] = s[63 - threadIdx.x];
    __syncthreads();
}

extern "C" __global__ void warp_vs_block_deadlock(int* out) {
    if (threadIdx.x == 0) {
        __syncwarp(0x3u);
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void bad_mask(int* out) {
    out[threadIdx.x] = __shfl_sync(0x1u, 5, 0);
}

extern "C" __global__ void hello_printf(int value) {
    if (threadIdx.x == 0) printf("hello from block %u value %d half %.1f\n", blockIdx.x, value, 0.5);
}

// Thread 0 of block 1 raises a flag; thread 0 of block 0 waits for it (up to timeout_ns of clock64) and
// records whether it came: only when the two blocks run at the same time on different OS threads. Both
// first bump *counter, with an atomic when `racy` is 0 and a plain read-modify-write otherwise (a data race
// between blocks, which ThreadSanitizer must report).
extern "C" __global__ void wait_for_block_one(int* flag, int* seen, int* counter, int racy, long long timeout_ns) {
    if (threadIdx.x != 0 || blockIdx.x > 1) return;
    if (racy) {
        *counter += 1;
    } else {
        atomicAdd(counter, 1);
    }
    if (blockIdx.x == 1) {
        atomicExch(flag, 1);
        return;
    }
    const long long start = clock64();
    while (atomicAdd(flag, 0) == 0 && clock64() - start < timeout_ns) {
    }
    *seen = atomicAdd(flag, 0);
}

// Every block scans its own 4 * blockDim.x values through shared memory and barriers, and adds its total
// to *grand with an atomic: per-OS-thread shared memory must never mix two blocks.
extern "C" __global__ void segmented_scan4(const long long* in, long long* out, unsigned long long* grand) {
    __shared__ long long totals[1024];
    const unsigned t = threadIdx.x;
    const long long* src = in + 4ull * blockIdx.x * blockDim.x;
    long long* dst = out + 4ull * blockIdx.x * blockDim.x;
    long long v[4];
    long long run = 0;
    for (int k = 0; k < 4; ++k) {
        run += src[4 * t + k];
        v[k] = run;
    }
    totals[t] = run;
    __syncthreads();
    for (unsigned offset = 1; offset < blockDim.x; offset *= 2) {
        const long long add = t >= offset ? totals[t - offset] : 0;
        __syncthreads();
        totals[t] += add;
        __syncthreads();
    }
    const long long before = t > 0 ? totals[t - 1] : 0;
    for (int k = 0; k < 4; ++k) dst[4 * t + k] = v[k] + before;
    if (t == blockDim.x - 1) atomicAdd(grand, static_cast<unsigned long long>(totals[t]));
}

// Thread 3 of every block from `first` on traps: whatever the OS threads, the launch must report `first`.
extern "C" __global__ void trap_from_block(int* out, int first) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
    __syncthreads();
    if (static_cast<int>(blockIdx.x) >= first && threadIdx.x == 3) __trap();
}
