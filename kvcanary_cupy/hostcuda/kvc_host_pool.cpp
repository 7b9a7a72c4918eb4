// The process's pool of worker threads for host launches, shared by every host module of one build flavour.
//
// Why one library: each host module links its own copy of the runtime (kvc_host_runtime.cpp), so a pool in
// the runtime would give every module its own workers. The canary's step runs plan, write and verify, each
// from another module: with a pool per module, the workers of the module that just ran still spin for the
// next launch while the next module's workers start, and a 2-core machine has three busy threads for two
// cores. With one pool the same workers serve every module, and a worker spinning after the plan is the one
// that picks up the write.
//
// A job is a function and a context from a module: the module's runtime puts its launch in the context and
// a worker runs the module's own code (its thread-local block state, its fibers) on the worker's OS thread.
// One job runs at a time; a launch that finds the pool taken (a launch from another Python thread) runs its
// blocks on its calling thread alone.
//
// Protocol. kvc_host_pool_open publishes the job with a new epoch and wakes as many sleeping workers as it
// wants helpers; a worker joins only while the job is open, so the caller, once out of work, closes it in
// kvc_host_pool_close and waits just for the workers that joined (a worker the OS has not scheduled yet
// finds it closed, instead of holding the launch up).
//
// Waiting is a short spin, then a sleep. A worker that has just seen a job watches the epoch for g_spin_nanos
// before it sleeps on the condition variable, and the caller watches the count of running workers as long
// before it sleeps: the canary's launches come in bursts (the plan, write and verify of one step), and
// waking a sleeping thread (a futex wake; on a VM an interrupt to an idle virtual CPU) takes tens of
// microseconds, the order of a whole block of work. The spin yields the CPU between polls, so a thread with
// real work on the same core waits for at most one poll.
#include "kvc_host_pool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>

namespace {

constexpr long long kDefaultSpinNanos = 200000;
constexpr unsigned kMaxWorkers = 255;

// How long a waiting thread polls before it sleeps: KVCANARY_HOST_SPIN_US (0 to 1000000 microseconds), read
// when the library loads (before any worker exists). The Python loader refuses any other value before it
// loads a module; here anything else keeps the default.
long long g_spin_nanos = kDefaultSpinNanos;

void read_spin_setting() {
    const char* raw = getenv("KVCANARY_HOST_SPIN_US");
    if (raw == nullptr) return;
    char* end = nullptr;
    const long long us = strtoll(raw, &end, 10);
    if (end != raw && *end == '\0' && us >= 0 && us <= 1000000) g_spin_nanos = us * 1000;
}

long long monotonic_nanos() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<long long>(ts.tv_sec) * 1000000000ll + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Polls `word` until it differs from `value` (want_change) or equals it (!want_change), or g_spin_nanos pass.
void spin_on(const unsigned long long* word, unsigned long long value, bool want_change) {
    const long long until = monotonic_nanos() + g_spin_nanos;
    for (unsigned i = 1; (__atomic_load_n(word, __ATOMIC_ACQUIRE) != value) != want_change; ++i) {
        cpu_relax();
        if ((i & 63) == 0) {
            if (monotonic_nanos() > until) return;
            sched_yield();
        }
    }
}

struct Pool {
    pthread_mutex_t owner;  // held by the launch that uses the pool, from open to close
    pthread_mutex_t mutex;  // guards the fields below
    pthread_cond_t wake;
    pthread_cond_t done;
    unsigned nworkers;
    unsigned sleeping;           // workers waiting on `wake`
    unsigned long long epoch;    // bumped by each open (written under mutex, polled)
    kvc_host_pool_job job;       // null while no job is open
    void* context;
    unsigned helpers;            // workers the open job wants
    unsigned joined;             // workers that joined it so far
    unsigned long long running;  // workers still running it (written under mutex, polled)
};

Pool g_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
               PTHREAD_COND_INITIALIZER, 0, 0, 0, nullptr, nullptr, 0, 0, 0};

