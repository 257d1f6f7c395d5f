// The launcher of the CPU emulation (see cuda_emu.h): compiled after kernels.cu
// (kernels_emu.cpp), into the library tests/kernels_emulated.rs loads and into the driver
// stand-in (driver.cpp). `spark_emu_launch` runs a kernel by name with its arguments passed as
// 64-bit slots, as backend-cuda's launch code passes them (a value in the low bytes of its slot,
// a pointer whole; device pointers are host pointers here). The kernel table below must name
// every kernel of kernels.cu that kernels.rs loads: a missing one fails the driver stand-in's
// module load, so the emulated GPU tests fail visibly.

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

dim3 threadIdx;
dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;

// Dynamic shared memory (one block runs at a time).
constexpr size_t SH_FLOATS = 1 << 16;
static float sh[SH_FLOATS];
float* emu_dyn_shared() { return sh; }

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
        K(attn_flash),
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

namespace emu {

// Switching between fibers: save the callee-saved registers, the SSE and x87 control words and
// the stack pointer of the running context into *save, and resume the one whose stack pointer
// is `to` (x86-64 System V; a few nanoseconds, where swapcontext makes a system call).
extern "C" void emu_switch(void** save, void* to);
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");

// The fiber scheduler of one launch: a block's threads as fibers, each run until it waits at a
// barrier or returns; a barrier completes when every live thread of its scope has arrived.
struct Fiber {
    void* sp = nullptr;  // saved stack pointer while switched out
    enum { Ready, AtBlock, AtWarp, Done } state = Ready;
    uint64_t gen = 0;  // the barrier generation it waits to see pass
};

struct Barrier {
    unsigned live = 0, arrived = 0;
    uint64_t gen = 0;
    // One more arrival (or, with `leave`, one thread fewer); true when that completes it.
    bool arrive(bool leave) {
        if (leave) --live;
        else ++arrived;
        if (arrived > 0 && arrived == live) {
            arrived = 0;
            ++gen;
            return true;
        }
        return false;
    }
};

struct Sched;
Sched* sched = nullptr;

struct Sched {
    static constexpr size_t STACK = 256 * 1024;
    unsigned nt, nwarps;
    std::vector<Fiber> f;
    std::vector<std::unique_ptr<char[]>> stacks;
    std::vector<uint64_t> slots;  // 32 per warp
    Barrier block;
    std::vector<Barrier> warps;
    void* main_sp = nullptr;
    unsigned cur = 0;
    const Kernel* k = nullptr;
    const uint64_t* args = nullptr;

    explicit Sched(unsigned n) : nt(n), nwarps((n + 31) / 32), f(n), stacks(n), slots(32 * nwarps), warps(nwarps) {
        for (auto& st : stacks) st.reset(new char[STACK]);
    }

    // A fiber's first frame: run the kernel, leave the barriers, switch back for good.
    static void entry() {
        Sched* s = sched;
        const unsigned t = s->cur;
        s->k->thunk(s->args);
        s->f[t].state = Fiber::Done;
        s->block.arrive(true);
        s->warps[t >> 5].arrive(true);
        emu_switch(&s->f[t].sp, s->main_sp);
        __builtin_unreachable();
    }

    // A fresh stack for fiber t whose first switch-in enters `entry` (as emu_switch's frame:
    // the control words, six registers, the return address, and a 16-byte aligned call frame).
    void prepare(unsigned t) {
        uintptr_t top = ((uintptr_t)stacks[t].get() + STACK) & ~(uintptr_t)15;
        uint64_t* sp = (uint64_t*)top;
        *--sp = 0;                     // entry's return address (never used)
        *--sp = (uint64_t)&entry;      // emu_switch's `ret` goes here
        for (int r = 0; r < 6; ++r) *--sp = 0;  // rbp rbx r12 r13 r14 r15
        *--sp = 0x1f80ull | (0x037full << 32);  // MXCSR default; x87 control word default
        f[t].sp = sp;
    }

