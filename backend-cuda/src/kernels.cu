// spark CUDA kernels: compiled at run time by NVRTC (or loaded from the bundled PTX, generated
// from this file), with no headers. Every op mirrors backend-cpu exactly: f32 math, and where the
// reference casts to the compute dtype the result is rounded (`mode` 0 = f32, no rounding;
// 1 = bf16, round to nearest even). Activations are f32 row-major [rows, cols]; weights and KV
// caches are f32 or bf16 (stored as unsigned short).
//
// Launch shapes (the Rust side, kernels.rs and lib.rs, must match these signatures exactly):
// - row kernels (embed, rms_norm, rope, head_gate, gather_rows): one block per row, any
//   blockDim that is a multiple of 32 (256 is used).
// - elementwise kernels: a grid-stride loop over `n` elements.
// - attention: see the comment above attn_stats.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define SPARK_NEG_INF (-__int_as_float(0x7f800000))

// Programmatic dependent launch (sm_90 and newer; nothing on older targets, where the host
// never asks for it): every kernel begins with PDL_ENTER, which waits until the kernels before it
// in the stream have completed and their writes are visible, then lets the next kernel's blocks
// be scheduled. A kernel may read only immutable data (weights) before its PDL_ENTER, so a
// kernel launched early does nothing but prefetch until its inputs are ready.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER()                                                  \
    do {                                                             \
        asm volatile("griddepcontrol.wait;" ::: "memory");           \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
    } while (0)
#else
#define PDL_ENTER() \
    do {            \
    } while (0)
#endif

// Ask for the 128-byte line at p to be brought into L2 (a hint; immutable data only). Nothing in
// the CPU emulation of the tests (SPARK_CUDA_EMU, backend-cuda/tests/emu).
#ifndef SPARK_CUDA_EMU
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
__device__ __forceinline__ void prefetch_l2(const void*) {}
#endif

// The block's dynamic shared memory as `float name[]` (one global array in the CPU emulation).
#ifndef SPARK_CUDA_EMU
#define DYN_SHARED(name) extern __shared__ float name[]
#else
#define DYN_SHARED(name) float* name = emu_dyn_shared()
#endif

__device__ __forceinline__ float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }

// Round to nearest even, NaN kept quiet: the same bits as half::bf16::from_f32.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float rnd(float x, int mode) { return mode == 1 ? bf16_to_f32(f32_to_bf16(x)) : x; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float s[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? s[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) s[0] = t;
    }
    __syncthreads();
    return s[0];
}

// Max over the block (as block_sum).
__device__ float block_max(float v) {
    __shared__ float s[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        float t = lane < nw ? s[lane] : SPARK_NEG_INF;
        for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
        if (lane == 0) s[0] = t;
    }
    __syncthreads();
    return s[0];
}

// ---------------------------------------------------------------------------------------------
// Row kernels (grid.x = rows).

// out[r, :] = table[ids[r], :] as f32.
extern "C" __global__ void embed_f32(const float* table, const u32* ids, float* out, u32 cols) {
    PDL_ENTER();
    const float* src = table + (u64)ids[blockIdx.x] * cols;
    float* dst = out + (u64)blockIdx.x * cols;
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = src[j];
}

extern "C" __global__ void embed_bf16(const bf16_t* table, const u32* ids, float* out, u32 cols) {
    PDL_ENTER();
    const bf16_t* src = table + (u64)ids[blockIdx.x] * cols;
    float* dst = out + (u64)blockIdx.x * cols;
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = bf16_to_f32(src[j]);
}

// Every norm kernel sums a row's squares with one partition and order, so that they agree bit
// for bit (the fused and the separate kernels are compared for equality): where cols % 4 == 0,
// thread t takes the groups of four values at 4 (t + k blockDim.x) for k = 0, 1, ..., each
// group in order; else the values t + k blockDim.x. Then block_sum. `row_at(j)` is value j; it
// is called once per j, so it may also store what it computes (the residual add).
template <typename F> __device__ __forceinline__ float row_sumsq(u32 cols, F row_at) {
    float ss = 0.0f;
    if (cols % 4 == 0) {
        for (u32 i = threadIdx.x; i < (cols >> 2); i += blockDim.x)
#pragma unroll
            for (u32 c = 0; c < 4; ++c) {
                const float v = row_at(4 * i + c);
                ss += v * v;
            }
    } else {
        for (u32 j = threadIdx.x; j < cols; j += blockDim.x) {
            const float v = row_at(j);
            ss += v * v;
        }
    }
    return block_sum(ss);
}

// The vectorized norm (rms_norm_vec, add_rms_norm_vec): out = rnd(w * (x * (1 / sqrt(mean(x^2) +
// eps)))), as ops::rms_norm; with `add`, first
// x = in + add, written back to h (the residual add fused with the next norm: the same sums as
// add_inplace then rms_norm). The row is held in registers: V float4 per thread (cols % 4 == 0,
// cols <= 4 * V * blockDim.x), every load of the row issued before any is used.
template <int V>
__device__ void norm_row_vec(const float* in, const float* add, float* h, const float* w, float* out, u32 cols,
                             float eps, int mode) {
    const u32 c4 = cols >> 2;
    float4 wv[V], a[V], b[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const u32 i = threadIdx.x + v * blockDim.x;
        if (i < c4) wv[v] = __ldg((const float4*)w + i);
    }
    PDL_ENTER();
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const u32 i = threadIdx.x + v * blockDim.x;
        if (i < c4) {
            a[v] = ((const float4*)in)[i];
            if (add) b[v] = ((const float4*)add)[i];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const u32 i = threadIdx.x + v * blockDim.x;
        if (i < c4) {
            if (add) {
                a[v].x += b[v].x;
                a[v].y += b[v].y;
                a[v].z += b[v].z;
                a[v].w += b[v].w;
                ((float4*)h)[i] = a[v];
            }
            ss += a[v].x * a[v].x;
            ss += a[v].y * a[v].y;
            ss += a[v].z * a[v].z;
            ss += a[v].w * a[v].w;
        }
    }
    ss = block_sum(ss) / (float)cols;  // the order of row_sumsq
    const float r = 1.0f / sqrtf(ss + eps);
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const u32 i = threadIdx.x + v * blockDim.x;
        if (i < c4) {
            float4 o;
            o.x = rnd(wv[v].x * (a[v].x * r), mode);
            o.y = rnd(wv[v].y * (a[v].y * r), mode);
            o.z = rnd(wv[v].z * (a[v].z * r), mode);
            o.w = rnd(wv[v].w * (a[v].w * r), mode);
            ((float4*)out)[i] = o;
        }
    }
}

// The same for any cols (a strided loop that reads the row twice).
__device__ void norm_row_any(const float* in, const float* add, float* h, const float* w, float* out, u32 cols,
                             float eps, int mode) {
    PDL_ENTER();
    const float* src = add ? h : in;
    const float ss = row_sumsq(cols, [&](u32 j) {
                         if (!add) return in[j];
                         const float v = in[j] + add[j];
                         h[j] = v;
                         return v;
                     }) /
                     (float)cols;
    const float r = 1.0f / sqrtf(ss + eps);
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) out[j] = rnd(w[j] * (src[j] * r), mode);
}

__device__ void norm_row(const float* in, const float* add, float* h, const float* w, float* out, u32 cols, float eps,
                         int mode) {
    const u32 per = ((cols >> 2) + blockDim.x - 1) / blockDim.x;
    if (cols % 4 != 0 || per > 8) norm_row_any(in, add, h, w, out, cols, eps, mode);
    else if (per <= 1) norm_row_vec<1>(in, add, h, w, out, cols, eps, mode);
    else if (per <= 2) norm_row_vec<2>(in, add, h, w, out, cols, eps, mode);
    else if (per <= 4) norm_row_vec<4>(in, add, h, w, out, cols, eps, mode);
    else norm_row_vec<8>(in, add, h, w, out, cols, eps, mode);
}

// rms_norm and add_rms_norm (below) with the row held in registers (Options::fuse).
extern "C" __global__ void rms_norm_vec(const float* x, const float* w, float* out, u32 cols, float eps, int mode) {
    const u64 o = (u64)blockIdx.x * cols;
    norm_row(x + o, nullptr, nullptr, w, out + o, cols, eps, mode);
}