void* worker_main(void*) {
    pthread_mutex_lock(&g_pool.mutex);
    // Epochs start at 1: a worker created for the job that is already open joins it.
    unsigned long long seen = 0;
    bool may_spin = false;
    for (;;) {
        if (g_pool.job != nullptr && g_pool.epoch != seen && g_pool.joined < g_pool.helpers) {
            seen = g_pool.epoch;
            const kvc_host_pool_job job = g_pool.job;
            void* context = g_pool.context;
            ++g_pool.joined;
            __atomic_store_n(&g_pool.running, g_pool.running + 1, __ATOMIC_RELAXED);
            pthread_mutex_unlock(&g_pool.mutex);
            job(context);
            pthread_mutex_lock(&g_pool.mutex);
            __atomic_store_n(&g_pool.running, g_pool.running - 1, __ATOMIC_RELEASE);
            if (g_pool.running == 0) pthread_cond_signal(&g_pool.done);
            may_spin = true;
            continue;
        }
        if (g_pool.epoch != seen) {
            seen = g_pool.epoch;  // a job this worker missed (closed, or it had its helpers)
            may_spin = true;
        }
        if (may_spin) {
            may_spin = false;
            pthread_mutex_unlock(&g_pool.mutex);
            spin_on(&g_pool.epoch, seen, true);
            pthread_mutex_lock(&g_pool.mutex);
            continue;
        }
        ++g_pool.sleeping;
        pthread_cond_wait(&g_pool.wake, &g_pool.mutex);
        --g_pool.sleeping;
    }
    return nullptr;
}

// Grows the pool to `want` workers (best effort); called with the owner mutex held.
void grow_pool(unsigned want) {
    if (g_pool.nworkers >= want) return;
    // Workers never take signals: Python handles them on its main thread.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (g_pool.nworkers < want) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, nullptr) != 0) break;
        pthread_mutex_lock(&g_pool.mutex);
        ++g_pool.nworkers;
        pthread_mutex_unlock(&g_pool.mutex);
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

// The child of a fork has none of the parent's workers (and maybe a lock held by one of them).
void pool_after_fork() {
    const pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    const pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    g_pool.owner = fresh;
    g_pool.mutex = fresh;
    g_pool.wake = fresh_cond;
    g_pool.done = fresh_cond;
    g_pool.nworkers = g_pool.sleeping = 0;
    g_pool.job = nullptr;
    g_pool.context = nullptr;
    g_pool.helpers = g_pool.joined = 0;
    g_pool.running = 0;
}

__attribute__((constructor)) void initialise_pool() {
    read_spin_setting();
    pthread_atfork(nullptr, nullptr, pool_after_fork);
}

unsigned pool_open(kvc_host_pool_job job, void* context, unsigned helpers) {
    if (helpers == 0 || job == nullptr) return 0;
    if (pthread_mutex_trylock(&g_pool.owner) != 0) return 0;  // another launch has the pool: run alone
    if (helpers > kMaxWorkers) helpers = kMaxWorkers;
    grow_pool(helpers);
    pthread_mutex_lock(&g_pool.mutex);
    if (helpers > g_pool.nworkers) helpers = g_pool.nworkers;
    if (helpers == 0) {
        pthread_mutex_unlock(&g_pool.mutex);
        pthread_mutex_unlock(&g_pool.owner);
        return 0;
    }
    g_pool.job = job;
    g_pool.context = context;
    g_pool.helpers = helpers;
    g_pool.joined = 0;
    __atomic_store_n(&g_pool.epoch, g_pool.epoch + 1, __ATOMIC_RELEASE);
    // Spinning workers see the epoch; only sleeping ones need a wake-up.
    const unsigned wake = helpers < g_pool.sleeping ? helpers : g_pool.sleeping;
    if (wake == g_pool.sleeping) {
        if (wake != 0) pthread_cond_broadcast(&g_pool.wake);
    } else {
        for (unsigned i = 0; i < wake; ++i) pthread_cond_signal(&g_pool.wake);
    }
    pthread_mutex_unlock(&g_pool.mutex);
    return helpers;
}

void pool_close() {
    pthread_mutex_lock(&g_pool.mutex);
    g_pool.job = nullptr;  // closed: late workers no longer join
    g_pool.context = nullptr;
    const unsigned long long running = g_pool.running;
    pthread_mutex_unlock(&g_pool.mutex);
    // The workers that joined are at most one block behind the caller; spin for them before sleeping.
    if (running != 0) spin_on(&g_pool.running, 0, false);
    pthread_mutex_lock(&g_pool.mutex);
    while (g_pool.running != 0) pthread_cond_wait(&g_pool.done, &g_pool.mutex);
    pthread_mutex_unlock(&g_pool.mutex);
    pthread_mutex_unlock(&g_pool.owner);
}

unsigned pool_workers() {
    pthread_mutex_lock(&g_pool.mutex);
    const unsigned n = g_pool.nworkers;
    pthread_mutex_unlock(&g_pool.mutex);
    return n;
}

const kvc_host_pool_api g_api = {KVC_HOST_POOL_API_VERSION, pool_open, pool_close, pool_workers};

}  // namespace

extern "C" __attribute__((visibility("default"))) const kvc_host_pool_api* kvc_host_pool_api_get(void) {
    return &g_api;
}
