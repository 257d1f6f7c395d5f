// A stand-in for libcuda.so (the NVIDIA driver API) that runs spark's kernels on the CPU through
// the emulation of cuda_emu.h, so that backend-cuda's host code, and its GPU tests
// (tests/cuda_parity.rs), can run on machines without a GPU: scripts/cuda-emu.sh builds it as
// libcuda.so into a folder to put on LD_LIBRARY_PATH.
//
// One device ("spark CUDA emulation (CPU)", compute capability 8.0, 4 SMs). Device memory is host
// memory (a device pointer is the host address), filled with 0xff bytes when allocated so that
// reading memory nobody wrote shows (as NaN). Every stream operation runs synchronously when it
// is issued, in issue order, so streams and events have nothing to order; stream capture records
// the operations into a graph, which a graph launch replays. Modules ignore their PTX: a function
// is the emulated kernel of that name. Only the entry points spark's backend (through cudarc)
// calls are here; a missing one fails as a missing symbol, which the backend reports.

#include "kernels_emu.cpp"

#include <cstdio>
#include <cstdlib>
#include <unordered_map>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_LAUNCH_FAILED = 719,
};

namespace {

struct Graph {
    std::vector<std::function<CUresult()>> ops;
};

struct Stream {
    Graph* capture = nullptr;  // recording into this graph
};

Stream default_stream;
std::mutex driver_lock;

Stream* stream_of(void* s) { return s ? static_cast<Stream*>(s) : &default_stream; }

// Run `op` now, or record it when `s` is capturing.
CUresult issue(void* s, std::function<CUresult()> op) {
    Stream* st = stream_of(s);
    if (st->capture) {
        st->capture->ops.push_back(std::move(op));
        return CUDA_SUCCESS;
    }
    return op();
}

const size_t MEM_TOTAL = 16ull << 30;
size_t mem_used = 0;
// Bytes of each live device allocation (under driver_lock), so that a free gives them back.
std::unordered_map<CUdeviceptr, size_t> mem_sizes;

// Dynamic shared memory each function may take (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
// under driver_lock): 48 KiB unless raised, as on a GPU, so a launch that forgets to raise it fails
// here as it would there.
constexpr int SHARED_DEFAULT = 48 * 1024, SHARED_OPTIN = 227 * 1024;
std::unordered_map<const void*, int> shared_max;

void* alloc_bytes(size_t bytes) {
    const size_t n = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, n ? n : 256);
    if (p) std::memset(p, 0xff, n ? n : 256);
    return p;
}