extern "C" __global__ void add_rms_norm_vec(float* h, const float* x, const float* w, float* out, u32 cols, float eps,
                                            int mode) {
    const u64 o = (u64)blockIdx.x * cols;
    norm_row(h + o, x + o, h + o, w, out + o, cols, eps, mode);
}

// out = rnd(w * (x * (1 / sqrt(mean(x^2) + eps)))), as ops::rms_norm (strided loops).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, u32 cols, float eps, int mode) {
    PDL_ENTER();
    const float* xr = x + (u64)blockIdx.x * cols;
    float* orow = out + (u64)blockIdx.x * cols;
    const float ss = row_sumsq(cols, [&](u32 j) { return xr[j]; }) / (float)cols;
    const float r = 1.0f / sqrtf(ss + eps);
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) orow[j] = rnd(w[j] * (xr[j] * r), mode);
}

// h += x, then out = rms_norm(h) as above (the residual add fused with the next norm: the same
// sums as add_inplace then rms_norm). The output loop reads h after block_sum's barriers.
extern "C" __global__ void add_rms_norm(float* h, const float* x, const float* w, float* out, u32 cols, float eps,
                                        int mode) {
    PDL_ENTER();
    float* hr = h + (u64)blockIdx.x * cols;
    const float* xr = x + (u64)blockIdx.x * cols;
    float* orow = out + (u64)blockIdx.x * cols;
    const float ss = row_sumsq(cols, [&](u32 j) {
                         const float v = hr[j] + xr[j];
                         hr[j] = v;
                         return v;
                     }) /
                     (float)cols;
    const float r = 1.0f / sqrtf(ss + eps);
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) orow[j] = rnd(w[j] * (hr[j] * r), mode);
}

// NeoX rotation of the first 2*half dims of each of the first n_rot_heads heads of row r, at
// position pos[r] (cos/sin tables [positions, half]), as ops::rope_head.
extern "C" __global__ void rope(float* qkv, const u32* pos, const float* cos_t, const float* sin_t, u32 cols,
                                u32 n_rot_heads, u32 head_dim, u32 half, int mode) {
    PDL_ENTER();
    float* row = qkv + (u64)blockIdx.x * cols;
    const float* c = cos_t + (u64)pos[blockIdx.x] * half;
    const float* s = sin_t + (u64)pos[blockIdx.x] * half;
    for (u32 t = threadIdx.x; t < n_rot_heads * half; t += blockDim.x) {
        const u32 h = t / half, j = t % half;
        float* x = row + h * head_dim;
        const float a = x[j], b = x[j + half];
        x[j] = rnd(a * c[j] - b * s[j], mode);
        x[j + half] = rnd(b * c[j] + a * s[j], mode);
    }
}

// attn[r, h*D + d] = rnd(attn * rnd(act(g[r, h]))), act 0 = sigmoid, 1 = silu; as ops::head_gate.
extern "C" __global__ void head_gate(float* attn, const float* g, u32 n_heads, u32 head_dim, int act, int mode) {
    PDL_ENTER();
    float* a = attn + (u64)blockIdx.x * n_heads * head_dim;
    const float* gr = g + (u64)blockIdx.x * n_heads;
    for (u32 t = threadIdx.x; t < n_heads * head_dim; t += blockDim.x) {
        const float gv = gr[t / head_dim];
        const float e = 1.0f + expf(-gv);
        const float s = rnd(act == 0 ? 1.0f / e : gv / e, mode);
        a[t] = rnd(a[t] * s, mode);
    }
}

// out[i, :] = x[rows[i], :].
extern "C" __global__ void gather_rows(const float* x, const u32* rows, float* out, u32 cols) {
    PDL_ENTER();
    const float* src = x + (u64)rows[blockIdx.x] * cols;
    float* dst = out + (u64)blockIdx.x * cols;
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = src[j];
}

// ---------------------------------------------------------------------------------------------
// Elementwise kernels (grid-stride over n).

#define GRID_STRIDE(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// out = rnd(rnd(gelu_erf(g)) * u), gelu_erf(x) = 0.5 x (1 + erf(x / sqrt 2)); as ops::geglu.
extern "C" __global__ void geglu(const float* g, const float* u, float* out, u64 n, int mode) {
    PDL_ENTER();
    GRID_STRIDE(i, n) {
        const float x = g[i];
        const float ge = 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
        out[i] = rnd(rnd(ge, mode) * u[i], mode);
    }
}

// h += x.
extern "C" __global__ void add_inplace(float* h, const float* x, u64 n) {
    PDL_ENTER();
    GRID_STRIDE(i, n) h[i] += x[i];
}

// x = rnd(x) in place (the rounding of a GEMM's f32 output).
extern "C" __global__ void round_inplace(float* x, u64 n, int mode) {
    PDL_ENTER();
    GRID_STRIDE(i, n) x[i] = rnd(x[i], mode);
}

// out = bf16(x) (GEMM input; exact, as the activations are already rounded to bf16).
extern "C" __global__ void f32_to_bf16_kernel(const float* x, bf16_t* out, u64 n) {
    PDL_ENTER();
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(x[i]);
}

// ---------------------------------------------------------------------------------------------
// Fallback GEMM, used only where cuBLAS is missing (slow but simple): out[t, r] = rnd(sum_j
// x[t, j] * W[r, j]) for x [n, k] f32 and W [m, k]. One warp per output; 8 warps per block
// (blockDim.x = 256) cover 8 consecutive r; grid = (ceil(m / 8), min(n, 65535)), looping over t.

template <typename T> __device__ __forceinline__ float ld(const T* p, u64 i);
template <> __device__ __forceinline__ float ld<float>(const float* p, u64 i) { return p[i]; }
template <> __device__ __forceinline__ float ld<bf16_t>(const bf16_t* p, u64 i) { return bf16_to_f32(p[i]); }

template <typename T>
__device__ void matmul_warp(const float* x, const T* w, float* out, u32 n, u32 k, u32 m, int mode) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 r = blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= m) return;
    const T* wr = w + (u64)r * k;
    for (u32 t = blockIdx.y; t < n; t += gridDim.y) {
        const float* xr = x + (u64)t * k;
        float acc = 0.0f;
        for (u32 j = lane; j < k; j += 32) acc += xr[j] * ld<T>(wr, j);
        acc = warp_sum(acc);
        if (lane == 0) out[(u64)t * m + r] = rnd(acc, mode);
    }
}

extern "C" __global__ void matmul_f32w(const float* x, const float* w, float* out, u32 n, u32 k, u32 m, int mode) {
    PDL_ENTER();
    matmul_warp<float>(x, w, out, n, k, m, mode);
}

extern "C" __global__ void matmul_bf16w(const float* x, const bf16_t* w, float* out, u32 n, u32 k, u32 m, int mode) {
    PDL_ENTER();
    matmul_warp<bf16_t>(x, w, out, n, k, m, mode);
}

// ---------------------------------------------------------------------------------------------
// Small-batch GEMVs (decode): out[t, r] = rnd(sum_j x[t, j] * W[r, j]) for n <= 16 rows of x
// (f32) and bf16 weights [m, k] with k % 8 == 0. One warp per output row r (4 warps per block:
// blockDim.x = 128, grid.x = ceil(rows / 4)); each lane reads 8 consecutive weights per load
// (16 bytes), eight loads in flight before they are used, so the weights stream once at memory
// speed; x (n * k floats) stays in L1/L2.

__device__ __forceinline__ void unpack_bf16x8(uint4 v, float* o) {
    const u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        o[2 * t] = __uint_as_float(u[t] << 16);
        o[2 * t + 1] = __uint_as_float(u[t] & 0xffff0000u);
    }
}

// x0 . w[0..4] + x1 . w[4..8], summed left to right.
__device__ __forceinline__ float dot8(float4 x0, float4 x1, const float* w) {
    return x0.x * w[0] + x0.y * w[1] + x0.z * w[2] + x0.w * w[3] + x1.x * w[4] + x1.y * w[5] + x1.z * w[6] + x1.w * w[7];
}

#define GEMV_WARPS 4
#define GEMV_DEPTH 8

