// CUDA shim for compiling kernel sources with g++ and running them on the host.
//
// Included before the kernel text of every host-compiled module. It deliberately includes no standard
// header: NVRTC compiles the same kernels without any, so a kernel that needs `<cstdint>` here would fail on
// the GPU path. Overload sets (atomics, min/max, shuffles, __ldg) copy CUDA's, so g++ accepts and rejects
// the same calls that NVRTC does and picks the same overloads for mixed argument types.
//
// The first part (the runtime ABI) is also included by kvc_host_runtime.cpp with KVC_HOST_RUNTIME_BUILD
// defined, so both sides of every call are checked against one declaration.
#ifndef KVC_HOST_CUDA_H
#define KVC_HOST_CUDA_H

// ---- types shared with the runtime ------------------------------------------------------------------------

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// Per OS thread (each runs whole blocks); trivially constructible, so no TLS init wrapper is needed.
struct kvc_host_regs_t {
    uint3 thread_idx;
    uint3 block_idx;
    uint3 block_dim;
    uint3 grid_dim;
};

// One row per kernel of a module, produced by kvc_host_register.h. kinds[i]: KVC_HOST_PARAM_*.
struct kvc_host_kernel_entry {
    const char* name;
    void (*invoke)(void** args);
    int num_params;
    const int* sizes;
    const int* kinds;
};

#define KVC_HOST_PARAM_INTEGER 0
#define KVC_HOST_PARAM_FLOAT 1
#define KVC_HOST_PARAM_OTHER 2
#define KVC_HOST_PARAM_POINTER 3

// Block barrier flavours (kvc_host_block_sync `op`).
#define KVC_HOST_BAR_PLAIN 0
#define KVC_HOST_BAR_COUNT 1
#define KVC_HOST_BAR_OR 2
#define KVC_HOST_BAR_AND 3

// Warp operations (kvc_host_warp_sync `op`) and shuffle modes (PTX shfl.sync .idx/.up/.down/.bfly).
#define KVC_HOST_WARP_SYNC 0
#define KVC_HOST_WARP_SHFL32 1
#define KVC_HOST_WARP_SHFL64 2
#define KVC_HOST_WARP_BALLOT 3
#define KVC_HOST_WARP_ANY 4
#define KVC_HOST_WARP_ALL 5
#define KVC_HOST_WARP_ACTIVE 6
#define KVC_HOST_SHFL_IDX 0
#define KVC_HOST_SHFL_UP 1
#define KVC_HOST_SHFL_DOWN 2
#define KVC_HOST_SHFL_XOR 3

// Value a shuffle returns when it reads a lane that did not take part (CUDA: undefined). It matches the
// shared-memory poison word, so both kinds of stale read look alike in a failing test.
#define KVC_HOST_POISON_WORD 0x7FF5A5A5u
#define KVC_HOST_POISON_DWORD 0x7FF5A5A57FF5A5A5ull

// Largest dynamic shared memory a launch may ask for: the sm_90 opt-in limit (227 KiB).
#define KVC_HOST_MAX_DYNAMIC_SMEM 232448

// Hidden visibility lets every reference bind inside the module: each module links its own runtime copy,
// so two loaded modules never share (or interpose) threadIdx, barriers or shared memory.
#pragma GCC visibility push(hidden)
extern "C" {
// Per OS thread: every worker of the block pool runs whole blocks with its own registers, shared memory
// and fiber scheduler.
extern thread_local kvc_host_regs_t kvc_host_regs;
extern thread_local char* kvc_host_dynamic_smem;
extern unsigned int kvc_host_tsan_fence_word;  // see __threadfence (ThreadSanitizer builds only)

int kvc_host_block_sync(int op, int pred, int line, const char* file);
unsigned long long kvc_host_warp_sync(int op, unsigned int mask, unsigned long long value, int mode, int arg,
                                      int width, int line, const char* file);
void kvc_host_track_shared(void* addr, unsigned long long size);
void* kvc_host_shared_alloc(unsigned long long size, unsigned long long align);
[[noreturn]] void kvc_host_trap(int line, const char* file);
long long kvc_host_clock64(void);
const kvc_host_kernel_entry* kvc_host_module_kernels(int* count);

// Same declaration as glibc's <assert.h>, so a kernel that includes it still lands in the runtime's
// definition (hidden, hence bound inside the module) instead of aborting the Python process.
[[noreturn]] void __assert_fail(const char* assertion, const char* file, unsigned int line,
                                const char* function) noexcept;
}
#pragma GCC visibility pop

