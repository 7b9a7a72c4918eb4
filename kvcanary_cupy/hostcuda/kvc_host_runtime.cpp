// Host runtime for CUDA kernels compiled with g++: fibers, barriers, warp exchange, launcher, C ABI.
//
// Model. The blocks of a grid run on OS threads: the calling thread plus up to threads - 1 workers of the
// process's shared pool (kvc_host_pool.cpp); each OS thread takes the next block index from a shared counter
// and runs that block to its end. A launch of a single block, or with threads = 1, runs on the calling
// thread alone. Everything a block needs (the fiber scheduler, fiber stacks, the register block behind
// threadIdx, __shared__ variables and dynamic shared memory) is per OS thread and per module, so workers
// never share scheduler state; blocks talk only through global memory and the kernels' atomics, which are
// real __atomic operations. Launches of one module are serialised (one launch mutex per module), and one
// launch at a time has the pool's workers. The threads of a block are cooperative fibers that run until
// they block: a fiber keeps the CPU until it waits at a barrier, a warp
// operation or exits, then hands over directly to the next runnable fiber (the scheduler context only sees
// the end of a block, an abort or a deadlock). A fiber becomes runnable again only when the barrier it waits
// on completes: its wait condition is stored in its record and the completing fiber queues exactly the
// waiters, so a still-blocked fiber is never resumed. When the run queue is empty while some fiber has not
// exited, no fiber can ever run again: that is a deadlock and the launch fails.
//
// Semantics chosen where CUDA leaves freedom:
//  * __syncthreads waits for the threads of the block that have not exited (exited threads count as
//    arrived, as on sm_70+ hardware in practice). All waiting threads must be at the same call site and
//    flavour; threads waiting at two different __syncthreads can never meet, so that is reported at once.
//  * Warp operations (__syncwarp, shuffles, votes) complete when every non-exited lane named in the mask has
//    reached an operation of the same kind with the same mask. Lanes that exited (or do not exist in a
//    partial last warp) are not waited for; reading one with a shuffle returns the poison word. A mask that
//    leaves out the calling lane, or an invalid shuffle width, aborts the launch.
//  * Shuffle source lanes follow PTX shfl.sync (segment mask and clamp as CUDA's __shfl_*_sync build them).
//  * __activemask waits until the other non-exited lanes of its warp are blocked (or in __activemask too)
//    and returns the lanes in __activemask: fibers have no hardware convergence to report.
//
// Warp exchange. Each warp operation is one barrier: a lane deposits its operand in its fiber record, and
// the lane that completes the operation computes every participant's result into that participant's record
// before any of them runs again. Deposit and result are separate slots, so a fast lane that goes on to its
// next shuffle cannot overwrite a value a slow lane has not read yet (the double buffer of a GPU exchange).
// Block and warp barriers count completed instances (generation), which deadlock reports quote.
//
// Abort paths (__trap, a failed device assert, a bad mask, a deadlock) never unwind with C++ exceptions:
// the failing fiber records a message and switches to the scheduler context for good; the scheduler then
// reclaims every fiber stack of the block and returns the message through the C ABI. With several workers
// a failure at block b lets every block below b finish and starts none above it, so the launch reports the
// failure of the lowest failing block, exactly the one a single thread would have stopped at.
#define KVC_HOST_RUNTIME_BUILD 1
#include "kvc_host_cuda.h"
#include "kvc_host_pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__x86_64__) && !defined(KVC_HOST_USE_UCONTEXT)
#define KVC_HOST_ASM_SWITCH 1
#else
#define KVC_HOST_ASM_SWITCH 0
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define KVC_HOST_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define KVC_HOST_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__)
#define KVC_HOST_TSAN 1
#include <sanitizer/tsan_interface.h>
#else
#define KVC_HOST_TSAN 0
#endif

// printf of a double needs about 13 KB of stack; ASan's redzones make every frame several times larger.
#ifndef KVC_HOST_STACK_KB
#if KVC_HOST_ASAN
#define KVC_HOST_STACK_KB 256
#else
#define KVC_HOST_STACK_KB 64
#endif
#endif

#define KVC_HOST_EXPORT extern "C" __attribute__((visibility("default")))

thread_local kvc_host_regs_t kvc_host_regs;
thread_local char* kvc_host_dynamic_smem;
unsigned int kvc_host_tsan_fence_word;

namespace {

constexpr size_t kStackSize = static_cast<size_t>(KVC_HOST_STACK_KB) * 1024;
// A one-page guard let a large frame jump straight into the neighbouring stack; 64 KiB does not.
constexpr size_t kGuardSize = 64 * 1024;
// Stacks at a fixed power-of-two stride would put every fiber's hot top-of-stack lines in the same cache
// sets; one extra page per slot and a sub-page offset (kColorStep per page number) spread them out.
constexpr size_t kColorPage = 4096;
constexpr size_t kColorStep = 128;
constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kMaxWarps = kMaxThreads / 32;
constexpr unsigned kStacksPerChunk = 32;
constexpr unsigned kMaxStacks = kMaxThreads + kStacksPerChunk;
constexpr unsigned kMaxChunks = kMaxStacks / kStacksPerChunk;
// Most OS threads one launch may use (the calling thread included).
constexpr unsigned kMaxWorkers = 256;

enum FiberState : unsigned char { kNew, kQueued, kRunning, kBlocked, kDone };
enum WaitKind : unsigned char { kWaitNone, kWaitBlock, kWaitWarp };
enum WarpOp : int {
    kOpSync = KVC_HOST_WARP_SYNC,
    kOpShfl32 = KVC_HOST_WARP_SHFL32,
    kOpShfl64 = KVC_HOST_WARP_SHFL64,
    kOpBallot = KVC_HOST_WARP_BALLOT,
    kOpAny = KVC_HOST_WARP_ANY,
    kOpAll = KVC_HOST_WARP_ALL,
    kOpActive = KVC_HOST_WARP_ACTIVE,
};

struct Fiber {
#if KVC_HOST_ASM_SWITCH
    void* sp;
#else
    ucontext_t uc;
#endif
    char* stack;  // lowest usable byte; null while the fiber holds no stack
    // AddressSanitizer bookkeeping: fake-stack slot and the bounds announced when switching to this context.
    void* fake_stack;
    const void* bounds_bottom;
    size_t bounds_size;
    // ThreadSanitizer's record of this context (null while the fiber holds no stack).
    void* tsan_fiber;