// Prefetch into L2 the part of a weight row that the first loads of gemv_row read (called
// before PDL_ENTER: a GEMV launched early streams its weights while the kernel before it ends).
__device__ __forceinline__ void gemv_prefetch(const bf16_t* wr, u32 k) {
    const u32 bytes = (k < 256 * GEMV_DEPTH ? k : 256 * GEMV_DEPTH) * 2;
    const u32 off = (threadIdx.x & 31) * 128;
    if (off < bytes) prefetch_l2((const char*)wr + off);
}

// acc[t] = sum_j x[t, j] * wr[j] for t < n, on every lane of the warp.
template <int NT>
__device__ __forceinline__ void gemv_row(const float* x, const bf16_t* wr, u32 n, u32 k, float* acc) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    for (u32 j0 = lane * 8; j0 < k; j0 += 256 * GEMV_DEPTH) {
        uint4 wv[GEMV_DEPTH];
#pragma unroll
        for (int u = 0; u < GEMV_DEPTH; ++u) {
            const u32 j = j0 + 256 * u;
            wv[u] = j < k ? __ldg((const uint4*)(wr + j)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_DEPTH; ++u) {
            const u32 j = j0 + 256 * u;
            if (j >= k) break;
            float wf[8];
            unpack_bf16x8(wv[u], wf);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < (int)n) {
                    const float4 x0 = __ldg((const float4*)(x + (u64)t * k + j));
                    const float4 x1 = __ldg((const float4*)(x + (u64)t * k + j + 4));
                    acc[t] += dot8(x0, x1, wf);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = warp_sum(acc[t]);
}

// The instantiation for n rows (NT = the next of 1, 2, 4, 8, 16).
#define GEMV_BY_N(F, ...)                                \
    if (n <= 1) F<1>(__VA_ARGS__);                       \
    else if (n <= 2) F<2>(__VA_ARGS__);                  \
    else if (n <= 4) F<4>(__VA_ARGS__);                  \
    else if (n <= 8) F<8>(__VA_ARGS__);                  \
    else F<16>(__VA_ARGS__);

// Rows 0..m1 of the output come from w1 into out1 [n, m1], rows m1..m1+m2 from w2 into out2
// [n, m2] (m2 = 0: a single weight).
template <int NT>
__device__ void gemv2_impl(const float* x, const bf16_t* w1, float* out1, u32 m1, const bf16_t* w2, float* out2,
                           u32 m2, u32 n, u32 k, int mode) {
    const u32 r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (r >= m1 + m2) return;
    const bool first = r < m1;
    const u32 rr = first ? r : r - m1;
    const u32 m = first ? m1 : m2;
    float* out = first ? out1 : out2;
    const bf16_t* wr = (first ? w1 : w2) + (u64)rr * k;
    gemv_prefetch(wr, k);
    PDL_ENTER();
    float acc[NT];
    gemv_row<NT>(x, wr, n, k, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (t < (int)n) out[(u64)t * m + rr] = rnd(acc[t], mode);
    }
}

extern "C" __global__ void gemv_bf16w(const float* x, const bf16_t* w1, float* out1, u32 m1, const bf16_t* w2,
                                      float* out2, u32 m2, u32 n, u32 k, int mode) {
    GEMV_BY_N(gemv2_impl, x, w1, out1, m1, w2, out2, m2, n, k, mode)
}

// As gemv_row for two weight rows at once (both rows' loads in flight together).
template <int NT>
__device__ __forceinline__ void gemv_row2(const float* x, const bf16_t* wa, const bf16_t* wb, u32 n, u32 k, float* acc_a,
                                          float* acc_b) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; ++t) acc_a[t] = acc_b[t] = 0.0f;
    for (u32 j0 = lane * 8; j0 < k; j0 += 256 * GEMV_DEPTH) {
        uint4 va[GEMV_DEPTH], vb[GEMV_DEPTH];
#pragma unroll
        for (int u = 0; u < GEMV_DEPTH; ++u) {
            const u32 j = j0 + 256 * u;
            va[u] = j < k ? __ldg((const uint4*)(wa + j)) : make_uint4(0, 0, 0, 0);
            vb[u] = j < k ? __ldg((const uint4*)(wb + j)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_DEPTH; ++u) {
            const u32 j = j0 + 256 * u;
            if (j >= k) break;
            float fa[8], fb[8];
            unpack_bf16x8(va[u], fa);
            unpack_bf16x8(vb[u], fb);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < (int)n) {
                    const float4 x0 = __ldg((const float4*)(x + (u64)t * k + j));
                    const float4 x1 = __ldg((const float4*)(x + (u64)t * k + j + 4));
                    acc_a[t] += dot8(x0, x1, fa);
                    acc_b[t] += dot8(x0, x1, fb);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        acc_a[t] = warp_sum(acc_a[t]);
        acc_b[t] = warp_sum(acc_b[t]);
    }
}

// out[t, r] = geglu(rnd(x Wg^T), rnd(x Wu^T)) for row r: both projections and the GEGLU of
// ops::geglu in one pass, as the matmul, matmul, geglu sequence rounds them.
template <int NT>
__device__ void gemv_geglu_impl(const float* x, const bf16_t* wg, const bf16_t* wu, float* out, u32 m, u32 n, u32 k,
                                int mode) {
    const u32 r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (r >= m) return;
    gemv_prefetch(wg + (u64)r * k, k);
    gemv_prefetch(wu + (u64)r * k, k);
    PDL_ENTER();
    float g[NT], u[NT];
    gemv_row2<NT>(x, wg + (u64)r * k, wu + (u64)r * k, n, k, g, u);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < (int)n) {
                const float gv = rnd(g[t], mode), uv = rnd(u[t], mode);
                const float ge = 0.5f * gv * (1.0f + erff(gv * 0.70710678118654752440f));
                out[(u64)t * m + r] = rnd(rnd(ge, mode) * uv, mode);
            }
        }
    }
}

extern "C" __global__ void gemv_geglu_bf16w(const float* x, const bf16_t* wg, const bf16_t* wu, float* out, u32 m,
                                            u32 n, u32 k, int mode) {
    GEMV_BY_N(gemv_geglu_impl, x, wg, wu, out, m, n, k, mode)
}

// gemv_bf16w of the fused QKV (w1, out1 [n, m1]) and head-gate (w2, out2 [n, m2]) projections
// with the rope kernel's rotation applied to the rounded outputs: the first 2*half dims of each
// of the first n_rot_heads heads of out1, row t at position pos[t] (cos/sin [positions, half]).
// A warp computes one task: a rotated pair of rows (h*head_dim + j, h*head_dim + j + half), both
// streamed at once, or one row that is not rotated. Tasks: the n_rot_heads*half pairs, then the
// rotated heads' remaining dims, then out1's rows after the rotated heads, then w2's rows.
template <int NT>
__device__ void gemv_qkv_rope_impl(const float* x, const bf16_t* w1, float* out1, u32 m1, const bf16_t* w2,
                                   float* out2, u32 m2, u32 n, u32 k, int mode, const u32* pos, const float* cos_t,
                                   const float* sin_t, u32 n_rot_heads, u32 head_dim, u32 half) {
    const u32 task = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const u32 pairs = n_rot_heads * half, rest = head_dim - 2 * half, rot_rows = n_rot_heads * head_dim;
    if (task >= m1 + m2 - pairs) return;
    const bool lead = (threadIdx.x & 31) == 0;
    if (task < pairs) {
        const u32 j = task % half, ra = (task / half) * head_dim + j, rb = ra + half;
        gemv_prefetch(w1 + (u64)ra * k, k);
        gemv_prefetch(w1 + (u64)rb * k, k);
        PDL_ENTER();
        float a[NT], b[NT];
        gemv_row2<NT>(x, w1 + (u64)ra * k, w1 + (u64)rb * k, n, k, a, b);
        if (lead) {
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < (int)n) {
                    const u64 cs = (u64)pos[t] * half + j;
                    const float c = cos_t[cs], s = sin_t[cs];
                    const float av = rnd(a[t], mode), bv = rnd(b[t], mode);
                    out1[(u64)t * m1 + ra] = rnd(av * c - bv * s, mode);
                    out1[(u64)t * m1 + rb] = rnd(bv * c + av * s, mode);
                }
            }
        }
        return;
    }
    u32 u = task - pairs;
    const bf16_t* wr;
    float* out;
    u32 m, r;
    if (u < n_rot_heads * rest) {
        r = (u / rest) * head_dim + 2 * half + u % rest;
        wr = w1 + (u64)r * k;
        out = out1;
        m = m1;
    } else if ((u = u - n_rot_heads * rest + rot_rows) < m1) {
        r = u;
        wr = w1 + (u64)r * k;
        out = out1;
        m = m1;
    } else {
        r = u - m1;
        wr = w2 + (u64)r * k;
        out = out2;
        m = m2;
    }
    gemv_prefetch(wr, k);
    PDL_ENTER();
    float acc[NT];
    gemv_row<NT>(x, wr, n, k, acc);
    if (lead) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (t < (int)n) out[(u64)t * m + r] = rnd(acc[t], mode);
    }
}