#ifndef KVC_HOST_RUNTIME_BUILD
// ---- kernel-facing part ------------------------------------------------------------------------------------

typedef __SIZE_TYPE__ size_t;

extern "C" {
int printf(const char* __restrict format, ...) __attribute__((format(printf, 1, 2)));
void* memcpy(void* __restrict dst, const void* __restrict src, size_t n) noexcept;
void* memset(void* dst, int value, size_t n) noexcept;
}

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
// Host-side `__shared__` is a thread_local static: one copy per module and OS thread, shared by the fibers of
// the block that thread is running (each worker of the pool runs whole blocks, one after another). The
// Python side rewrites `static __shared__` to `__shared__`, turns `extern __shared__ T x[];` into a
// thread_local pointer to this thread's kvc_host_dynamic_smem, and follows every other `__shared__`
// declaration with KVC_HOST_TRACK_SHARED so the runtime can poison the variable before each block. The
// tracking flag is thread_local too: every worker registers its own copy on first use.
#define __shared__ static thread_local

#define KVC_HOST_TRACK_SHARED(var) \
    [[maybe_unused]] static thread_local const bool kvc_host_shared_tracked_##var = \
        (::kvc_host_track_shared(static_cast<void*>(&(var)), sizeof(var)), true);

// AddressSanitizer builds: the declared name is a reference to a per-thread heap block (redzoned, tracked
// and poisoned like the thread_local it replaces, whose renamed storage only lends its type).
template <typename T>
inline T* kvc_host_heap_shared(T*) {
    return static_cast<T*>(::kvc_host_shared_alloc(sizeof(T), alignof(T)));
}
#define KVC_HOST_HEAP_SHARED(var) \
    static thread_local auto& var = *::kvc_host_heap_shared(&kvc_host_shared_storage_##var);

// threadIdx and friends read the running OS thread's register block (thread_local: each worker of the pool
// runs its own block), which the scheduler reloads from the fiber record after every switch, since all
// fibers of a block share one OS thread. Read-only: a const lvalue, or a dim3 prvalue for the dimensions.
#define threadIdx (static_cast<const uint3&>(::kvc_host_regs.thread_idx))
#define blockIdx (static_cast<const uint3&>(::kvc_host_regs.block_idx))
#define blockDim (::dim3(::kvc_host_regs.block_dim))
#define gridDim (::dim3(::kvc_host_regs.grid_dim))
inline constexpr int warpSize = 32;

// Every call that may switch fibers is wrapped in compiler barriers: `__shared__` statics whose address
// never escapes could otherwise be cached in registers across the call, since g++ can prove an external
// function does not touch them.
#define KVC_HOST_CLOBBER() __asm__ __volatile__("" ::: "memory")

// ---- vector types (alignment as in CUDA's vector_types.h) -----------------------------------------------------
struct __attribute__((aligned(8))) int2 { int x, y; };
struct int3 { int x, y, z; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned int x, y; };
struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; };
struct __attribute__((aligned(16))) longlong2 { long long x, y; };
struct __attribute__((aligned(16))) ulonglong2 { unsigned long long x, y; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct float3 { float x, y, z; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(16))) double2 { double x, y; };

inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int3 make_int3(int x, int y, int z) { return int3{x, y, z}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
inline longlong2 make_longlong2(long long x, long long y) { return longlong2{x, y}; }
inline ulonglong2 make_ulonglong2(unsigned long long x, unsigned long long y) { return ulonglong2{x, y}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float3 make_float3(float x, float y, float z) { return float3{x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline double2 make_double2(double x, double y) { return double2{x, y}; }

// ---- block synchronisation -------------------------------------------------------------------------------------
// The call site (line, file) identifies the barrier: threads of one block waiting at two different
// __syncthreads can never meet, which the runtime reports as a deadlock.
inline void __syncthreads(int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    KVC_HOST_CLOBBER();
    kvc_host_block_sync(KVC_HOST_BAR_PLAIN, 0, line, file);
    KVC_HOST_CLOBBER();
}
inline int __syncthreads_count(int pred, int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    KVC_HOST_CLOBBER();
    int r = kvc_host_block_sync(KVC_HOST_BAR_COUNT, pred != 0, line, file);
    KVC_HOST_CLOBBER();
    return r;
}
inline int __syncthreads_or(int pred, int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    KVC_HOST_CLOBBER();
    int r = kvc_host_block_sync(KVC_HOST_BAR_OR, pred != 0, line, file);
    KVC_HOST_CLOBBER();
    return r;
}
inline int __syncthreads_and(int pred, int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    KVC_HOST_CLOBBER();
    int r = kvc_host_block_sync(KVC_HOST_BAR_AND, pred != 0, line, file);
    KVC_HOST_CLOBBER();
    return r;
}

// Blocks of a launch run on several OS threads, so a fence is a real sequentially consistent fence: it
// orders this thread's plain accesses around the relaxed atomics below, as __threadfence does on a GPU.
// ThreadSanitizer does not model standalone fences (g++ rejects them under -fsanitize=thread): there a fence
// is a sequentially consistent read-modify-write of one word shared by all fences, which orders at least as
// much as a fence does, so TSan sees every ordering a fence provides and reports no race a fence prevents.
#if defined(__SANITIZE_THREAD__)
#define KVC_HOST_FENCE() static_cast<void>(__atomic_fetch_add(&kvc_host_tsan_fence_word, 0u, __ATOMIC_SEQ_CST))
#else
#define KVC_HOST_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif
inline void __threadfence() { KVC_HOST_FENCE(); }
inline void __threadfence_block() { KVC_HOST_FENCE(); }
inline void __threadfence_system() { KVC_HOST_FENCE(); }

// ---- warp-level primitives -------------------------------------------------------------------------------------
inline unsigned long long kvc_host_warp_call(int op, unsigned int mask, unsigned long long value, int mode,
                                             int arg, int width, int line, const char* file) {
    KVC_HOST_CLOBBER();
    unsigned long long r = kvc_host_warp_sync(op, mask, value, mode, arg, width, line, file);
    KVC_HOST_CLOBBER();
    return r;
}

inline void __syncwarp(unsigned int mask = 0xffffffffu, int line = __builtin_LINE(),
                       const char* file = __builtin_FILE()) {
    kvc_host_warp_call(KVC_HOST_WARP_SYNC, mask, 0, 0, 0, 32, line, file);
}

template <typename T>
inline T kvc_host_shfl(unsigned int mask, T var, int mode, int arg, int width, int line, const char* file) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 4- or 8-byte values");
    unsigned long long bits = 0;
    __builtin_memcpy(&bits, &var, sizeof(T));
    bits = kvc_host_warp_call(sizeof(T) == 4 ? KVC_HOST_WARP_SHFL32 : KVC_HOST_WARP_SHFL64, mask, bits, mode, arg,
                              width, line, file);
    T out;
    __builtin_memcpy(&out, &bits, sizeof(T));
    return out;
}

// CUDA's overload set: int, unsigned int, long, unsigned long, long long, unsigned long long, float, double.
#define KVC_HOST_SHUFFLES(T)                                                                                    \
    inline T __shfl_sync(unsigned int mask, T var, int srcLane, int width = warpSize,                            \
                         int line = __builtin_LINE(), const char* file = __builtin_FILE()) {                     \
        return kvc_host_shfl<T>(mask, var, KVC_HOST_SHFL_IDX, srcLane, width, line, file);                       \
    }                                                                                                            \
    inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize,                  \
                            int line = __builtin_LINE(), const char* file = __builtin_FILE()) {                  \
        return kvc_host_shfl<T>(mask, var, KVC_HOST_SHFL_UP, static_cast<int>(delta), width, line, file);        \
    }                                                                                                            \
    inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize,                \
                              int line = __builtin_LINE(), const char* file = __builtin_FILE()) {                \
        return kvc_host_shfl<T>(mask, var, KVC_HOST_SHFL_DOWN, static_cast<int>(delta), width, line, file);      \
    }                                                                                                            \
    inline T __shfl_xor_sync(unsigned int mask, T var, int laneMask, int width = warpSize,                       \
                             int line = __builtin_LINE(), const char* file = __builtin_FILE()) {                 \
        return kvc_host_shfl<T>(mask, var, KVC_HOST_SHFL_XOR, laneMask, width, line, file);                      \
    }
KVC_HOST_SHUFFLES(int)
KVC_HOST_SHUFFLES(unsigned int)
KVC_HOST_SHUFFLES(long)
KVC_HOST_SHUFFLES(unsigned long)
KVC_HOST_SHUFFLES(long long)
KVC_HOST_SHUFFLES(unsigned long long)
KVC_HOST_SHUFFLES(float)
KVC_HOST_SHUFFLES(double)
#undef KVC_HOST_SHUFFLES

inline unsigned int __ballot_sync(unsigned int mask, int pred, int line = __builtin_LINE(),
                                  const char* file = __builtin_FILE()) {
    return static_cast<unsigned int>(kvc_host_warp_call(KVC_HOST_WARP_BALLOT, mask, pred != 0, 0, 0, 32, line, file));
}
// Votes are over the non-exited lanes named in mask, as in CUDA.
inline int __any_sync(unsigned int mask, int pred, int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    return static_cast<int>(kvc_host_warp_call(KVC_HOST_WARP_ANY, mask, pred != 0, 0, 0, 32, line, file));
}
inline int __all_sync(unsigned int mask, int pred, int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    return static_cast<int>(kvc_host_warp_call(KVC_HOST_WARP_ALL, mask, pred != 0, 0, 0, 32, line, file));
}
// Fibers have no hardware convergence, so the calling lane first lets its warp settle: it waits until every
// other non-exited lane of the warp is blocked (at a barrier or warp operation) or also in __activemask, and
// gets the set of lanes in __activemask. After `if (lane >= 16) return;` that is 0x0000ffff, as on a GPU.
inline unsigned int __activemask(int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    return static_cast<unsigned int>(kvc_host_warp_call(KVC_HOST_WARP_ACTIVE, 0xffffffffu, 0, 0, 0, 32, line, file));
}

// ---- bit manipulation ----------------------------------------------------------------------------------------------
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline unsigned long long __brevll(unsigned long long x) {
    unsigned long long r = 0;
    for (int i = 0; i < 64; ++i) r |= ((x >> i) & 1ull) << (63 - i);
    return r;
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b) { return static_cast<int>((static_cast<long long>(a) * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline long long __mul64hi(long long a, long long b) {
    return static_cast<long long>((static_cast<__int128>(a) * b) >> 64);
}
inline int __float_as_int(float x) { int r; __builtin_memcpy(&r, &x, 4); return r; }
inline unsigned int __float_as_uint(float x) { unsigned int r; __builtin_memcpy(&r, &x, 4); return r; }
inline float __int_as_float(int x) { float r; __builtin_memcpy(&r, &x, 4); return r; }
inline float __uint_as_float(unsigned int x) { float r; __builtin_memcpy(&r, &x, 4); return r; }
inline long long __double_as_longlong(double x) { long long r; __builtin_memcpy(&r, &x, 8); return r; }
inline double __longlong_as_double(long long x) { double r; __builtin_memcpy(&r, &x, 8); return r; }

// ---- min / max: CUDA's overload set (mixed signedness picks the unsigned overload, as in CUDA) --------------------
#define KVC_HOST_MINMAX(R, A, B) \
    inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
    inline R max(A a, B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
KVC_HOST_MINMAX(int, int, int)
KVC_HOST_MINMAX(unsigned int, unsigned int, unsigned int)
KVC_HOST_MINMAX(unsigned int, int, unsigned int)
KVC_HOST_MINMAX(unsigned int, unsigned int, int)
KVC_HOST_MINMAX(long, long, long)
KVC_HOST_MINMAX(unsigned long, unsigned long, unsigned long)
KVC_HOST_MINMAX(unsigned long, long, unsigned long)
KVC_HOST_MINMAX(unsigned long, unsigned long, long)
KVC_HOST_MINMAX(long long, long long, long long)
KVC_HOST_MINMAX(unsigned long long, unsigned long long, unsigned long long)
KVC_HOST_MINMAX(unsigned long long, long long, unsigned long long)
KVC_HOST_MINMAX(unsigned long long, unsigned long long, long long)
KVC_HOST_MINMAX(float, float, float)
KVC_HOST_MINMAX(double, double, double)
KVC_HOST_MINMAX(double, float, double)
KVC_HOST_MINMAX(double, double, float)
#undef KVC_HOST_MINMAX
inline unsigned int umin(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int umax(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }

// ---- atomics: CUDA's overload sets ----------------------------------------------------------------------------------
// Blocks of a launch run on a pool of OS threads, so every read-modify-write is a real __atomic builtin,
// relaxed as CUDA's atomics are (ordering comes from __threadfence, as on the GPU).
#define KVC_HOST_RELAXED __ATOMIC_RELAXED
template <typename T, typename F>
inline T kvc_host_atomic_update(T* address, F update) {
    T old = __atomic_load_n(address, KVC_HOST_RELAXED);
    while (!__atomic_compare_exchange_n(address, &old, update(old), false, KVC_HOST_RELAXED, KVC_HOST_RELAXED)) {
    }
    return old;
}
template <typename T, typename U, typename F>
inline T kvc_host_atomic_update_float(T* address, F update) {
    U* bits = reinterpret_cast<U*>(address);
    U old_bits = __atomic_load_n(bits, KVC_HOST_RELAXED);
    for (;;) {
        T old_value;
        __builtin_memcpy(&old_value, &old_bits, sizeof(T));
        T new_value = update(old_value);
        U new_bits;
        __builtin_memcpy(&new_bits, &new_value, sizeof(T));
        if (__atomic_compare_exchange_n(bits, &old_bits, new_bits, false, KVC_HOST_RELAXED, KVC_HOST_RELAXED)) {
            return old_value;
        }
    }
}

inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, KVC_HOST_RELAXED); }
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) { return __atomic_fetch_add(a, v, KVC_HOST_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    return __atomic_fetch_add(a, v, KVC_HOST_RELAXED);
}
inline float atomicAdd(float* a, float v) {
    return kvc_host_atomic_update_float<float, unsigned int>(a, [v](float o) { return o + v; });
}
inline double atomicAdd(double* a, double v) {
    return kvc_host_atomic_update_float<double, unsigned long long>(a, [v](double o) { return o + v; });
}

inline int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, KVC_HOST_RELAXED); }
inline unsigned int atomicSub(unsigned int* a, unsigned int v) { return __atomic_fetch_sub(a, v, KVC_HOST_RELAXED); }

inline int atomicExch(int* a, int v) { return __atomic_exchange_n(a, v, KVC_HOST_RELAXED); }
inline unsigned int atomicExch(unsigned int* a, unsigned int v) { return __atomic_exchange_n(a, v, KVC_HOST_RELAXED); }
inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) {
    return __atomic_exchange_n(a, v, KVC_HOST_RELAXED);
}
inline float atomicExch(float* a, float v) {
    return kvc_host_atomic_update_float<float, unsigned int>(a, [v](float) { return v; });
}

#define KVC_HOST_ATOMIC_MINMAX(T)                                                                        \
    inline T atomicMin(T* a, T v) { return kvc_host_atomic_update(a, [v](T o) { return v < o ? v : o; }); } \
    inline T atomicMax(T* a, T v) { return kvc_host_atomic_update(a, [v](T o) { return v > o ? v : o; }); }
KVC_HOST_ATOMIC_MINMAX(int)
KVC_HOST_ATOMIC_MINMAX(unsigned int)
KVC_HOST_ATOMIC_MINMAX(long long)
KVC_HOST_ATOMIC_MINMAX(unsigned long long)
#undef KVC_HOST_ATOMIC_MINMAX

inline unsigned int atomicInc(unsigned int* a, unsigned int v) {
    return kvc_host_atomic_update(a, [v](unsigned int o) { return o >= v ? 0u : o + 1u; });
}
inline unsigned int atomicDec(unsigned int* a, unsigned int v) {
    return kvc_host_atomic_update(a, [v](unsigned int o) { return (o == 0u || o > v) ? v : o - 1u; });
}

#define KVC_HOST_ATOMIC_BITS(T)                                                                   \
    inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, KVC_HOST_RELAXED); }           \
    inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, KVC_HOST_RELAXED); }             \
    inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, KVC_HOST_RELAXED); }