    uint3 tid;
    unsigned linear, lane, warp;
    FiberState state;
    WaitKind wait;

    // What the fiber waits in (block barrier or warp operation) and what it contributed to it.
    int op;
    unsigned mask;
    int line;
    const char* file;
    unsigned long long value;
    int mode, arg, width;
    unsigned long long result;
};

struct Warp {
    unsigned live;     // lanes that exist and have not exited
    unsigned pending;  // lanes waiting in a warp operation
    unsigned active;   // lanes waiting in __activemask (a subset of pending)
    unsigned long long generation;
};

struct BlockBarrier {
    bool open;
    int op;
    int line;
    const char* file;
    unsigned arrived;
    unsigned preds;
    int result;
    unsigned long long generation;
    unsigned nwaiters;
    unsigned short waiters[kMaxThreads];
};

struct SharedVar {
    void* addr;
    size_t size;
};

// Everything one OS thread needs to run blocks; one per thread that ever ran a block of this module.
struct State {
    Fiber main;  // the scheduler context: the OS thread running blocks (the caller or a pool worker)
    Fiber dead;  // save slot for switches away from a fiber that will never run again
    Fiber* cur;
    Fiber* prev;
    char* pending_free;  // stack of a fiber that exited; released by whoever runs next
    void* pending_tsan;  // ThreadSanitizer fiber of a context that will never run again

    char* free_stacks[kMaxStacks];
    unsigned free_count;
    unsigned total_stacks;
    void* chunks[kMaxChunks];
    unsigned nchunks;
    char* smem;  // this thread's dynamic shared memory (kvc_host_dynamic_smem points here)

    const kvc_host_kernel_entry* kernel;
    void** args;
    unsigned nthreads;
    unsigned alive;
    unsigned done;
    bool failed;
    char error[2048];
    bool listed[kMaxThreads];  // scratch of report_deadlock

    Fiber fibers[kMaxThreads];
    Warp warps[kMaxWarps];
    BlockBarrier bar;
    unsigned short runq[kMaxThreads];
    unsigned rq_head;
    unsigned rq_count;

    SharedVar* shared;
    unsigned shared_count;
    unsigned shared_cap;

    unsigned long long stat_switches;
    unsigned long long stat_fiber_starts;
    unsigned long long stat_blocks;
    State* next_state;  // registry of live states (stats)
    bool pool_worker;   // this state's thread is a pool worker (not a launching thread)
};

thread_local State* g;
pthread_mutex_t g_launch_mutex = PTHREAD_MUTEX_INITIALIZER;

// ---- context switch -----------------------------------------------------------------------------------------

#if KVC_HOST_ASM_SWITCH
// Saves the callee-saved general registers on the current stack, stores the stack pointer in *save_sp, and
// resumes the context whose stack pointer is next_sp. A new context is a hand-built frame whose return
// address is kvc_host_fiber_entry. The MXCSR and x87 control words, callee-saved too, are deliberately
// left alone: kernel code has no <cfenv> and cannot change them, so every fiber runs with the launching
// thread's settings, and ldmxcsr/fldcw would triple the cost of a switch.
extern "C" void kvc_host_switch_asm(void** save_sp, void* next_sp);
__asm__(R"(
    .pushsection .text
    .p2align 4
    .globl kvc_host_switch_asm
    .hidden kvc_host_switch_asm
    .type kvc_host_switch_asm, @function
kvc_host_switch_asm:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvc_host_switch_asm, .-kvc_host_switch_asm
    .popsection
)");
#endif

}  // namespace

extern "C" __attribute__((visibility("hidden"), noreturn)) void kvc_host_fiber_entry();