extern "C" __global__ void gemv_qkv_rope(const float* x, const bf16_t* w1, float* out1, u32 m1, const bf16_t* w2,
                                         float* out2, u32 m2, u32 n, u32 k, int mode, const u32* pos,
                                         const float* cos_t, const float* sin_t, u32 n_rot_heads, u32 head_dim,
                                         u32 half) {
    GEMV_BY_N(gemv_qkv_rope_impl, x, w1, out1, m1, w2, out2, m2, n, k, mode, pos, cos_t, sin_t, n_rot_heads, head_dim,
              half)
}

// ---------------------------------------------------------------------------------------------
// KV cache layout. A sliding layer's cache is a ring of `ring` rows (position p in row p % ring)
// at `base`. A full layer's (ring = 0) is paged: `base` is a table of page addresses, position p
// in row p % KV_PAGE of page p / KV_PAGE. A row is one position's K (or V): kv heads x head_dim
// elements of row_bytes bytes in all. Pages are allocated as a sequence grows and never move.

#define KV_PAGE 64

__device__ __forceinline__ char* kv_row(const void* base, u32 ring, u32 pos, u32 row_bytes) {
    if (ring) return (char*)base + (u64)(pos % ring) * row_bytes;
    const u64 page = ((const u64*)base)[pos / KV_PAGE];
    return (char*)page + (u64)(pos % KV_PAGE) * row_bytes;
}

// Element e of a cache row, written from f32.
__device__ __forceinline__ void kv_store(char* row, u32 e, float x, int kv_bf16) {
    if (kv_bf16) ((bf16_t*)row)[e] = f32_to_bf16(x);
    else ((float*)row)[e] = x;
}

// KV cache append: positions first..end of a chunk (rows row0 + pos - start of the fused QKV
// activations) into the cache (the layout above). start and first are read from device memory
// (dyn[0], dyn[1]) so that a decode step's launch is the same at every position (a CUDA graph
// replays it). grid.x = end - first, threads over kvd.