    // Park the running fiber at barrier `b` (state `st`) unless its arrival completes it.
    void wait(Barrier& b, decltype(Fiber::state) st) {
        Fiber& me = f[cur];
        me.gen = b.gen;
        if (b.arrive(false)) return;
        me.state = st;
        emu_switch(&me.sp, main_sp);
    }

    bool waiting(const Fiber& x) const {
        if (x.state == Fiber::AtBlock) return x.gen == block.gen;
        if (x.state == Fiber::AtWarp) return x.gen == warps[&x - f.data() >> 5].gen;
        return false;
    }

    // Run one block to the end; false if its threads can make no progress.
    bool run_block(const Kernel* kern, const uint64_t* a) {
        k = kern;
        args = a;
        block = Barrier{nt, 0, 0};
        for (unsigned w = 0; w < nwarps; ++w) warps[w] = Barrier{(w + 1) * 32 <= nt ? 32 : nt - w * 32, 0, 0};
        for (unsigned t = 0; t < nt; ++t) {
            prepare(t);
            f[t].state = Fiber::Ready;
        }
        unsigned done = 0;
        while (done < nt) {
            bool progress = false;
            done = 0;
            for (unsigned t = 0; t < nt; ++t) {
                Fiber& x = f[t];
                if (x.state == Fiber::Done) {
                    ++done;
                    continue;
                }
                if (waiting(x)) continue;
                x.state = Fiber::Ready;
                cur = t;
                threadIdx = dim3{t, 1, 1};
                emu_switch(&main_sp, x.sp);
                progress = true;
            }
            if (!progress && done < nt) return false;
        }
        return true;
    }
};

void block_barrier() { sched->wait(sched->block, Fiber::AtBlock); }
void warp_barrier() { sched->wait(sched->warps[sched->cur >> 5], Fiber::AtWarp); }
uint64_t* warp_slots() { return sched->slots.data() + 32 * (sched->cur >> 5); }

}  // namespace emu

// The kernel named `name`, or null.
const Kernel* emu_find(const char* name) {
    for (const Kernel& c : table())
        if (std::strcmp(c.name, name) == 0) return &c;
    return nullptr;
}

// The number of 64-bit argument slots `k` takes.
unsigned emu_arity(const Kernel* k) { return k->arity; }

// Run `k` over `grid` blocks of `block` threads (threads along x only) with `shared_bytes` of
// dynamic shared memory and its `k->arity` argument slots. Returns 0, or -1 with a message in
// `err`.
int emu_run(const Kernel* k, const unsigned* grid, const unsigned* block, unsigned shared_bytes, const uint64_t* slots,
            char* err, size_t errlen) {
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
    emu::Sched s(nt);
    emu::sched = &s;
    const float nan = std::nanf("");
    for (uint64_t b = 0; b < nblocks; ++b) {
        blockIdx = dim3{(unsigned)(b % grid[0]), (unsigned)((b / grid[0]) % grid[1]),
                        (unsigned)(b / ((uint64_t)grid[0] * grid[1]))};
        // Dynamic shared memory filled with NaN, so that a read before a write shows.
        for (size_t i = 0; i < (shared_bytes + 3) / 4; ++i) sh[i] = nan;
        if (!s.run_block(k, slots)) {
            emu::sched = nullptr;
            set_err(err, errlen, std::string(k->name) + ": a barrier can never complete in block " + std::to_string(b) +
                                     " (divergent __syncthreads or shuffle)");
            return -1;
        }
    }
    emu::sched = nullptr;
    return 0;
}

// Run kernel `name` with `nslots` argument slots (see emu_run). Returns 0, or -1 with a message
// in `err`.
extern "C" int spark_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned shared_bytes,
                                const uint64_t* slots, unsigned nslots, char* err, size_t errlen) {
    const Kernel* k = emu_find(name);
    if (!k) {
        set_err(err, errlen, std::string("no kernel named ") + name);
        return -1;
    }
    if (k->arity != nslots) {
        set_err(err, errlen, std::string(name) + " takes " + std::to_string(k->arity) + " arguments, not " +
                                 std::to_string(nslots));
        return -1;
    }
    return emu_run(k, grid, block, shared_bytes, slots, err, errlen);
}