namespace {

#define KVC_HOST_INLINE inline __attribute__((always_inline))

KVC_HOST_INLINE void after_switch();

// Leaves the current context for `to`. `dying`: the current fiber will never be resumed, so ASan gets a
// null fake-stack slot and the registers go to a static save slot (never the dying fiber's own stack).
KVC_HOST_INLINE void switch_to(Fiber* to, bool dying) {
    Fiber* from = g->cur;
    g->prev = from;
    g->cur = to;
    ++g->stat_switches;
    Fiber* save = dying ? &g->dead : from;
#if KVC_HOST_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &from->fake_stack, to->bounds_bottom, to->bounds_size);
#endif
#if KVC_HOST_TSAN
    // A synchronising switch: everything the fiber did happens before what the next one does, as a block
    // barrier orders it on the GPU. A dying fiber's record is destroyed once we are off its stack.
    if (dying && from != &g->main) {
        g->pending_tsan = from->tsan_fiber;
        from->tsan_fiber = nullptr;
    }
    __tsan_switch_to_fiber(to->tsan_fiber, 0);
#endif
#if KVC_HOST_ASM_SWITCH
    kvc_host_switch_asm(&save->sp, to->sp);
#else
    swapcontext(&save->uc, &to->uc);
#endif
    after_switch();
}

void release_stack(char* stack) { g->free_stacks[g->free_count++] = stack; }

// Runs first in every context that has just been switched to.
KVC_HOST_INLINE void after_switch() {
#if KVC_HOST_ASAN
    const void* bottom = nullptr;
    size_t size = 0;
    __sanitizer_finish_switch_fiber(g->cur->fake_stack, &bottom, &size);
    // Launches may come from different OS threads, so the scheduler's stack is re-learnt on every entry
    // from it rather than once.
    if (g->prev == &g->main && g->cur != &g->main) {
        g->main.bounds_bottom = bottom;
        g->main.bounds_size = size;
    }
#endif
    if (g->pending_free != nullptr) {
        release_stack(g->pending_free);
        g->pending_free = nullptr;
    }
#if KVC_HOST_TSAN
    if (g->pending_tsan != nullptr) {
        __tsan_destroy_fiber(g->pending_tsan);
        g->pending_tsan = nullptr;
    }
#endif
    if (g->cur != &g->main) kvc_host_regs.thread_idx = g->cur->tid;
}

char* acquire_stack() {
    char* stack = g->free_stacks[--g->free_count];
#if KVC_HOST_ASAN
    // Frames of fibers that exited or were abandoned by an abort leave poisoned redzones behind.
    ASAN_UNPOISON_MEMORY_REGION(stack, kStackSize);
#endif
    return stack;
}

bool ensure_stacks(unsigned want) {
    const size_t per = kGuardSize + kColorPage + kStackSize;
    while (g->total_stacks < want) {
        void* mem = mmap(nullptr, per * kStacksPerChunk, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                         -1, 0);
        if (mem == MAP_FAILED) return false;
        g->chunks[g->nchunks++] = mem;
        char* base = static_cast<char*>(mem);
        for (unsigned i = 0; i < kStacksPerChunk; ++i) {
            char* stack = base + i * per + kGuardSize + kColorPage;  // the guard sits below: stacks grow down
            if (mprotect(stack, kStackSize, PROT_READ | PROT_WRITE) != 0) return false;
            release_stack(stack);
        }
        g->total_stacks += kStacksPerChunk;
    }
    return true;
}

void start_fiber(Fiber* f) {
    f->stack = acquire_stack();
    f->fake_stack = nullptr;
    f->bounds_bottom = f->stack;
    f->bounds_size = kStackSize;
#if KVC_HOST_TSAN
    f->tsan_fiber = __tsan_create_fiber(0);
#endif
    ++g->stat_fiber_starts;
#if KVC_HOST_ASM_SWITCH
    const size_t color = (reinterpret_cast<uintptr_t>(f->stack) >> 12 & 31u) * kColorStep;
    void** sp = reinterpret_cast<void**>(f->stack + kStackSize - color);
    *--sp = nullptr;  // return address seen by kvc_host_fiber_entry: ends frame-pointer unwinding
    *--sp = reinterpret_cast<void*>(&kvc_host_fiber_entry);  // consumed by the `ret` of the switch
    for (int i = 0; i < 6; ++i) *--sp = nullptr;             // rbp rbx r12 r13 r14 r15
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = kStackSize;
    f->uc.uc_link = nullptr;
    makecontext(&f->uc, kvc_host_fiber_entry, 0);
    // libasan's swapcontext interceptor clears the shadow of uc_stack, which would erase the redzones of
    // the suspended frames of this fiber on every switch; the stack is only needed by makecontext.
    f->uc.uc_stack.ss_sp = nullptr;
    f->uc.uc_stack.ss_size = 0;
#endif
}

// ---- run queue ----------------------------------------------------------------------------------------------

KVC_HOST_INLINE void runq_push(Fiber* f) {
    g->runq[(g->rq_head + g->rq_count) % kMaxThreads] = static_cast<unsigned short>(f->linear);
    ++g->rq_count;
}

KVC_HOST_INLINE Fiber* runq_pop() {
    if (g->rq_count == 0) return nullptr;
    Fiber* f = &g->fibers[g->runq[g->rq_head]];
    g->rq_head = (g->rq_head + 1) % kMaxThreads;
    --g->rq_count;
    return f;
}

// Switches to the next runnable fiber, or to the scheduler when there is none.
KVC_HOST_INLINE void run_next(bool dying) {
    Fiber* next = runq_pop();
    if (next == nullptr) {
        switch_to(&g->main, dying);
        return;
    }
    if (next->state == kNew) start_fiber(next);
    next->state = kRunning;
#if KVC_HOST_ASM_SWITCH
    // Fibers of a block cycle through the queue; fetching the saved frame of the one after `next` hides
    // part of the cache miss its switch would otherwise take.
    if (g->rq_count != 0) {
        const Fiber* after = &g->fibers[g->runq[g->rq_head]];
        if (after->state != kNew) __builtin_prefetch(after->sp);
    }
#endif
    switch_to(next, dying);
}

KVC_HOST_INLINE void make_runnable(Fiber* f) {
    // Only a completed wait may queue a fiber; anything else is a scheduler bug that would resume a
    // fiber twice and corrupt its stack.
    if (f->state != kBlocked) {
        fprintf(stderr, "kvc_host: internal scheduler error (fiber %u queued in state %d)\n", f->linear,
                static_cast<int>(f->state));
        abort();
    }
    f->wait = kWaitNone;
    f->state = kQueued;
    runq_push(f);
}

bool try_complete_active(unsigned warp);

KVC_HOST_INLINE void block_current(WaitKind wait) {
    Fiber* f = g->cur;
    f->state = kBlocked;
    f->wait = wait;
    // Lanes of this warp waiting in __activemask may have been waiting for this one to settle.
    const unsigned active = g->warps[f->warp].active;
    if (active != 0 && (active >> f->lane & 1u) == 0) try_complete_active(f->warp);
    run_next(false);
}

// ---- failure reporting ----------------------------------------------------------------------------------------

// Appends printf-style text to a fixed buffer, truncating silently.
struct Message {
    char* buf;
    size_t cap;
    size_t len;

    __attribute__((format(printf, 2, 3))) void put(const char* fmt, ...) {
        if (len + 1 >= cap) return;
        va_list ap;
        va_start(ap, fmt);
        int m = vsnprintf(buf + len, cap - len, fmt, ap);
        va_end(ap);
        if (m > 0) len = static_cast<size_t>(m) < cap - len ? len + static_cast<size_t>(m) : cap - 1;
    }
    void put_where(const Fiber* f) {
        const kvc_host_regs_t& r = kvc_host_regs;
        put("kernel '%s' block (%u,%u,%u)", g->kernel->name, r.block_idx.x, r.block_idx.y, r.block_idx.z);
        if (f != nullptr) put(" thread (%u,%u,%u)", f->tid.x, f->tid.y, f->tid.z);
    }
};

// Records the first failure of the launch, prefixed with the kernel, block and (in a fiber) thread.
__attribute__((format(printf, 1, 2))) void set_error(const char* fmt, ...) {
    if (g->failed) return;
    g->failed = true;
    Message m{g->error, sizeof(g->error), 0};
    m.put_where(g->cur != &g->main && g->cur != nullptr ? g->cur : nullptr);
    m.put(": ");
    if (m.len + 1 < m.cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m.buf + m.len, m.cap - m.len, fmt, ap);
        va_end(ap);
    }
}

// Ends the launch from inside a fiber: the fiber is abandoned and the scheduler cleans up.
[[noreturn]] void abort_launch() {
    switch_to(&g->main, true);
    __builtin_unreachable();
}

const char* block_op_name(int op) {
    switch (op) {
        case KVC_HOST_BAR_COUNT: return "__syncthreads_count";
        case KVC_HOST_BAR_OR: return "__syncthreads_or";
        case KVC_HOST_BAR_AND: return "__syncthreads_and";
        default: return "__syncthreads";
    }
}