extern "C" __global__ void kv_append(const float* qkv, void* kc, void* vc, u32 qkv_cols, u32 row0, const u32* dyn,
                                     u32 qd, u32 kvd, u32 ring, int kv_bf16) {
    PDL_ENTER();
    const u32 start = dyn[0], first = dyn[1];
    const u32 pos = first + blockIdx.x;
    const float* src = qkv + (u64)(row0 + pos - start) * qkv_cols + qd;
    const u32 rb = kvd * (kv_bf16 ? 2 : 4);
    char* kr = kv_row(kc, ring, pos, rb);
    char* vr = kv_row(vc, ring, pos, rb);
    for (u32 e = threadIdx.x; e < kvd; e += blockDim.x) {
        kv_store(kr, e, src[e], kv_bf16);
        kv_store(vr, e, src[kvd + e], kv_bf16);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention of one chunk (nq new tokens at positions start..start+nq, rows row0.. of qkv) over
// the cached keys (positions < start, in kc/vc) and the chunk's own keys (from qkv). start is read
// from device memory (dyn[0]), so a decode step's launches are the same at every position. Query i
// (position p = start + i) sees keys lo..=p, lo = p + 1 - window (window > 0, sliding) or 0.
//
// Exactly the reference's arithmetic (attention.rs): s = rnd(rnd(q.k) * scale); softmax with
// the row max subtracted; p = rnd(exp(s - max) / sum); o = rnd(sum p v). To round p as the
// reference does, the normalisation must be known before V is read, so it runs in two passes
// over the keys (the score matrix is never stored):
//   1. attn_stats:  per (query, head, split): online max/sum over the split's keys -> stats.
//   2. attn_accum:  combine all splits' stats into the row's (max, sum); accumulate
//                   rnd(exp(s - max) / sum) * v over the split's keys -> partial.
//   3. attn_reduce: out = rnd(sum over splits of partial).
// Split-K: the keys of a row are cut into nsplit ranges (decode uses many, prefill one).
// grid = (nq * n_heads, nsplit) for 1 and 2 (blockDim.x = ATTN_THREADS; dynamic shared memory
// head_dim floats for 1, (1 + ATTN_THREADS/32) * head_dim floats for 2); grid = nq * n_heads,
// blockDim.x >= 32 for 3. head_dim <= ATTN_MAX_D.

#define ATTN_THREADS 128
#define ATTN_MAX_D 512

struct Attn {
    const float* qkv;
    const void* kc;
    const void* vc;
    u32 qkv_cols, row0, start, n_heads, n_kv_heads, head_dim, window, ring, nsplit;
    int kv_bf16, mode;
    float scale;
};

// Element d of the key (which = 0) or value (which = 1) of kv head kvh at position pos.
__device__ __forceinline__ float kv_elem(const Attn& A, u32 pos, u32 kvh, u32 d, int which) {
    const u32 kvd = A.n_kv_heads * A.head_dim;
    if (pos >= A.start) {
        const float* r = A.qkv + (u64)(A.row0 + pos - A.start) * A.qkv_cols + A.n_heads * A.head_dim;
        return r[which * kvd + kvh * A.head_dim + d];
    }
    const char* row = kv_row(which ? A.vc : A.kc, A.ring, pos, kvd * (A.kv_bf16 ? 2 : 4));
    const u32 off = kvh * A.head_dim + d;
    return A.kv_bf16 ? bf16_to_f32(((const bf16_t*)row)[off]) : ((const float*)row)[off];
}

// Score of the query in shared memory q against the key at pos (all lanes of the warp get it).
__device__ __forceinline__ float attn_score(const Attn& A, const float* q, u32 pos, u32 kvh, u32 lane) {
    float acc = 0.0f;
    for (u32 d = lane; d < A.head_dim; d += 32) acc += q[d] * kv_elem(A, pos, kvh, d, 0);
    acc = warp_sum(acc);
    return rnd(rnd(acc, A.mode) * A.scale, A.mode);
}

// The key range [a, b) of split `split` for query i.
__device__ __forceinline__ void attn_range(const Attn& A, u32 i, u32 split, u32* a, u32* b) {
    const u32 p = A.start + i;
    const u32 lo = (A.window > 0 && p + 1 > A.window) ? p + 1 - A.window : 0;
    const u32 nkeys = p + 1 - lo;
    const u32 per = (nkeys + A.nsplit - 1) / A.nsplit;
    u32 s0 = lo + split * per, s1 = s0 + per;
    if (s0 > p + 1) s0 = p + 1;
    if (s1 > p + 1) s1 = p + 1;
    *a = s0;
    *b = s1;
}

__device__ __forceinline__ void attn_load_q(const Attn& A, float* q, u32 i, u32 h) {
    const float* src = A.qkv + (u64)(A.row0 + i) * A.qkv_cols + h * A.head_dim;
    for (u32 d = threadIdx.x; d < A.head_dim; d += blockDim.x) q[d] = src[d];
    __syncthreads();
}

#define ATTN_PARAMS                                                                                             \
    const float *qkv, const void *kc, const void *vc, u32 qkv_cols, u32 row0, const u32 *dyn, u32 n_heads,      \
        u32 n_kv_heads, u32 head_dim, u32 window, u32 ring, u32 nsplit, int kv_bf16, int mode, float scale
#define ATTN_INIT                                                                                               \
    Attn A;                                                                                                     \
    A.qkv = qkv; A.kc = kc; A.vc = vc; A.qkv_cols = qkv_cols; A.row0 = row0; A.start = dyn[0];                  \
    A.n_heads = n_heads; A.n_kv_heads = n_kv_heads; A.head_dim = head_dim; A.window = window; A.ring = ring;    \
    A.nsplit = nsplit; A.kv_bf16 = kv_bf16; A.mode = mode; A.scale = scale;

// One score s into a warp's running (max m, sum l of exp(score - m)).
__device__ __forceinline__ void online_softmax(float s, float* m, float* l) {
    if (s > *m) {
        *l = *l * expf(*m - s) + 1.0f;
        *m = s;
    } else {
        *l += expf(s - *m);
    }
}

// The block's (max, sum) from each warp's (m, l), written to out[0], out[1] by thread 0 (warps
// that saw no key are skipped).
__device__ __forceinline__ void split_stats(float m, float l, float* out) {
    __shared__ float wm[ATTN_THREADS / 32], wl[ATTN_THREADS / 32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float M = SPARK_NEG_INF;
        for (u32 w = 0; w < nw; ++w)
            if (wl[w] > 0.0f && wm[w] > M) M = wm[w];
        float L = 0.0f;
        for (u32 w = 0; w < nw; ++w)
            if (wl[w] > 0.0f) L += wl[w] * expf(wm[w] - M);
        out[0] = M;
        out[1] = L;
    }
}

// stats[(qh * nsplit + split) * 2 + {0, 1}] = (max, sum of exp(s - max)) over the split's keys.
extern "C" __global__ void attn_stats(ATTN_PARAMS, float* stats) {
    PDL_ENTER();
    ATTN_INIT
    DYN_SHARED(sh);
    const u32 qh = blockIdx.x, split = blockIdx.y;
    const u32 i = qh / n_heads, h = qh % n_heads, kvh = h / (n_heads / n_kv_heads);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* q = sh;
    attn_load_q(A, q, i, h);
    u32 a, b;
    attn_range(A, i, split, &a, &b);
    float m = SPARK_NEG_INF, l = 0.0f;
    for (u32 pos = a + warp; pos < b; pos += nw) online_softmax(attn_score(A, q, pos, kvh, lane), &m, &l);
    split_stats(m, l, stats + ((u64)qh * nsplit + split) * 2);
}

// partial[(qh * nsplit + split) * head_dim + d] = sum over the split's keys of p * v[d].
extern "C" __global__ void attn_accum(ATTN_PARAMS, const float* stats, float* partial) {
    PDL_ENTER();
    ATTN_INIT
    DYN_SHARED(sh);
    const u32 qh = blockIdx.x, split = blockIdx.y;
    const u32 i = qh / n_heads, h = qh % n_heads, kvh = h / (n_heads / n_kv_heads);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* q = sh;
    float* wacc = sh + head_dim;  // [nw, head_dim]
    attn_load_q(A, q, i, h);
    // The row's max and sum, from every split's stats (each thread computes the same values).
    const float* st = stats + (u64)qh * nsplit * 2;
    float M = SPARK_NEG_INF;
    for (u32 s = 0; s < nsplit; ++s)
        if (st[2 * s + 1] > 0.0f && st[2 * s] > M) M = st[2 * s];
    float L = 0.0f;
    for (u32 s = 0; s < nsplit; ++s)
        if (st[2 * s + 1] > 0.0f) L += st[2 * s + 1] * expf(st[2 * s] - M);
    const float inv = 1.0f / L;
    u32 a, b;
    attn_range(A, i, split, &a, &b);
    float acc[ATTN_MAX_D / 32];
#pragma unroll
    for (int t = 0; t < ATTN_MAX_D / 32; ++t) acc[t] = 0.0f;
    for (u32 pos = a + warp; pos < b; pos += nw) {
        const float s = attn_score(A, q, pos, kvh, lane);
        const float p = rnd(expf(s - M) * inv, mode);
#pragma unroll
        for (int t = 0; t < ATTN_MAX_D / 32; ++t) {
            const u32 d = lane + 32 * t;
            if (d < head_dim) acc[t] += p * kv_elem(A, pos, kvh, d, 1);
        }
    }
#pragma unroll
    for (int t = 0; t < ATTN_MAX_D / 32; ++t) {
        const u32 d = lane + 32 * t;
        if (d < head_dim) wacc[warp * head_dim + d] = acc[t];
    }
    __syncthreads();
    float* dst = partial + ((u64)qh * nsplit + split) * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (u32 w = 0; w < nw; ++w) o += wacc[w * head_dim + d];
        dst[d] = o;
    }
}

// ---------------------------------------------------------------------------------------------
// Scored attention: the same arithmetic, with each score computed once. Pass 1 (attn_scores)
// writes the scores of the split's keys to `scores` (row qh, entry pos - lo, row stride max_keys)
// besides the split's stats; pass 2 (attn_pv) reads them back instead of recomputing q.k. A lane
// holds DPL = head_dim / 32 consecutive dims of q, a key and the output, read with vector loads
// (head_dim a power of two from 32 to 512). Same grid and block as attn_stats / attn_accum; the
// dynamic shared memory of attn_pv is (ATTN_THREADS / 32) * head_dim floats.

template <int DPL> __device__ __forceinline__ void load_f32(const float* p, float* o) {
    if (DPL % 4 == 0) {
#pragma unroll
        for (int t = 0; t < DPL; t += 4) {
            const float4 v = *(const float4*)(p + t);
            o[t] = v.x; o[t + 1] = v.y; o[t + 2] = v.z; o[t + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int t = 0; t < DPL; ++t) o[t] = p[t];
    }
}

template <int DPL> __device__ __forceinline__ void load_bf16(const bf16_t* p, float* o) {
    if (DPL % 8 == 0) {
#pragma unroll
        for (int t = 0; t < DPL; t += 8) unpack_bf16x8(*(const uint4*)(p + t), o + t);
    } else {
#pragma unroll
        for (int t = 0; t < DPL; ++t) o[t] = bf16_to_f32(p[t]);
    }
}

// Dims e0..e0+DPL of the key (which = 0) or value (1) of kv head kvh at position pos.
template <int DPL> __device__ __forceinline__ void kv_vec(const Attn& A, u32 pos, u32 kvh, int which, u32 e0, float* o) {
    const u32 kvd = A.n_kv_heads * A.head_dim;
    if (pos >= A.start) {
        const float* r = A.qkv + (u64)(A.row0 + pos - A.start) * A.qkv_cols + A.n_heads * A.head_dim;
        load_f32<DPL>(r + which * kvd + kvh * A.head_dim + e0, o);
        return;
    }
    const char* row = kv_row(which ? A.vc : A.kc, A.ring, pos, kvd * (A.kv_bf16 ? 2 : 4));
    const u32 off = kvh * A.head_dim + e0;
    if (A.kv_bf16) load_bf16<DPL>((const bf16_t*)row + off, o);
    else load_f32<DPL>((const float*)row + off, o);
}

// The first key query i sees.
__device__ __forceinline__ u32 attn_lo(const Attn& A, u32 i) {
    const u32 p = A.start + i;
    return (A.window > 0 && p + 1 > A.window) ? p + 1 - A.window : 0;
}

template <int DPL> __device__ void attn_scores_impl(const Attn& A, u32 max_keys, float* scores, float* stats) {
    const u32 qh = blockIdx.x, split = blockIdx.y;
    const u32 i = qh / A.n_heads, h = qh % A.n_heads, kvh = h / (A.n_heads / A.n_kv_heads);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 e0 = lane * DPL;
    float q[DPL];
    load_f32<DPL>(A.qkv + (u64)(A.row0 + i) * A.qkv_cols + h * A.head_dim + e0, q);
    u32 a, b;
    attn_range(A, i, split, &a, &b);
    const u32 lo = attn_lo(A, i);
    float* srow = scores + (u64)qh * max_keys;
    float m = SPARK_NEG_INF, l = 0.0f;
    for (u32 pos = a + warp; pos < b; pos += nw) {
        float k[DPL];
        kv_vec<DPL>(A, pos, kvh, 0, e0, k);
        float acc = 0.0f;
#pragma unroll
        for (int t = 0; t < DPL; ++t) acc += q[t] * k[t];
        acc = warp_sum(acc);
        const float s = rnd(rnd(acc, A.mode) * A.scale, A.mode);
        if (lane == 0) srow[pos - lo] = s;
        online_softmax(s, &m, &l);
    }
    split_stats(m, l, stats + ((u64)qh * A.nsplit + split) * 2);
}

template <int DPL> __device__ void attn_pv_impl(const Attn& A, u32 max_keys, const float* scores, const float* stats,
                                              float* partial) {
    DYN_SHARED(sh);  // [nw, head_dim]
    const u32 qh = blockIdx.x, split = blockIdx.y;
    const u32 i = qh / A.n_heads, h = qh % A.n_heads, kvh = h / (A.n_heads / A.n_kv_heads);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 e0 = lane * DPL;
    const float* st = stats + (u64)qh * A.nsplit * 2;
    float M = SPARK_NEG_INF;
    for (u32 s = 0; s < A.nsplit; ++s)
        if (st[2 * s + 1] > 0.0f && st[2 * s] > M) M = st[2 * s];
    float L = 0.0f;
    for (u32 s = 0; s < A.nsplit; ++s)
        if (st[2 * s + 1] > 0.0f) L += st[2 * s + 1] * expf(st[2 * s] - M);
    const float inv = 1.0f / L;
    u32 a, b;
    attn_range(A, i, split, &a, &b);
    const u32 lo = attn_lo(A, i);
    const float* srow = scores + (u64)qh * max_keys;
    float acc[DPL];
#pragma unroll
    for (int t = 0; t < DPL; ++t) acc[t] = 0.0f;
    for (u32 pos = a + warp; pos < b; pos += nw) {
        const float p = rnd(expf(srow[pos - lo] - M) * inv, A.mode);
        float v[DPL];
        kv_vec<DPL>(A, pos, kvh, 1, e0, v);
#pragma unroll
        for (int t = 0; t < DPL; ++t) acc[t] += p * v[t];
    }
#pragma unroll
    for (int t = 0; t < DPL; ++t) sh[warp * A.head_dim + e0 + t] = acc[t];
    __syncthreads();
    float* dst = partial + ((u64)qh * A.nsplit + split) * A.head_dim;
    for (u32 d = threadIdx.x; d < A.head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (u32 w = 0; w < nw; ++w) o += sh[w * A.head_dim + d];
        dst[d] = o;
    }
}

// The instantiation for head_dim = 32 * DPL.
#define ATTN_BY_DPL(F, ...)                      \
    switch (head_dim >> 5) {                     \
    case 1: F<1>(__VA_ARGS__); break;            \
    case 2: F<2>(__VA_ARGS__); break;            \
    case 4: F<4>(__VA_ARGS__); break;            \
    case 8: F<8>(__VA_ARGS__); break;            \
    default: F<16>(__VA_ARGS__); break;          \
    }

extern "C" __global__ void attn_scores(ATTN_PARAMS, u32 max_keys, float* scores, float* stats) {
    PDL_ENTER();
    ATTN_INIT
    ATTN_BY_DPL(attn_scores_impl, A, max_keys, scores, stats)
}

extern "C" __global__ void attn_pv(ATTN_PARAMS, u32 max_keys, const float* scores, const float* stats, float* partial) {
    PDL_ENTER();
    ATTN_INIT
    ATTN_BY_DPL(attn_pv_impl, A, max_keys, scores, stats, partial)
}

// ---------------------------------------------------------------------------------------------
// Flash-style attention of a prefill chunk (at any start: the keys before it come from the
// cache). The reference's arithmetic, as in attn_stats / attn_accum, but tiled so that a key or
// value read from memory serves many queries: a block takes FLASH_ROWS query rows of one KV head
// (row r of that head's n * group rows is chunk query r / group of head kvh * group + r % group,
// so the group's query heads share every tile) and walks the keys its rows see in tiles of
// FLASH_KEYS, staged in shared memory as f32, twice. Pass 1 takes each row's max and sum of
// exp(s - max) (online); pass 2 recomputes the scores, rounds p = rnd(exp(s - max) / sum) as the
// reference does and accumulates p v in key order. No score leaves the block. With one split
// (phase 0) each output row is written once, o = rnd(sum p v), and the chunk's KV append runs
// after it (kv_append: a ring slot the chunk writes may hold a key one of its queries reads).
// Where the chunk's row blocks are too few to fill the device the keys are split as well, over
// grid.z (phases 1 and 2, then attn_reduce; see attn_flash).
// grid = (ceil(n * group / FLASH_ROWS), n_kv_heads, nsplit), blockDim.x = FLASH_THREADS, dynamic
// shared memory FLASH_SHARED_FLOATS(head_dim) floats; head_dim = 32 * DPL, a power of two from
// 32 to 512.
// In the score tiles thread t owns rows 2 (t / 16) + {0, 1} and keys t % 16 + {0, 16}; in the
// output, warp w owns rows 4w..4w+3 and lane l the dims l + 32 j. Rows and tiles are padded by
// one float, so neither layout's shared-memory reads collide in a bank.

#define FLASH_ROWS 32
#define FLASH_KEYS 32
#define FLASH_THREADS 256
#define FLASH_SHARED_FLOATS(d) ((FLASH_ROWS + FLASH_KEYS) * ((d) + 1) + FLASH_ROWS * (FLASH_KEYS + 1) + 2 * FLASH_ROWS)

// Merge another (max, sum) into a running one (a sum of 0 means no key).
__device__ __forceinline__ void softmax_merge(float* m, float* l, float mo, float lo) {
    if (lo == 0.0f) return;
    if (*l == 0.0f) {
        *m = mo;
        *l = lo;
        return;
    }
    const float M = fmaxf(*m, mo);
    *l = *l * expf(*m - M) + lo * expf(mo - M);
    *m = M;
}

// Keys k0..k0 + FLASH_KEYS of kv head kvh (which = 0: K, 1: V) into ts (row stride ld) as f32,
// zero past k_hi.
template <int DPL> __device__ __forceinline__ void flash_tile(const Attn& A, float* ts, u32 k0, u32 k_hi, u32 kvh,
                                                             int which) {
    constexpr u32 D = 32 * DPL, LD = D + 1;
    for (u32 e = threadIdx.x * 8; e < FLASH_KEYS * D; e += FLASH_THREADS * 8) {
        const u32 kk = e / D, d = e % D, pos = k0 + kk;
        float v[8];
        if (pos <= k_hi) {
            kv_vec<8>(A, pos, kvh, which, d, v);
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t) v[t] = 0.0f;
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) ts[kk * LD + d + t] = v[t];
    }
}

// This thread's 2 x 2 scores s = rnd(rnd(q . k) * scale) of rows sr, sr + 1 and tile keys sk,
// sk + 16.
template <int DPL> __device__ __forceinline__ void flash_scores(const Attn& A, const float* qs, const float* ts, u32 sr,
                                                                u32 sk, float s[2][2]) {
    constexpr u32 D = 32 * DPL, LD = D + 1;
    const float *q0 = qs + sr * LD, *q1 = q0 + LD, *k0 = ts + sk * LD, *k1 = ts + (sk + 16) * LD;
    float a00 = 0.0f, a01 = 0.0f, a10 = 0.0f, a11 = 0.0f;
#pragma unroll 8
    for (u32 d = 0; d < D; ++d) {
        const float x0 = q0[d], x1 = q1[d], y0 = k0[d], y1 = k1[d];
        a00 += x0 * y0;
        a01 += x0 * y1;
        a10 += x1 * y0;
        a11 += x1 * y1;
    }
    s[0][0] = rnd(rnd(a00, A.mode) * A.scale, A.mode);
    s[0][1] = rnd(rnd(a01, A.mode) * A.scale, A.mode);
    s[1][0] = rnd(rnd(a10, A.mode) * A.scale, A.mode);
    s[1][1] = rnd(rnd(a11, A.mode) * A.scale, A.mode);
}

// Key tile k0 into ts, once every thread is done with what ts and ps held (and, the first time,
// the writes of qs, ms and is are complete), then this thread's 2 x 2 scores against it.
template <int DPL>
__device__ __forceinline__ void flash_key_tile(const Attn& A, const float* qs, float* ts, u32 k0, u32 k_hi, u32 kvh,
                                               u32 sr, u32 sk, float s[2][2]) {
    __syncthreads();
    flash_tile<DPL>(A, ts, k0, k_hi, kvh, 0);
    __syncthreads();
    flash_scores<DPL>(A, qs, ts, sr, sk, s);
}

template <int DPL>
__device__ void attn_flash_impl(const Attn& A, u32 n, float* out, u32 out_cols, int phase, float* stats,
                                float* partial) {
    constexpr u32 D = 32 * DPL, LD = D + 1, PLD = FLASH_KEYS + 1;
    DYN_SHARED(sh);
    float* qs = sh;                    // [FLASH_ROWS][LD]
    float* ts = qs + FLASH_ROWS * LD;  // [FLASH_KEYS][LD]: a K tile, then a V tile
    float* ps = ts + FLASH_KEYS * LD;  // [FLASH_ROWS][PLD]
    float* ms = ps + FLASH_ROWS * PLD; // [FLASH_ROWS]: each row's max
    float* is = ms + FLASH_ROWS;       // [FLASH_ROWS]: 1 / each row's sum (0: a row past the chunk)
    const u32 group = A.n_heads / A.n_kv_heads, kvh = blockIdx.y, split = blockIdx.z;
    const u32 rows = n * group, r0 = blockIdx.x * FLASH_ROWS;
    const u32 t = threadIdx.x, lane = t & 31, warp = t >> 5;
    for (u32 e = t * 8; e < FLASH_ROWS * D; e += FLASH_THREADS * 8) {
        const u32 r = e / D, d = e % D, fr = r0 + r;
        float v[8];
        if (fr < rows) {
            const u32 i = fr / group, h = kvh * group + fr % group;
            load_f32<8>(A.qkv + (u64)(A.row0 + i) * A.qkv_cols + h * D + d, v);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) qs[r * LD + d + k] = v[k];
    }
    // The keys each of this thread's score rows sees: lo..=hi (none for a row past the chunk).
    const u32 sr = 2 * (t >> 4), sk = t & 15;
    u32 lo[2], hi[2];
#pragma unroll
    for (int a = 0; a < 2; ++a) {
        const u32 fr = r0 + sr + a;
        lo[a] = fr < rows ? attn_lo(A, fr / group) : 1;
        hi[a] = fr < rows ? A.start + fr / group : 0;
    }
    // The block's keys, from its first row's lo to its last row's position, in tiles; this
    // split's share of the tiles is t0..t1.
    const u32 last = (r0 + FLASH_ROWS < rows ? r0 + FLASH_ROWS : rows) - 1;
    const u32 k_lo = attn_lo(A, r0 / group), k_hi = A.start + last / group;
    const u32 ntiles = (k_hi - k_lo) / FLASH_KEYS + 1, per = (ntiles + A.nsplit - 1) / A.nsplit;
    const u32 t0 = split * per < ntiles ? split * per : ntiles, t1 = t0 + per < ntiles ? t0 + per : ntiles;

    if (phase != 2) {
        // Pass 1: each row's (max, sum) over the split's keys.
        float m[2] = {SPARK_NEG_INF, SPARK_NEG_INF}, l[2] = {0.0f, 0.0f};
        for (u32 tile = t0; tile < t1; ++tile) {
            const u32 k0 = k_lo + tile * FLASH_KEYS;
            float s[2][2];
            flash_key_tile<DPL>(A, qs, ts, k0, k_hi, kvh, sr, sk, s);
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const u32 pos = k0 + sk + 16 * b;
                    if (pos >= lo[a] && pos <= hi[a]) online_softmax(s[a][b], &m[a], &l[a]);
                }
        }
        // The 16 threads of a row pair are lanes that differ in their low four bits.
#pragma unroll
        for (int a = 0; a < 2; ++a) {
            for (int o = 8; o > 0; o >>= 1) {
                const float mo = __shfl_xor_sync(0xffffffffu, m[a], o), lo_ = __shfl_xor_sync(0xffffffffu, l[a], o);
                softmax_merge(&m[a], &l[a], mo, lo_);
            }
            const u32 fr = r0 + sr + a;
            if (sk != 0) continue;
            if (phase == 1) {
                if (fr < rows) {
                    float* st = stats + (((u64)kvh * rows + fr) * A.nsplit + split) * 2;
                    st[0] = m[a];
                    st[1] = l[a];
                }
            } else {
                ms[sr + a] = m[a];
                is[sr + a] = l[a] > 0.0f ? 1.0f / l[a] : 0.0f;
            }
        }
        if (phase == 1) return;
    } else {
        // Each row's (max, sum) over all the splits' keys.
        if (t < FLASH_ROWS) {
            float m = SPARK_NEG_INF, l = 0.0f;
            if (r0 + t < rows) {
                const float* st = stats + ((u64)kvh * rows + r0 + t) * A.nsplit * 2;
                for (u32 q = 0; q < A.nsplit; ++q) softmax_merge(&m, &l, st[2 * q], st[2 * q + 1]);
            }
            ms[t] = m;
            is[t] = l > 0.0f ? 1.0f / l : 0.0f;
        }
    }

    // Pass 2: p = rnd(exp(s - max) / sum), o += p v over the split's keys.
    float acc[4][DPL];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[a][j] = 0.0f;
    for (u32 tile = t0; tile < t1; ++tile) {
        const u32 k0 = k_lo + tile * FLASH_KEYS;
        float s[2][2];
        flash_key_tile<DPL>(A, qs, ts, k0, k_hi, kvh, sr, sk, s);
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const u32 pos = k0 + sk + 16 * b;
                float p = 0.0f;
                if (pos >= lo[a] && pos <= hi[a]) p = rnd(expf(s[a][b] - ms[sr + a]) * is[sr + a], A.mode);
                ps[(sr + a) * PLD + sk + 16 * b] = p;
            }
        __syncthreads();  // the K tile's readers are done and ps is written
        flash_tile<DPL>(A, ts, k0, k_hi, kvh, 1);
        __syncthreads();
        for (u32 kk = 0; kk < FLASH_KEYS; ++kk) {
            float v[DPL];
#pragma unroll
            for (int j = 0; j < DPL; ++j) v[j] = ts[kk * LD + lane + 32 * j];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float p = ps[(4 * warp + a) * PLD + kk];
#pragma unroll
                for (int j = 0; j < DPL; ++j) acc[a][j] += p * v[j];
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const u32 fr = r0 + 4 * warp + a;
        if (fr >= rows) continue;
        const u32 i = fr / group, h = kvh * group + fr % group;
        if (phase == 0) {
            float* dst = out + (u64)(A.row0 + i) * out_cols + h * D;
#pragma unroll
            for (int j = 0; j < DPL; ++j) dst[lane + 32 * j] = rnd(acc[a][j], A.mode);
        } else {
            float* dst = partial + ((u64)(i * A.n_heads + h) * A.nsplit + split) * D;
#pragma unroll
            for (int j = 0; j < DPL; ++j) dst[lane + 32 * j] = acc[a][j];
        }
    }
}

