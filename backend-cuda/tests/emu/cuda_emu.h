// A CPU emulation of the small part of CUDA C that backend-cuda's kernels.cu uses, so that the
// kernels' logic can be tested on machines without a GPU (tests/kernels_emulated.rs compiles
// kernels.cu with g++ against this header).
//
// What it models: a launch runs the grid's blocks one after another; each block's threads are
// fibers on the launching thread (x86-64 only: launch.cpp switches stacks in assembly), switched only at barriers: `__syncthreads` is a
// barrier over the block's threads and `__shfl_xor_sync` an exchange through a barrier over the
// warp's threads; threads that return early leave both barriers, as exited threads do on the
// GPU. A barrier that can never complete (some threads wait at one barrier while the others have
// exited or wait at another) fails the launch. `__shared__` variables are
// function-local statics (one block runs at a time), and dynamic shared memory is one global
// array (kernels.cu's DYN_SHARED takes it from `emu_dyn_shared` when SPARK_CUDA_EMU is defined).
//
// What it does not model: the GPU's memory model and timing (races that a barrier does not
// order may behave differently), its math library (`expf`, `erff` here are glibc's, which may
// differ from CUDA's by an ulp or two), or inline PTX (kernels.cu has none under SPARK_CUDA_EMU:
// its L2 prefetch hint becomes a no-op, and its sm_90 launch dependencies are compiled only for
// sm_90 devices).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// The running fiber's coordinates, and the launch's shape (one launch runs at a time).
extern dim3 threadIdx;
extern dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

// The current block's dynamic shared memory.
float* emu_dyn_shared();

namespace emu {
// Barriers of the fiber scheduler (launch.cpp): over the block's live threads, and over the live
// threads of the caller's warp.
void block_barrier();
void warp_barrier();
// The caller's warp's exchange slots (32).
uint64_t* warp_slots();
}  // namespace emu

inline void __syncthreads() { emu::block_barrier(); }

template <typename T> inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "emulated shuffle of more than 8 bytes");
    const unsigned lane = threadIdx.x & 31;
    uint64_t* s = emu::warp_slots();
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    s[lane] = bits;
    emu::warp_barrier();
    const uint64_t other = s[lane ^ (unsigned)lane_mask];
    emu::warp_barrier();
    T out;
    std::memcpy(&out, &other, sizeof(T));
    return out;
}

template <typename T> inline T __ldg(const T* p) { return *p; }

inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned v;
    std::memcpy(&v, &f, 4);
    return v;
}

// The vector types kernels.cu loads through (16-byte aligned, as CUDA's).
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