CUresult launch(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                unsigned shared, void* stream, void** params) {
    const Kernel* k = static_cast<const Kernel*>(f);
    if (!k || !params) return CUDA_ERROR_INVALID_VALUE;
    // The backend passes every argument through a 64-bit slot (backend-cuda/src/kernels.rs).
    std::vector<uint64_t> slots(emu_arity(k));
    for (size_t i = 0; i < slots.size(); ++i) std::memcpy(&slots[i], params[i], 8);
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    {
        std::lock_guard<std::mutex> g(driver_lock);
        const auto it = shared_max.find(f);
        const int cap = it == shared_max.end() ? SHARED_DEFAULT : it->second;
        if (shared > (unsigned)cap) {
            std::fprintf(stderr, "cuda emulation: launch of %s asks %u bytes of dynamic shared memory (limit %d)\n",
                         k->name, shared, cap);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return issue(stream, [=]() {
        if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return CUDA_ERROR_INVALID_VALUE;
        char err[256] = {0};
        if (emu_run(k, grid, block, shared, slots.data(), err, sizeof err) != 0) {
            std::fprintf(stderr, "cuda emulation: launch of %s failed: %s\n", k->name, err);
            return CUDA_ERROR_LAUNCH_FAILED;
        }
        return CUDA_SUCCESS;
    });
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    std::snprintf(name, (size_t)len, "%s", "spark CUDA emulation (CPU)");
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice) {
    switch (attr) {
        case 1: *v = 1024; break;             // max threads per block
        case 2: case 3: case 4: *v = 1024; break;  // max block dims
        case 5: case 6: case 7: *v = 65535; break; // max grid dims
        case 8: *v = 48 * 1024; break;        // shared memory per block
        case 10: *v = 32; break;              // warp size
        case 16: *v = 4; break;               // multiprocessors
        case 75: *v = 8; break;               // compute capability major
        case 76: *v = 0; break;               // minor
        case 97: *v = 227 * 1024; break;      // shared memory per block (opt-in)
        default: *v = 0;
    }
    return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = MEM_TOTAL;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice) {
    static int the_context;
    *ctx = &the_context;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(void*) { return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(void** ctx) {
    return cuDevicePrimaryCtxRetain(ctx, 0);
}
CUresult cuCtxPushCurrent_v2(void*) { return CUDA_SUCCESS; }
CUresult cuCtxPopCurrent_v2(void** ctx) { return cuCtxGetCurrent(ctx); }
CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }
CUresult cuMemGetInfo_v2(size_t* free_b, size_t* total) {
    std::lock_guard<std::mutex> g(driver_lock);
    *total = MEM_TOTAL;
    *free_b = MEM_TOTAL > mem_used ? MEM_TOTAL - mem_used : 0;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult e, const char** s) {
    *s = e == 0 ? "no error" : "error in the CUDA emulation (see its messages on stderr)";
    return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
    *s = e == 0 ? "CUDA_SUCCESS" : "CUDA_ERROR (emulated)";
    return CUDA_SUCCESS;
}

// Streams and events: everything runs when issued.
CUresult cuStreamCreate(void** s, unsigned) {
    *s = new Stream();
    return CUDA_SUCCESS;
}
CUresult cuStreamCreateWithPriority(void** s, unsigned f, int) { return cuStreamCreate(s, f); }
CUresult cuStreamDestroy_v2(void* s) {
    delete static_cast<Stream*>(s);
    return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(void*) { return CUDA_SUCCESS; }
CUresult cuStreamQuery(void*) { return CUDA_SUCCESS; }
CUresult cuStreamWaitEvent(void*, void*, unsigned) { return CUDA_SUCCESS; }
CUresult cuEventCreate(void** e, unsigned) {
    *e = new double(0.0);
    return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(void* e) {
    delete static_cast<double*>(e);
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(void*, void*) { return CUDA_SUCCESS; }
CUresult cuEventRecordWithFlags(void*, void*, unsigned) { return CUDA_SUCCESS; }
CUresult cuEventSynchronize(void*) { return CUDA_SUCCESS; }
CUresult cuEventQuery(void*) { return CUDA_SUCCESS; }
CUresult cuEventElapsedTime(float* ms, void*, void*) {
    *ms = 0.0f;
    return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

// Memory.
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    void* m = alloc_bytes(bytes);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    {
        std::lock_guard<std::mutex> g(driver_lock);
        mem_used += bytes;
        mem_sizes[(CUdeviceptr)m] = bytes;
    }
    *p = (CUdeviceptr)m;
    return CUDA_SUCCESS;
}
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void*) { return cuMemAlloc_v2(p, bytes); }
CUresult cuMemFree_v2(CUdeviceptr p) {
    {
        std::lock_guard<std::mutex> g(driver_lock);
        auto it = mem_sizes.find(p);
        if (it == mem_sizes.end()) return p ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
        mem_used -= it->second;
        mem_sizes.erase(it);
    }
    std::free((void*)p);
    return CUDA_SUCCESS;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void*) { return cuMemFree_v2(p); }
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = alloc_bytes(bytes);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
CUresult cuMemFreeHost(void* p) {
    std::free(p);
    return CUDA_SUCCESS;
}
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned) {
    *d = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}
CUresult cuMemHostRegister_v2(void*, size_t, unsigned) { return CUDA_SUCCESS; }
CUresult cuMemHostUnregister(void*) { return CUDA_SUCCESS; }

CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void* s) {
    return issue(s, [=]() {
        std::memset((void*)d, v, n);
        return CUDA_SUCCESS;
    });
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return cuMemsetD8Async(d, v, n, nullptr); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, void* s) {
    return issue(s, [=]() {
        for (size_t i = 0; i < n; ++i) std::memcpy((char*)d + 4 * i, &v, 4);
        return CUDA_SUCCESS;
    });
}
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) { return cuMemsetD32Async(d, v, n, nullptr); }
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return issue(s, [=]() {
        std::memmove((void*)dst, (const void*)src, n);
        return CUDA_SUCCESS;
    });
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    return cuMemcpyAsync(dst, (CUdeviceptr)src, n, s);
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) { return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr); }
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    return cuMemcpyAsync((CUdeviceptr)dst, src, n, s);
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return cuMemcpyAsync(dst, src, n, s);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoDAsync_v2(dst, src, n, nullptr); }

// Modules: the PTX is not read; a function is the emulated kernel of that name.
CUresult cuModuleLoadData(void** m, const void*) {
    static int the_module;
    *m = &the_module;
    return CUDA_SUCCESS;
}
CUresult cuModuleUnload(void*) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
    const Kernel* k = emu_find(name);
    if (!k) return CUDA_ERROR_NOT_FOUND;
    *f = const_cast<Kernel*>(k);
    return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(void* f, int attr, int v) {
    if (attr == 8) {  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (v < 0 || v > SHARED_OPTIN) return CUDA_ERROR_INVALID_VALUE;
        std::lock_guard<std::mutex> g(driver_lock);
        shared_max[f] = v;
    }
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* stream, void** params, void** extra) {
    if (extra) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, gx, gy, gz, bx, by, bz, shared, stream, params);
}

struct CUlaunchConfig {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void* hStream;
    void* attrs;
    unsigned numAttrs;
};
// Launch attributes (programmatic dependent launch) change nothing when kernels run in turn.
CUresult cuLaunchKernelEx(const CUlaunchConfig* c, void* f, void** params, void** extra) {
    if (extra) return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                  c->sharedMemBytes, c->hStream, params);
}