// phase 0 (nsplit = 1): the whole attention, out = rnd(sum p v). With the keys split over
// grid.z = nsplit blocks: phase 1 writes each split's (max, sum) of each row to stats (row r of
// kv head kvh at ((kvh * n * group + r) * nsplit + split) * 2); phase 2 reads them all and writes
// each split's unrounded sum p v to partial as attn_accum lays it out, for attn_reduce (which
// also appends the chunk's K/V).
extern "C" __global__ void attn_flash(ATTN_PARAMS, u32 n, float* out, u32 out_cols, int phase, float* stats,
                                      float* partial) {
    PDL_ENTER();
    ATTN_INIT
    ATTN_BY_DPL(attn_flash_impl, A, n, out, out_cols, phase, stats, partial)
}

// ---------------------------------------------------------------------------------------------
// Dense prefill attention (a chunk that starts a sequence, so every key is the chunk's own): the
// scores S_h = Q_h K^T and the output O_h = P_h V are cuBLAS GEMMs (exact products, f32
// accumulation: in bf16 mode q, k, v and p are bf16 values), and this kernel turns a row of S
// into a row of P with the reference's rounding: s = rnd(rnd(S) * scale) over the keys query i
// sees (lo..=i), p = rnd(exp(s - max) / sum), 0 elsewhere. S is [n_heads, n, n] f32, P the same
// in bf16 (p_bf16) or f32. grid.x = n * n_heads (block i * n_heads + h), blockDim a multiple of 32.