const char* warp_op_name(int op, int mode) {
    switch (op) {
        case kOpSync: return "__syncwarp";
        case kOpBallot: return "__ballot_sync";
        case kOpAny: return "__any_sync";
        case kOpAll: return "__all_sync";
        case kOpActive: return "__activemask";
        default:
            switch (mode) {
                case KVC_HOST_SHFL_UP: return "__shfl_up_sync";
                case KVC_HOST_SHFL_DOWN: return "__shfl_down_sync";
                case KVC_HOST_SHFL_XOR: return "__shfl_xor_sync";
                default: return "__shfl_sync";
            }
    }
}

bool same_site(int line_a, const char* file_a, int line_b, const char* file_b) {
    return line_a == line_b && (file_a == file_b || strcmp(file_a, file_b) == 0);
}

// Lanes of `warp` that the warp operation of fiber f still waits for.
unsigned missing_lanes(const Fiber* f) {
    const Warp& w = g->warps[f->warp];
    const Fiber* lanes = &g->fibers[f->warp * 32];
    if (f->op == kOpActive) {
        unsigned unsettled = 0;
        for (unsigned bits = w.live & ~w.active; bits != 0; bits &= bits - 1) {
            if (lanes[__builtin_ctz(bits)].state != kBlocked) unsettled |= 1u << __builtin_ctz(bits);
        }
        return unsettled;
    }
    unsigned need = f->mask & w.live;
    unsigned here = 0;
    for (unsigned bits = need; bits != 0; bits &= bits - 1) {
        unsigned l = static_cast<unsigned>(__builtin_ctz(bits));
        if ((w.pending >> l & 1u) && lanes[l].op == f->op && lanes[l].mask == f->mask) here |= 1u << l;
    }
    return need & ~here;
}