KVC_HOST_ATOMIC_BITS(int)
KVC_HOST_ATOMIC_BITS(unsigned int)
KVC_HOST_ATOMIC_BITS(unsigned long long)
#undef KVC_HOST_ATOMIC_BITS

#define KVC_HOST_ATOMIC_CAS(T)                                                                       \
    inline T atomicCAS(T* a, T compare, T v) {                                                        \
        __atomic_compare_exchange_n(a, &compare, v, false, KVC_HOST_RELAXED, KVC_HOST_RELAXED);       \
        return compare;                                                                               \
    }
KVC_HOST_ATOMIC_CAS(int)
KVC_HOST_ATOMIC_CAS(unsigned int)
KVC_HOST_ATOMIC_CAS(unsigned long long)
#undef KVC_HOST_ATOMIC_CAS

// ---- read-only loads ------------------------------------------------------------------------------------------------
#define KVC_HOST_LDG(T) \
    inline T __ldg(const T* p) { return *p; }
KVC_HOST_LDG(char)
KVC_HOST_LDG(signed char)
KVC_HOST_LDG(short)
KVC_HOST_LDG(int)
KVC_HOST_LDG(long)
KVC_HOST_LDG(long long)
KVC_HOST_LDG(unsigned char)
KVC_HOST_LDG(unsigned short)
KVC_HOST_LDG(unsigned int)
KVC_HOST_LDG(unsigned long)
KVC_HOST_LDG(unsigned long long)
KVC_HOST_LDG(float)
KVC_HOST_LDG(double)
KVC_HOST_LDG(int2)
KVC_HOST_LDG(int4)
KVC_HOST_LDG(uint2)
KVC_HOST_LDG(uint4)
KVC_HOST_LDG(longlong2)
KVC_HOST_LDG(ulonglong2)
KVC_HOST_LDG(float2)
KVC_HOST_LDG(float4)
KVC_HOST_LDG(double2)
#undef KVC_HOST_LDG

// ---- traps, assertions, clocks -------------------------------------------------------------------------------------
[[noreturn]] inline void __trap(int line = __builtin_LINE(), const char* file = __builtin_FILE()) {
    kvc_host_trap(line, file);
}

#undef assert
#ifdef NDEBUG
#define assert(e) (static_cast<void>(0))
#else
#define assert(e) \
    (static_cast<bool>(e) ? static_cast<void>(0) : ::__assert_fail(#e, __FILE__, __LINE__, __PRETTY_FUNCTION__))
#endif

// Monotonic nanoseconds, not SM cycles: enough for the relative timings kernels take with it.
inline long long clock64() { return kvc_host_clock64(); }

#endif  // KVC_HOST_RUNTIME_BUILD
#endif  // KVC_HOST_CUDA_H