extern "C" __global__ void attn_softmax(const float* S, void* P, u32 n, u32 n_heads, u32 window, float scale, int mode,
                                        int p_bf16) {
    PDL_ENTER();
    const u32 i = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    const u64 row = ((u64)h * n + i) * n;
    const float* srow = S + row;
    const u32 lo = (window > 0 && i + 1 > window) ? i + 1 - window : 0;
    float m = SPARK_NEG_INF;
    for (u32 j = lo + threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, rnd(rnd(srow[j], mode) * scale, mode));
    m = block_max(m);
    float l = 0.0f;
    for (u32 j = lo + threadIdx.x; j <= i; j += blockDim.x) l += expf(rnd(rnd(srow[j], mode) * scale, mode) - m);
    l = block_sum(l);
    const float inv = 1.0f / l;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        float p = 0.0f;
        if (j >= lo && j <= i) p = rnd(expf(rnd(rnd(srow[j], mode) * scale, mode) - m) * inv, mode);
        if (p_bf16) ((bf16_t*)P)[row + j] = f32_to_bf16(p);
        else ((float*)P)[row + j] = p;
    }
}

// out[row0 + i, h * head_dim + d] = rnd(sum over splits of partial), and where `gate` is given
// (the head_gate op fused) then rnd(out * rnd(act(gate[row0 + i, h]))) as head_gate computes it
// (gate_act 0 = sigmoid, 1 = silu). Then, after every read of the cache by this chunk's attention
// (the kernels before this one), the KV append of kv_append: the block of the first query head
// of each group writes its KV head's K and V of position start + i (from dyn, as kv_append) when
// it is at least first.
__device__ __forceinline__ void attn_reduce_row(const float* partial, float* out, u32 out_cols, u32 row0, u32 n_heads,
                                                u32 head_dim, u32 nsplit, int mode, const float* qkv, void* kc, void* vc,
                                                u32 qkv_cols, const u32* dyn, u32 n_kv_heads, u32 ring, int kv_bf16,
                                                const float* gate, int gate_act) {
    const u32 qh = blockIdx.x;
    const u32 i = qh / n_heads, h = qh % n_heads;
    const float* src = partial + (u64)qh * nsplit * head_dim;
    float* dst = out + (u64)(row0 + i) * out_cols + h * head_dim;
    float gs = 1.0f;
    if (gate) {
        const float gv = gate[(u64)(row0 + i) * n_heads + h];
        const float e = 1.0f + expf(-gv);
        gs = rnd(gate_act == 0 ? 1.0f / e : gv / e, mode);
    }
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (u32 s = 0; s < nsplit; ++s) o += src[s * head_dim + d];
        o = rnd(o, mode);
        if (gate) o = rnd(o * gs, mode);
        dst[d] = o;
    }
    const u32 group = n_heads / n_kv_heads, start = dyn[0], first = dyn[1], pos = start + i;
    if (h % group != 0 || pos < first) return;
    const u32 kvh = h / group, kvd = n_kv_heads * head_dim;
    const float* k = qkv + (u64)(row0 + i) * qkv_cols + n_heads * head_dim + kvh * head_dim;
    const u32 rb = kvd * (kv_bf16 ? 2 : 4), at = kvh * head_dim;
    char* kr = kv_row(kc, ring, pos, rb);
    char* vr = kv_row(vc, ring, pos, rb);
    for (u32 e = threadIdx.x; e < head_dim; e += blockDim.x) {
        kv_store(kr, at + e, k[e], kv_bf16);
        kv_store(vr, at + e, k[kvd + e], kv_bf16);
    }
}