// Called by the scheduler when the run queue is empty but some fibers have not exited.
void report_deadlock() {
    Message m{g->error, sizeof(g->error), 0};
    m.put_where(nullptr);
    m.put(": deadlock, no thread can make progress;");
    bool* listed = g->listed;
    memset(listed, 0, sizeof(g->listed));
    int groups = 0;
    for (unsigned i = 0; i < g->nthreads; ++i) {
        const Fiber& f = g->fibers[i];
        if (f.state != kBlocked || listed[i]) continue;
        unsigned count = 0;
        for (unsigned j = i; j < g->nthreads; ++j) {
            const Fiber& o = g->fibers[j];
            if (o.state == kBlocked && !listed[j] && o.wait == f.wait && o.op == f.op && o.mask == f.mask &&
                same_site(o.line, o.file, f.line, f.file)) {
                listed[j] = true;
                ++count;
            }
        }
        if (++groups > 4) {
            m.put(" ...");
            break;
        }
        m.put(" thread (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z);
        if (count > 1) m.put(" and %u more", count - 1);
        if (f.wait == kWaitBlock) {
            m.put(" wait%s at %s (%s:%d) after %llu completed block barriers;", count > 1 ? "" : "s",
                  block_op_name(f.op), f.file, f.line, g->bar.generation);
        } else {
            m.put(" wait%s in %s(mask=0x%08x) (%s:%d) for lanes 0x%08x of warp %u after %llu completed warp "
                  "operations;", count > 1 ? "" : "s", warp_op_name(f.op, f.mode), f.mask, f.file, f.line,
                  missing_lanes(&f), f.warp, g->warps[f.warp].generation);
        }
    }
}

// ---- block barrier --------------------------------------------------------------------------------------------

void complete_block_barrier() {
    BlockBarrier& b = g->bar;
    switch (b.op) {
        case KVC_HOST_BAR_COUNT: b.result = static_cast<int>(b.preds); break;
        case KVC_HOST_BAR_OR: b.result = b.preds != 0; break;
        case KVC_HOST_BAR_AND: b.result = b.preds == b.arrived; break;
        default: b.result = 0; break;
    }
    b.open = false;
    ++b.generation;
    for (unsigned i = 0; i < b.nwaiters; ++i) make_runnable(&g->fibers[b.waiters[i]]);
    b.nwaiters = 0;
}

// ---- warp operations ------------------------------------------------------------------------------------------

// Source lane of a shuffle, as PTX shfl.sync computes it from the operand b and the packed c operand that
// CUDA's __shfl_*_sync build for `width` (segment mask (32 - width), clamp 31, or 0 for .up).
unsigned shuffle_source(unsigned lane, int mode, int arg, int width) {
    const unsigned segmask = static_cast<unsigned>(32 - width) & 31u;
    const unsigned clamp = mode == KVC_HOST_SHFL_UP ? 0u : 31u;
    const unsigned b = static_cast<unsigned>(arg) & 31u;
    const int max_lane = static_cast<int>((lane & segmask) | (clamp & ~segmask));
    const int min_lane = static_cast<int>(lane & segmask);
    int j;
    bool valid;
    switch (mode) {
        case KVC_HOST_SHFL_UP:
            j = static_cast<int>(lane) - static_cast<int>(b);
            valid = j >= max_lane;
            break;
        case KVC_HOST_SHFL_DOWN:
            j = static_cast<int>(lane + b);
            valid = j <= max_lane;
            break;
        case KVC_HOST_SHFL_XOR:
            j = static_cast<int>(lane ^ b);
            valid = j <= max_lane;
            break;
        default:
            j = min_lane | static_cast<int>(b & ~segmask);
            valid = j <= max_lane;
            break;
    }
    return valid ? static_cast<unsigned>(j) : lane;
}

// Completes the warp operation (op, mask) if every non-exited lane named in mask waits in it.
bool try_complete_warp(unsigned warp, unsigned mask, int op) {
    Warp& w = g->warps[warp];
    Fiber* lanes = &g->fibers[warp * 32];
    const unsigned need = mask & w.live;
    if ((w.pending & need) != need) return false;
    for (unsigned bits = need; bits != 0; bits &= bits - 1) {
        const Fiber& f = lanes[__builtin_ctz(bits)];
        if (f.op != op || f.mask != mask) return false;
    }
    if (op == kOpShfl32 || op == kOpShfl64) {
        const unsigned long long poison = op == kOpShfl32 ? KVC_HOST_POISON_WORD : KVC_HOST_POISON_DWORD;
        for (unsigned bits = need; bits != 0; bits &= bits - 1) {
            Fiber& f = lanes[__builtin_ctz(bits)];
            unsigned src = shuffle_source(f.lane, f.mode, f.arg, f.width);
            f.result = (need >> src & 1u) ? lanes[src].value : poison;
        }
    } else if (op != kOpSync) {
        unsigned ballot = 0;
        for (unsigned bits = need; bits != 0; bits &= bits - 1) {
            unsigned l = static_cast<unsigned>(__builtin_ctz(bits));
            if (lanes[l].value != 0) ballot |= 1u << l;
        }
        unsigned long long r = op == kOpBallot ? ballot : op == kOpAny ? ballot != 0 : ballot == need;
        for (unsigned bits = need; bits != 0; bits &= bits - 1) lanes[__builtin_ctz(bits)].result = r;
    }
    w.pending &= ~need;
    ++w.generation;
    for (unsigned bits = need; bits != 0; bits &= bits - 1) {
        Fiber* f = &lanes[__builtin_ctz(bits)];
        if (f != g->cur) make_runnable(f);
    }
    return true;
}

// A lane exited: operations that named it may now have all their remaining lanes.
void retry_warp_after_exit(unsigned warp, unsigned lane_bit) {
    Warp& w = g->warps[warp];
    Fiber* lanes = &g->fibers[warp * 32];
    for (unsigned l = 0; l < 32; ++l) {
        if ((w.pending >> l & 1u) && lanes[l].op != kOpActive && (lanes[l].mask & lane_bit)) {
            try_complete_warp(warp, lanes[l].mask, lanes[l].op);
        }
    }
}

// Completes __activemask once every other non-exited lane of the warp is blocked.
bool try_complete_active(unsigned warp) {
    Warp& w = g->warps[warp];
    Fiber* lanes = &g->fibers[warp * 32];
    for (unsigned bits = w.live & ~w.active; bits != 0; bits &= bits - 1) {
        if (lanes[__builtin_ctz(bits)].state != kBlocked) return false;
    }
    const unsigned active = w.active;
    w.active = 0;
    w.pending &= ~active;
    ++w.generation;
    for (unsigned bits = active; bits != 0; bits &= bits - 1) {
        Fiber* f = &lanes[__builtin_ctz(bits)];
        f->result = active;
        if (f != g->cur) make_runnable(f);
    }
    return true;
}

// The current fiber's kernel function returned. Returns the fiber that now owns this stack and must run the
// kernel from the start, or does not return (the stack is released and the next fiber resumed).
Fiber* thread_exit() {
    Fiber* f = g->cur;
    f->state = kDone;
    ++g->done;
    --g->alive;
    const unsigned bit = 1u << f->lane;
    g->warps[f->warp].live &= ~bit;
    if (g->warps[f->warp].pending != 0) retry_warp_after_exit(f->warp, bit);
    if (g->warps[f->warp].active != 0) try_complete_active(f->warp);
    if (g->bar.open && g->bar.arrived == g->alive) complete_block_barrier();
    // A thread that has not started yet can take over this stack without a switch: a kernel that never
    // synchronises then costs two switches per block, not two per thread.
    if (g->rq_count != 0 && g->fibers[g->runq[g->rq_head]].state == kNew) {
        Fiber* next = runq_pop();
        next->stack = f->stack;
        next->fake_stack = nullptr;
        next->bounds_bottom = f->bounds_bottom;
        next->bounds_size = f->bounds_size;
        // Same stack, same frames: ThreadSanitizer's shadow stack carries over with the record.
        next->tsan_fiber = f->tsan_fiber;
        f->tsan_fiber = nullptr;
        next->state = kRunning;
        f->stack = nullptr;
        g->cur = next;
        kvc_host_regs.thread_idx = next->tid;
        ++g->stat_fiber_starts;
        return next;
    }
    g->pending_free = f->stack;
    f->stack = nullptr;
    run_next(true);
    __builtin_unreachable();
}

// ---- shared memory poison -------------------------------------------------------------------------------------

// The pattern follows the address, so every aligned 4- or 8-byte read sees the poison word (a NaN as float
// and as double, 2146805157 as int32) wherever the variable starts.
void poison_fill(void* addr, size_t size) {
    unsigned char* p = static_cast<unsigned char*>(addr);
    unsigned char* end = p + size;
    const unsigned long long dword = KVC_HOST_POISON_DWORD;
    while (p < end && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
        *p = static_cast<unsigned char>(KVC_HOST_POISON_WORD >> (8 * (reinterpret_cast<uintptr_t>(p) & 3u)));
        ++p;
    }
    for (; end - p >= 8; p += 8) memcpy(p, &dword, 8);
    for (; p < end; ++p) {
        *p = static_cast<unsigned char>(KVC_HOST_POISON_WORD >> (8 * (reinterpret_cast<uintptr_t>(p) & 3u)));
    }
}

void poison_shared(size_t dynamic_bytes) {
    for (unsigned i = 0; i < g->shared_count; ++i) poison_fill(g->shared[i].addr, g->shared[i].size);
    poison_fill(g->smem, dynamic_bytes);
}

// ---- block and launch -----------------------------------------------------------------------------------------

void reclaim_stacks() {
    for (unsigned i = 0; i < g->nthreads; ++i) {
        Fiber& f = g->fibers[i];
        if (f.stack != nullptr) {
            release_stack(f.stack);
            f.stack = nullptr;
        }
#if KVC_HOST_TSAN
        if (f.tsan_fiber != nullptr) {
            __tsan_destroy_fiber(f.tsan_fiber);
            f.tsan_fiber = nullptr;
        }
#endif
    }
}

bool run_block(size_t dynamic_bytes) {
    const dim3 bd = kvc_host_regs.block_dim;
    const unsigned n = g->nthreads;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = g->fibers[i];
        f.tid = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
        f.linear = i;
        f.lane = i % 32;
        f.warp = i / 32;
        f.state = kNew;
        f.wait = kWaitNone;
        f.stack = nullptr;
        f.tsan_fiber = nullptr;
        f.mask = 0;
        f.op = -1;
        g->runq[i] = static_cast<unsigned short>(i);
    }
    for (unsigned w = 0; w * 32 < n; ++w) {
        unsigned lanes = n - w * 32 >= 32 ? 32 : n - w * 32;
        g->warps[w].live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
        g->warps[w].pending = 0;
        g->warps[w].active = 0;
        g->warps[w].generation = 0;
    }
    g->bar.open = false;
    g->bar.nwaiters = 0;
    g->bar.generation = 0;
    g->rq_head = 0;
    g->rq_count = n;
    g->alive = n;
    g->done = 0;
    poison_shared(dynamic_bytes);
    ++g->stat_blocks;

    g->cur = &g->main;
#if KVC_HOST_TSAN
    g->main.tsan_fiber = __tsan_get_current_fiber();
#endif
    run_next(false);
    // Back on the scheduler: the block finished, aborted, or nothing can run any more.
    if (!g->failed && g->done != n) {
        report_deadlock();
        g->failed = true;
    }
    reclaim_stacks();
    return !g->failed;
}

