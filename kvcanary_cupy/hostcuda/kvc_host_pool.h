// The shared worker pool of host launches (kvc_host_pool.cpp): the table of functions a module's runtime
// receives through kvc_host_abi_attach_pool.
#ifndef KVC_HOST_POOL_H
#define KVC_HOST_POOL_H

#define KVC_HOST_POOL_API_VERSION 1

extern "C" {

// Work a pool worker runs for an open job: the module's runtime runs blocks of its launch until none is left.
typedef void (*kvc_host_pool_job)(void* context);

struct kvc_host_pool_api {
    int version;  // KVC_HOST_POOL_API_VERSION
    // Opens `job` for up to `helpers` workers; returns how many may join (0: the pool is taken or has no
    // worker, run alone; then close must not be called). The caller then does its own share of the work.
    unsigned (*open)(kvc_host_pool_job job, void* context, unsigned helpers);
    // Closes the open job and returns once every worker that joined it has returned from `job`.
    void (*close)(void);
    // Workers started so far.
    unsigned (*workers)(void);
};

}

#endif