extern "C" __global__ void attn_reduce(const float* partial, float* out, u32 out_cols, u32 row0, u32 n_heads,
                                       u32 head_dim, u32 nsplit, int mode, const float* qkv, void* kc, void* vc,
                                       u32 qkv_cols, const u32* dyn, u32 n_kv_heads, u32 ring, int kv_bf16) {
    PDL_ENTER();
    attn_reduce_row(partial, out, out_cols, row0, n_heads, head_dim, nsplit, mode, qkv, kc, vc, qkv_cols, dyn,
                    n_kv_heads, ring, kv_bf16, nullptr, 0);
}

// ---------------------------------------------------------------------------------------------
// Batched scored attention: the chunks of several sequences of one step (the same layer, so the
// same shape) in one launch of each of attn_scores, attn_pv and attn_reduce. blockIdx.z picks a
// chunk's entry of ATTN_ENTRY words in `table` (staged): row0, start, first, rows_h (query rows x
// heads), nsplit, keys (score row stride), ring, K and V cache pointers (rings, or page tables
// where ring = 0; lo, hi words), and the offsets (in floats) of its stats, partial outputs and
// scores in the shared scratch. grid.x and grid.y cover the largest rows_h and nsplit; blocks
// beyond a chunk's return at once.

#define ATTN_ENTRY 16

__device__ __forceinline__ bool attn_entry(const u32* e, Attn& A, const float* qkv, u32 qkv_cols, u32 n_heads,
                                           u32 n_kv_heads, u32 head_dim, u32 window, int kv_bf16, int mode, float scale) {
    if (blockIdx.x >= e[3] || blockIdx.y >= e[4]) return false;
    A.qkv = qkv;
    A.kc = (const void*)((u64)e[7] | ((u64)e[8] << 32));
    A.vc = (const void*)((u64)e[9] | ((u64)e[10] << 32));
    A.qkv_cols = qkv_cols; A.row0 = e[0]; A.start = e[1];
    A.n_heads = n_heads; A.n_kv_heads = n_kv_heads; A.head_dim = head_dim; A.window = window; A.ring = e[6];
    A.nsplit = e[4]; A.kv_bf16 = kv_bf16; A.mode = mode; A.scale = scale;
    return true;
}

#define ATTN_BATCH_PARAMS                                                                                      \
    const float *qkv, u32 qkv_cols, u32 n_heads, u32 n_kv_heads, u32 head_dim, u32 window, int kv_bf16, int mode, \
        float scale, const u32 *table

extern "C" __global__ void attn_scores_batch(ATTN_BATCH_PARAMS, float* scores, float* stats) {
    PDL_ENTER();
    const u32* e = table + blockIdx.z * ATTN_ENTRY;
    Attn A;
    if (!attn_entry(e, A, qkv, qkv_cols, n_heads, n_kv_heads, head_dim, window, kv_bf16, mode, scale)) return;
    ATTN_BY_DPL(attn_scores_impl, A, e[5], scores + e[13], stats + e[11])
}

extern "C" __global__ void attn_pv_batch(ATTN_BATCH_PARAMS, const float* scores, const float* stats, float* partial) {
    PDL_ENTER();
    const u32* e = table + blockIdx.z * ATTN_ENTRY;
    Attn A;
    if (!attn_entry(e, A, qkv, qkv_cols, n_heads, n_kv_heads, head_dim, window, kv_bf16, mode, scale)) return;
    ATTN_BY_DPL(attn_pv_impl, A, e[5], scores + e[13], stats + e[11], partial + e[12])
}

// With `gate` (not null), the head gate fused (see attn_reduce_row).
extern "C" __global__ void attn_reduce_batch(ATTN_BATCH_PARAMS, const float* partial, float* out, u32 out_cols,
                                             const float* gate, int gate_act) {
    PDL_ENTER();
    const u32* e = table + blockIdx.z * ATTN_ENTRY;
    if (blockIdx.x >= e[3]) return;
    void* kc = (void*)((u64)e[7] | ((u64)e[8] << 32));
    void* vc = (void*)((u64)e[9] | ((u64)e[10] << 32));
    attn_reduce_row(partial + e[12], out, out_cols, e[0], n_heads, head_dim, e[4], mode, qkv, kc, vc, qkv_cols, e + 1,
                    n_kv_heads, e[6], kv_bf16, gate, gate_act);
}