const kvc_host_kernel_entry* kernel_table(int* count) { return kvc_host_module_kernels(count); }

// ---- per-thread state ---------------------------------------------------------------------------------------

pthread_mutex_t g_states_mutex = PTHREAD_MUTEX_INITIALIZER;
State* g_states;  // every live State, for the counters
// Counters of states whose threads have exited, and of launches (one launch spans several states).
unsigned long long g_retired[4];
unsigned long long g_launches;
pthread_key_t g_state_key;
pthread_once_t g_state_key_once = PTHREAD_ONCE_INIT;

// Runs when a thread that ran blocks exits (a Python thread that launched, or a pool worker at fork).
void destroy_state(void* p) {
    State* s = static_cast<State*>(p);
    pthread_mutex_lock(&g_states_mutex);
    for (State** link = &g_states; *link != nullptr; link = &(*link)->next_state) {
        if (*link == s) {
            *link = s->next_state;
            break;
        }
    }
    g_retired[0] += s->stat_switches;
    g_retired[1] += s->stat_fiber_starts;
    g_retired[2] += s->stat_blocks;
    if (s->pool_worker) g_retired[3] += s->stat_blocks;
    pthread_mutex_unlock(&g_states_mutex);
    const size_t per = kGuardSize + kColorPage + kStackSize;
    for (unsigned i = 0; i < s->nchunks; ++i) munmap(s->chunks[i], per * kStacksPerChunk);
    free(s->shared);
    free(s->smem);
    free(s);
}

void make_state_key() { pthread_key_create(&g_state_key, destroy_state); }

// This OS thread's State, created on its first launch or first block.
bool ensure_state() {
    if (g != nullptr) return true;
    pthread_once(&g_state_key_once, make_state_key);
    State* s = static_cast<State*>(calloc(1, sizeof(State)));
    if (s == nullptr) return false;
    s->smem = static_cast<char*>(aligned_alloc(256, KVC_HOST_MAX_DYNAMIC_SMEM));
    if (s->smem == nullptr) {
        free(s);
        return false;
    }
    g = s;
    kvc_host_dynamic_smem = s->smem;
    pthread_setspecific(g_state_key, s);
    pthread_mutex_lock(&g_states_mutex);
    s->next_state = g_states;
    g_states = s;
    pthread_mutex_unlock(&g_states_mutex);
    return true;
}

// ---- one launch, run by one or more OS threads -----------------------------------------------------------------

struct Launch {
    const kvc_host_kernel_entry* kernel;
    void** args;
    uint3 grid;
    uint3 block;
    unsigned nthreads;
    size_t shmem;
    unsigned long long nblocks;
    unsigned long long next;     // next block index to hand out (__atomic)
    unsigned long long stop_at;  // lowest failing block so far, nblocks while none failed (__atomic)
    pthread_mutex_t error_mutex;
    unsigned long long error_block;
    char error[2048];
};

// Runs blocks of `l` on this thread until none is left or a lower block failed.
void run_blocks(Launch* l) {
    g->kernel = l->kernel;
    g->args = l->args;
    g->nthreads = l->nthreads;
    g->failed = false;
    g->error[0] = '\0';
    kvc_host_regs.grid_dim = l->grid;
    kvc_host_regs.block_dim = l->block;
#if KVC_HOST_ASAN
    // Dynamic shared memory beyond what the launch asked for is unaddressable, as on the GPU.
    ASAN_UNPOISON_MEMORY_REGION(g->smem, KVC_HOST_MAX_DYNAMIC_SMEM);
    ASAN_POISON_MEMORY_REGION(g->smem + l->shmem, KVC_HOST_MAX_DYNAMIC_SMEM - l->shmem);
#endif
    const unsigned long long gx = l->grid.x, gxy = gx * l->grid.y;
    for (;;) {
        const unsigned long long i = __atomic_fetch_add(&l->next, 1ull, __ATOMIC_RELAXED);
        if (i >= l->nblocks || i >= __atomic_load_n(&l->stop_at, __ATOMIC_RELAXED)) break;
        // x fastest, then y, then z: the order a single thread runs them in.
        kvc_host_regs.block_idx = uint3{static_cast<unsigned>(i % gx), static_cast<unsigned>(i / gx % l->grid.y),
                                        static_cast<unsigned>(i / gxy)};
        if (run_block(l->shmem)) continue;
        pthread_mutex_lock(&l->error_mutex);
        if (i < l->error_block) {
            l->error_block = i;
            memcpy(l->error, g->error, sizeof(l->error));
        }
        pthread_mutex_unlock(&l->error_mutex);
        unsigned long long seen = __atomic_load_n(&l->stop_at, __ATOMIC_RELAXED);
        while (i < seen && !__atomic_compare_exchange_n(&l->stop_at, &seen, i, false, __ATOMIC_RELAXED,
                                                        __ATOMIC_RELAXED)) {
        }
        g->failed = false;
        break;
    }
    g->cur = nullptr;
}

// ---- the worker pool ----------------------------------------------------------------------------------------
//
// The workers live in the shared pool library (kvc_host_pool.cpp), one pool for every module of a build
// flavour; the loader hands its function table to each module (kvc_host_abi_attach_pool). Without one,
// every launch runs on its calling thread.

const kvc_host_pool_api* g_pool_api;

// What a pool worker runs for a launch of this module: its blocks, with this module's state on its thread.
void pool_job(void* context) {
    Launch* l = static_cast<Launch*>(context);
    // A worker that cannot get memory simply does not help; the others (the caller at least) run the blocks.
    if (ensure_state() && ensure_stacks(l->nthreads)) {
        g->pool_worker = true;
        run_blocks(l);
    }
}