// Graphs: capture records, a launch replays.
CUresult cuStreamBeginCapture_v2(void* s, int) {
    Stream* st = stream_of(s);
    if (st->capture) return CUDA_ERROR_INVALID_VALUE;
    st->capture = new Graph();
    return CUDA_SUCCESS;
}
CUresult cuStreamEndCapture(void* s, void** graph) {
    Stream* st = stream_of(s);
    if (!st->capture) return CUDA_ERROR_INVALID_VALUE;
    *graph = st->capture;
    st->capture = nullptr;
    return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = stream_of(s)->capture ? 1 : 0;
    return CUDA_SUCCESS;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    *exec = new Graph(*static_cast<Graph*>(graph));
    return CUDA_SUCCESS;
}
CUresult cuGraphLaunch(void* exec, void* s) {
    if (stream_of(s)->capture) return CUDA_ERROR_INVALID_VALUE;
    for (auto& op : static_cast<Graph*>(exec)->ops) {
        const CUresult r = op();
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}
CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<Graph*>(exec);
    return CUDA_SUCCESS;
}
CUresult cuGraphDestroy(void* g) {
    delete static_cast<Graph*>(g);
    return CUDA_SUCCESS;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// The cuBLAS entry points spark uses (the same library is installed as libcublas.so, a link to
// this one, so that GEMMs are issued on the same emulated streams and captured into graphs):
// column-major `C = alpha op(A) op(B) + beta C` with A and B in f32 or bf16, C in f32, summed in
// f64 (CUBLAS_COMPUTE_32F sums in f32 in some order; the tests' tolerances cover either).

typedef int cublasStatus_t;
enum : int { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum : int { EMU_CUDA_R_32F = 0, EMU_CUDA_R_16BF = 14 };

namespace {
struct BlasHandle {
    void* stream = nullptr;
};

double load_elem(const void* p, int type, size_t i) {
    if (type == EMU_CUDA_R_32F) return ((const float*)p)[i];
    return __uint_as_float(((unsigned)((const unsigned short*)p)[i]) << 16);
}

// One GEMM: op(A) is m x k, op(B) k x n, C m x n (column-major, leading dimensions lda/ldb/ldc).
void gemm_one(int ta, int tb, int m, int n, int k, float alpha, const void* a, int atype, int lda, const void* b,
              int btype, int ldb, float beta, float* c, int ldc) {
    for (int j = 0; j < n; ++j) {
        for (int i = 0; i < m; ++i) {
            double s = 0.0;
            for (int l = 0; l < k; ++l) {
                const size_t ai = ta ? (size_t)i * lda + l : (size_t)l * lda + i;
                const size_t bi = tb ? (size_t)l * ldb + j : (size_t)j * ldb + l;
                s += load_elem(a, atype, ai) * load_elem(b, btype, bi);
            }
            float& o = c[(size_t)j * ldc + i];
            o = (float)(alpha * s + (beta != 0.0f ? beta * (double)o : 0.0));
        }
    }
}

bool gemm_types_ok(int atype, int btype, int ctype, int ta, int tb) {
    const bool ab = (atype == EMU_CUDA_R_32F || atype == EMU_CUDA_R_16BF) && atype == btype;
    return ab && ctype == EMU_CUDA_R_32F && ta >= 0 && ta <= 1 && tb >= 0 && tb <= 1;
}
}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(void** h) {
    *h = new BlasHandle();
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(void* h) {
    delete static_cast<BlasHandle*>(h);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(void* h, void* s) {
    static_cast<BlasHandle*>(h)->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(void*, void*, size_t) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasSetMathMode(void*, int) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasGemmStridedBatchedEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha,
                                          const void* a, int atype, int lda, long long sa, const void* b, int btype,
                                          int ldb, long long sb, const void* beta, void* c, int ctype, int ldc,
                                          long long sc, int batch, int compute, int) {
    if (!gemm_types_ok(atype, btype, ctype, ta, tb)) return CUBLAS_STATUS_NOT_SUPPORTED;
    (void)compute;
    const float al = *(const float*)alpha, be = *(const float*)beta;
    const size_t ea = atype == EMU_CUDA_R_32F ? 4 : 2, eb = btype == EMU_CUDA_R_32F ? 4 : 2;
    const CUresult r = issue(static_cast<BlasHandle*>(h)->stream, [=]() {
        for (int q = 0; q < batch; ++q)
            gemm_one(ta, tb, m, n, k, al, (const char*)a + (size_t)q * sa * ea, atype, lda,
                     (const char*)b + (size_t)q * sb * eb, btype, ldb, be, (float*)c + (size_t)q * sc, ldc);
        return CUDA_SUCCESS;
    });
    return r == CUDA_SUCCESS ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* a, int atype,
                            int lda, const void* b, int btype, int ldb, const void* beta, void* c, int ctype, int ldc,
                            int compute, int algo) {
    return cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha, a, atype, lda, 0, b, btype, ldb, 0, beta, c, ctype,
                                      ldc, 0, 1, compute, algo);
}

}  // extern "C"
