// Kernel registration for host-compiled modules, included after the kernel text.
//
// It comes last so that the standard headers it needs (<type_traits>, <utility>) never become visible to
// kernel code, which must compile with NVRTC where they do not exist. The generated translation unit ends
// with one KVC_HOST_KERNEL(name) line per `extern "C" __global__` entry point, inside
// KVC_HOST_BEGIN_KERNELS / KVC_HOST_END_KERNELS.
#ifndef KVC_HOST_REGISTER_H
#define KVC_HOST_REGISTER_H

// The shim's qualifier macros must not rewrite the standard library: libstdc++ spells attributes as
// `__attribute__((__noinline__))`, which the `__noinline__` macro would break.
#undef __global__
#undef __device__
#undef __host__
#undef __constant__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#undef __grid_constant__
#undef __align__
#undef __shared__
#undef assert

#include <type_traits>
#include <utility>

namespace kvc_host_reg {

template <typename T>
constexpr int param_kind() {
    if constexpr (std::is_pointer_v<T>) {
        return KVC_HOST_PARAM_POINTER;
    } else if constexpr (std::is_floating_point_v<T>) {
        return KVC_HOST_PARAM_FLOAT;
    } else if constexpr (std::is_integral_v<T> || std::is_enum_v<T>) {
        return KVC_HOST_PARAM_INTEGER;
    } else {
        return KVC_HOST_PARAM_OTHER;
    }
}

template <typename F>
struct Signature;

// Parameter types are deduced from the kernel's function type; top-level const (as in
// `__grid_constant__ const Params p`) is already gone from it.
template <typename... A>
struct Signature<void (*)(A...)> {
    static constexpr int count = static_cast<int>(sizeof...(A));
    // One trailing element keeps the arrays valid for kernels without parameters.
    static constexpr int sizes[] = {static_cast<int>(sizeof(A))..., 0};
    static constexpr int kinds[] = {param_kind<A>()..., 0};

    // Unpacks a cuLaunchKernel-style array: args[i] points at the value of parameter i.
    template <auto Kernel, std::size_t... I>
    static void call(void** args, std::index_sequence<I...>) {
        static_cast<void>(args);
        Kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
    }
};

template <auto Kernel>
void invoke(void** args) {
    using S = Signature<decltype(Kernel)>;
    S::template call<Kernel>(args, std::make_index_sequence<static_cast<std::size_t>(S::count)>{});
}

template <auto Kernel>
constexpr kvc_host_kernel_entry entry(const char* name) {
    using S = Signature<decltype(Kernel)>;
    return kvc_host_kernel_entry{name, &invoke<Kernel>, S::count, S::sizes, S::kinds};
}

}  // namespace kvc_host_reg

#define KVC_HOST_BEGIN_KERNELS static const kvc_host_kernel_entry kvc_host_kernel_table[] = {
#define KVC_HOST_KERNEL(name) ::kvc_host_reg::entry<&name>(#name),
#define KVC_HOST_END_KERNELS                                                                           \
    };                                                                                                 \
    extern "C" const kvc_host_kernel_entry* kvc_host_module_kernels(int* count) {                      \
        *count = static_cast<int>(sizeof(kvc_host_kernel_table) / sizeof(kvc_host_kernel_table[0]));  \
        return kvc_host_kernel_table;                                                                  \
    }

#endif  // KVC_HOST_REGISTER_H