int launch_locked(int index, const unsigned* grid, const unsigned* block, unsigned long long shmem, void** args,
                  int threads, char* err, size_t errlen) {
    int count = 0;
    const kvc_host_kernel_entry* table = kernel_table(&count);
    if (index < 0 || index >= count) {
        snprintf(err, errlen, "no kernel with index %d in this module", index);
        return 1;
    }
    const kvc_host_kernel_entry* k = &table[index];
    const unsigned long long nthreads = static_cast<unsigned long long>(block[0]) * block[1] * block[2];
    if (block[0] == 0 || block[1] == 0 || block[2] == 0 || block[0] > 1024 || block[1] > 1024 || block[2] > 64 ||
        nthreads > kMaxThreads) {
        snprintf(err, errlen, "kernel '%s': invalid block (%u,%u,%u): each dimension >= 1, x,y <= 1024, z <= 64, "
                 "at most 1024 threads", k->name, block[0], block[1], block[2]);
        return 1;
    }
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 0x7fffffffu || grid[1] > 65535 ||
        grid[2] > 65535) {
        snprintf(err, errlen, "kernel '%s': invalid grid (%u,%u,%u)", k->name, grid[0], grid[1], grid[2]);
        return 1;
    }
    if (shmem > KVC_HOST_MAX_DYNAMIC_SMEM) {
        snprintf(err, errlen, "kernel '%s': %llu bytes of dynamic shared memory exceed the limit of %d", k->name,
                 shmem, KVC_HOST_MAX_DYNAMIC_SMEM);
        return 1;
    }
    if (!ensure_state()) {
        snprintf(err, errlen, "kernel '%s': out of memory for the block scheduler", k->name);
        return 1;
    }
    Launch l;
    l.kernel = k;
    l.args = args;
    l.grid = uint3{grid[0], grid[1], grid[2]};
    l.block = uint3{block[0], block[1], block[2]};
    l.nthreads = static_cast<unsigned>(nthreads);
    l.shmem = static_cast<size_t>(shmem);
    l.nblocks = static_cast<unsigned long long>(grid[0]) * grid[1] * grid[2];
    l.next = 0;
    l.stop_at = l.nblocks;
    l.error_mutex = PTHREAD_MUTEX_INITIALIZER;
    l.error_block = ~0ull;
    l.error[0] = '\0';
    ++g_launches;

    // Helpers beyond the caller: never more than there are blocks for them.
    unsigned long long want = threads > 1 ? static_cast<unsigned long long>(threads) - 1 : 0;
    if (want > kMaxWorkers - 1) want = kMaxWorkers - 1;
    if (want > l.nblocks - 1) want = l.nblocks - 1;
    unsigned helpers = static_cast<unsigned>(want);
    if (helpers != 0) helpers = g_pool_api != nullptr ? g_pool_api->open(pool_job, &l, helpers) : 0;
    if (!ensure_stacks(l.nthreads)) {
        // Only this thread's stacks are missing; helpers map their own. Stop handing out blocks.
        __atomic_store_n(&l.stop_at, 0ull, __ATOMIC_RELAXED);
        pthread_mutex_lock(&l.error_mutex);
        l.error_block = 0;
        snprintf(l.error, sizeof(l.error), "kernel '%s': cannot map %u fiber stacks", k->name, l.nthreads);
        pthread_mutex_unlock(&l.error_mutex);
    } else {
        run_blocks(&l);
    }
    if (helpers != 0) g_pool_api->close();
    pthread_mutex_destroy(&l.error_mutex);
    if (l.error_block != ~0ull) {
        snprintf(err, errlen, "%s", l.error);
        return 1;
    }
    return 0;
}

}  // namespace

// ---- entry points called from kernel code (hidden) ----------------------------------------------------------------

extern "C" void kvc_host_fiber_entry() {
    after_switch();
    for (;;) {
        g->kernel->invoke(g->args);
        thread_exit();
    }
}

extern "C" int kvc_host_block_sync(int op, int pred, int line, const char* file) {
    Fiber* f = g->cur;
    BlockBarrier& b = g->bar;
    if (!b.open) {
        b.open = true;
        b.op = op;
        b.line = line;
        b.file = file;
        b.arrived = 0;
        b.preds = 0;
        b.nwaiters = 0;
    } else if (b.op != op || !same_site(b.line, b.file, line, file)) {
        set_error("deadlock: reached %s (%s:%d) while %u thread(s) wait at %s (%s:%d); every thread of a block "
                  "must reach the same barrier",
                  block_op_name(op), file, line, b.arrived, block_op_name(b.op), b.file, b.line);
        abort_launch();
    }
    ++b.arrived;
    b.preds += pred != 0;
    f->op = op;
    f->line = line;
    f->file = file;
    if (b.arrived == g->alive) {
        complete_block_barrier();
        return b.result;
    }
    b.waiters[b.nwaiters++] = static_cast<unsigned short>(f->linear);
    block_current(kWaitBlock);
    return g->bar.result;
}

extern "C" unsigned long long kvc_host_warp_sync(int op, unsigned int mask, unsigned long long value, int mode, int arg,
                                                 int width, int line, const char* file) {
    Fiber* f = g->cur;
    const unsigned bit = 1u << f->lane;
    if ((mask & bit) == 0) {
        set_error("invalid warp mask: %s(mask=0x%08x) (%s:%d) called by lane %u, which the mask leaves out",
                  warp_op_name(op, mode), mask, file, line, f->lane);
        abort_launch();
    }
    if ((op == kOpShfl32 || op == kOpShfl64) && (width < 1 || width > 32 || (width & (width - 1)) != 0)) {
        set_error("invalid width %d in %s (%s:%d): a power of two from 1 to 32 is required", width,
                  warp_op_name(op, mode), file, line);
        abort_launch();
    }
    f->op = op;
    f->mask = op == kOpActive ? bit : mask;
    f->value = value;
    f->mode = mode;
    f->arg = arg;
    f->width = width;
    f->line = line;
    f->file = file;
    Warp& w = g->warps[f->warp];
    w.pending |= bit;
    if (op == kOpActive) {
        w.active |= bit;
        if (!try_complete_active(f->warp)) block_current(kWaitWarp);
    } else if (!try_complete_warp(f->warp, mask, op)) {
        block_current(kWaitWarp);
    }
    return g->cur->result;
}

