// The launcher of the CPU emulation (see cuda_emu.h): compiled after kernels.cu into one shared
// library, which tests/kernels_emulated.rs loads. `spark_emu_launch` runs a kernel by name with
// its arguments passed as 64-bit slots, as backend-cuda's launch code passes them (a value in the
// low bytes of its slot, a pointer whole; device pointers are host pointers here).

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;
thread_local emu::Block emu::cur;

// Dynamic shared memory: the one array kernels.cu declares `extern __shared__ float sh[]`.
constexpr size_t SH_FLOATS = 1 << 16;
float sh[SH_FLOATS];

namespace {

template <typename T> T from_slot(uint64_t v) {
    if constexpr (std::is_pointer_v<T>) {
        return reinterpret_cast<T>(v);
    } else if constexpr (std::is_same_v<T, float>) {
        const uint32_t b = (uint32_t)v;
        float f;
        std::memcpy(&f, &b, 4);
        return f;
    } else {
        static_assert(std::is_integral_v<T>, "kernel parameter of an unexpected type");
        return (T)v;
    }
}

template <typename... A, size_t... I> void call_with(void (*f)(A...), const uint64_t* s, std::index_sequence<I...>) {
    f(from_slot<A>(s[I])...);
}

using Thunk = std::function<void(const uint64_t*)>;

struct Kernel {
    const char* name;
    unsigned arity;
    Thunk thunk;
};

template <typename... A> Kernel kernel(const char* name, void (*f)(A...)) {
    return Kernel{name, (unsigned)sizeof...(A),
                  [f](const uint64_t* s) { call_with(f, s, std::index_sequence_for<A...>{}); }};
}

#define K(name) kernel(#name, &name)
const std::vector<Kernel>& table() {
    static const std::vector<Kernel> t = {
        K(embed_f32),        K(embed_bf16),        K(rms_norm),           K(add_rms_norm),
        K(rms_norm_vec),     K(add_rms_norm_vec),  K(rope),               K(head_gate),
        K(gather_rows),      K(geglu),             K(add_inplace),        K(round_inplace),
        K(f32_to_bf16_kernel), K(matmul_f32w),     K(matmul_bf16w),       K(gemv_bf16w),
        K(gemv_geglu_bf16w), K(gemv_qkv_rope),     K(kv_append),          K(attn_stats),
        K(attn_accum),       K(attn_scores),       K(attn_pv),            K(attn_reduce),
        K(attn_scores_batch), K(attn_pv_batch),    K(attn_reduce_batch),  K(attn_softmax),
    };
    return t;
}
#undef K

std::mutex launch_lock;

void set_err(char* err, size_t len, const std::string& msg) {
    if (len == 0) return;
    std::snprintf(err, len, "%s", msg.c_str());
}

}  // namespace

// Run kernel `name` over `grid` blocks of `block` threads (threads along x only) with
// `shared_bytes` of dynamic shared memory. Returns 0, or -1 with a message in `err`.
extern "C" int spark_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned shared_bytes,
                                const uint64_t* slots, unsigned nslots, char* err, size_t errlen) {
    const Kernel* k = nullptr;
    for (const Kernel& c : table())
        if (std::strcmp(c.name, name) == 0) k = &c;
    if (!k) {
        set_err(err, errlen, std::string("no kernel named ") + name);
        return -1;
    }
    if (k->arity != nslots) {
        set_err(err, errlen, std::string(name) + " takes " + std::to_string(k->arity) + " arguments, not " +
                                 std::to_string(nslots));
        return -1;
    }
    const unsigned nt = block[0];
    if (block[1] != 1 || block[2] != 1 || nt == 0 || nt > 1024) {
        set_err(err, errlen, "block shape: threads along x only, 1 to 1024");
        return -1;
    }
    if (shared_bytes > sizeof(sh)) {
        set_err(err, errlen, "dynamic shared memory above the emulator's " + std::to_string(sizeof(sh)) + " bytes");
        return -1;
    }
    std::lock_guard<std::mutex> guard(launch_lock);
    blockDim = dim3{nt, 1, 1};
    gridDim = dim3{grid[0], grid[1], grid[2]};
    const uint64_t nblocks = (uint64_t)grid[0] * grid[1] * grid[2];
    const unsigned nwarps = (nt + 31) / 32;

    // Per block: fresh barriers (a thread that returned has left the last block's), and the
    // dynamic shared memory filled with NaN, so that a read before a write shows.
    std::unique_ptr<std::barrier<>> bblock;
    std::barrier<>* warps = nullptr;
    std::vector<uint64_t> slots_x(32 * nwarps);
    emu::Block state{};
    auto fresh = [&]() noexcept {
        bblock = std::make_unique<std::barrier<>>(nt);
        // std::barrier is neither copyable nor movable: an array built in place.
        warps = static_cast<std::barrier<>*>(::operator new[](sizeof(std::barrier<>) * nwarps));
        for (unsigned w = 0; w < nwarps; ++w) {
            const unsigned in_warp = (w + 1) * 32 <= nt ? 32 : nt - w * 32;
            new (&warps[w]) std::barrier<>(in_warp);
        }
        state = emu::Block{bblock.get(), warps, slots_x.data()};
        const float nan = std::nanf("");
        for (size_t i = 0; i < (shared_bytes + 3) / 4; ++i) sh[i] = nan;
    };
    auto destroy_warps = [&]() noexcept {
        if (!warps) return;
        for (unsigned w = 0; w < nwarps; ++w) warps[w].~barrier();
        ::operator delete[](warps);
        warps = nullptr;
    };
    auto next_block = [&]() noexcept {
        destroy_warps();
        fresh();
    };
    std::barrier between(nt, next_block);
    std::vector<std::thread> threads;
    threads.reserve(nt);
    for (unsigned t = 0; t < nt; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = dim3{t, 1, 1};
            for (uint64_t b = 0; b < nblocks; ++b) {
                between.arrive_and_wait();
                emu::cur = state;
                blockIdx = dim3{(unsigned)(b % grid[0]), (unsigned)((b / grid[0]) % grid[1]),
                                (unsigned)(b / ((uint64_t)grid[0] * grid[1]))};
                k->thunk(slots);
                emu::cur.block->arrive_and_drop();
                emu::cur.warps[t >> 5].arrive_and_drop();
            }
        });
    }
    for (std::thread& th : threads) th.join();
    destroy_warps();
    return 0;
}