extern "C" void kvc_host_track_shared(void* addr, unsigned long long size) {
    for (unsigned i = 0; i < g->shared_count; ++i) {
        if (g->shared[i].addr == addr) return;
    }
    if (g->shared_count == g->shared_cap) {
        unsigned cap = g->shared_cap ? g->shared_cap * 2 : 16;
        void* grown = realloc(g->shared, cap * sizeof(SharedVar));
        if (grown == nullptr) {
            fprintf(stderr, "kvc_host: out of memory tracking __shared__ variables\n");
            abort();
        }
        g->shared = static_cast<SharedVar*>(grown);
        g->shared_cap = cap;
    }
    g->shared[g->shared_count++] = SharedVar{addr, static_cast<size_t>(size)};
    // First seen in the middle of a block: no thread can have touched it yet (its declaration has just run).
    poison_fill(addr, static_cast<size_t>(size));
}

// A heap block for one __shared__ variable of this thread (AddressSanitizer builds, see KVC_HOST_HEAP_SHARED):
// ASan surrounds it with redzones, which thread_local storage lacks. Never freed: one per variable and thread.
extern "C" void* kvc_host_shared_alloc(unsigned long long size, unsigned long long align) {
    const size_t a = align < 16 ? 16 : static_cast<size_t>(align);
    const size_t rounded = (static_cast<size_t>(size) + a - 1) / a * a;
    void* p = aligned_alloc(a, rounded == 0 ? a : rounded);
    if (p == nullptr) {
        fprintf(stderr, "kvc_host: out of memory for a __shared__ variable\n");
        abort();
    }
#if KVC_HOST_ASAN
    // The rounding tail is outside the variable: an access there is an overflow.
    if (rounded > size) ASAN_POISON_MEMORY_REGION(static_cast<char*>(p) + size, rounded - size);
#endif
    kvc_host_track_shared(p, size);
    return p;
}

extern "C" void kvc_host_trap(int line, const char* file) {
    if (g == nullptr || g->cur == nullptr || g->cur == &g->main) {
        fprintf(stderr, "kvc_host: __trap() outside a kernel launch (%s:%d)\n", file, line);
        abort();
    }
    set_error("__trap() called (%s:%d)", file, line);
    abort_launch();
}

extern "C" void __assert_fail(const char* assertion, const char* file, unsigned int line,
                              const char* function) noexcept {
    if (g == nullptr || g->cur == nullptr || g->cur == &g->main) {
        fprintf(stderr, "kvc_host: assertion `%s' failed outside a kernel launch (%s:%u)\n", assertion, file, line);
        abort();
    }
    set_error("device-side assertion `%s' failed (%s:%u in %s)", assertion, file, line, function);
    abort_launch();
}

extern "C" long long kvc_host_clock64(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// ---- C ABI for ctypes ---------------------------------------------------------------------------------------------

KVC_HOST_EXPORT int kvc_host_abi_version(void) { return 2; }

KVC_HOST_EXPORT int kvc_host_abi_sanitized(void) { return KVC_HOST_ASAN; }

KVC_HOST_EXPORT int kvc_host_abi_thread_sanitized(void) { return KVC_HOST_TSAN; }

KVC_HOST_EXPORT unsigned int kvc_host_abi_poison_word(void) { return KVC_HOST_POISON_WORD; }

KVC_HOST_EXPORT int kvc_host_abi_kernel_count(void) {
    int count = 0;
    kernel_table(&count);
    return count;
}

KVC_HOST_EXPORT const char* kvc_host_abi_kernel_name(int index) {
    int count = 0;
    const kvc_host_kernel_entry* table = kernel_table(&count);
    return index >= 0 && index < count ? table[index].name : nullptr;
}

// Fills up to `cap` parameter sizes and kinds (KVC_HOST_PARAM_*); returns the parameter count or -1.
KVC_HOST_EXPORT int kvc_host_abi_kernel_params(int index, int* sizes, int* kinds, int cap) {
    int count = 0;
    const kvc_host_kernel_entry* table = kernel_table(&count);
    if (index < 0 || index >= count) return -1;
    const kvc_host_kernel_entry& k = table[index];
    for (int i = 0; i < k.num_params && i < cap; ++i) {
        sizes[i] = k.sizes[i];
        kinds[i] = k.kinds[i];
    }
    return k.num_params;
}

// Runs kernel `index` on grid x block with the cuLaunchKernel-style argument array, on up to `threads` OS
// threads (the caller and threads - 1 pool workers). Returns 0, or 1 with a message in err. Launches are
// serialised: ctypes drops the GIL, and a launch owns the pool while it runs.
KVC_HOST_EXPORT int kvc_host_abi_launch(int index, const unsigned int* grid, const unsigned int* block,
                                        unsigned long long shared_bytes, void** args, int threads, char* err,
                                        unsigned long long errlen) {
    pthread_mutex_lock(&g_launch_mutex);
    int rc = launch_locked(index, grid, block, shared_bytes, args, threads, err, static_cast<size_t>(errlen));
    // Kernel printf goes through C stdio; flush so it appears before the launch returns, as after a
    // synchronising call on the GPU.
    fflush(stdout);
    pthread_mutex_unlock(&g_launch_mutex);
    return rc;
}

// Gives this module the shared worker pool (kvc_host_pool.cpp); 0, or 1 when the table's version differs.
KVC_HOST_EXPORT int kvc_host_abi_attach_pool(const kvc_host_pool_api* api) {
    if (api == nullptr || api->version != KVC_HOST_POOL_API_VERSION) return 1;
    pthread_mutex_lock(&g_launch_mutex);
    g_pool_api = api;
    pthread_mutex_unlock(&g_launch_mutex);
    return 0;
}

// Counters for tests and measurements, summed over every OS thread that ran blocks: switches, fiber starts,
// blocks, launches, stacks mapped, pool workers started, blocks run by pool workers.
KVC_HOST_EXPORT void kvc_host_abi_stats(unsigned long long* out) {
    pthread_mutex_lock(&g_launch_mutex);
    pthread_mutex_lock(&g_states_mutex);
    out[0] = g_retired[0];
    out[1] = g_retired[1];
    out[2] = g_retired[2];
    out[4] = 0;
    out[6] = g_retired[3];
    for (const State* st = g_states; st != nullptr; st = st->next_state) {
        out[0] += st->stat_switches;
        out[1] += st->stat_fiber_starts;
        out[2] += st->stat_blocks;
        out[4] += st->total_stacks;
        if (st->pool_worker) out[6] += st->stat_blocks;
    }
    out[3] = g_launches;
    pthread_mutex_unlock(&g_states_mutex);
    out[5] = g_pool_api != nullptr ? g_pool_api->workers() : 0;
    pthread_mutex_unlock(&g_launch_mutex);
}
