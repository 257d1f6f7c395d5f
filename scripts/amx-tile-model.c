// A minimal model of the AMX BF16 prefill micro-kernel of backend-cpu/src/kernels/amx.rs, to see
// what the tile unit itself allows on a machine (Linux, x86-64 with AMX-BF16):
//
//   gcc -O2 -mamx-tile -mamx-bf16 scripts/amx-tile-model.c -o /tmp/amx-tile-model
//   /tmp/amx-tile-model [reps]
//
// It prints, per core (one thread; run two at once to load both cores):
//   - "products": tdpbf16ps alone, four independent C tiles (the unit's issue rate);
//   - "loads": 1 KiB tileloadd from L1 alone;
//   - "2x2, L1": the kernel's step (two weight tiles, two activation tiles, four products) with
//     every tile from the same L1 addresses;
//   - "kernel shape": the kernel's loop as amx.rs runs it for a 512-token prefill of 256 weight
//     rows with k = 2048: packed weight tiles of one 32-row block (32 KiB, L1) against every
//     token pair's activation tiles (512 KiB per 512-wide k slice, L2), the C tiles of each
//     (row block, token pair) reloaded and stored around each slice.
// Multiply-adds per second count 16 x 16 x 32 per product. The data are small random bf16 values.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg;

// One step's tile loads: weights into tmm4-5, activations into tmm6-7 (64-byte rows).
#define LOAD_STEP(a0, a1, b0, b1) \
    do {                          \
        _tile_loadd(4, a0, 64);   \
        _tile_loadd(5, a1, 64);   \
        _tile_loadd(6, b0, 64);   \
        _tile_loadd(7, b1, 64);   \
    } while (0)

// One step's four products into the C tiles tmm0-3.
#define PRODUCTS()                \
    do {                          \
        _tile_dpbf16ps(0, 4, 6);  \
        _tile_dpbf16ps(1, 4, 7);  \
        _tile_dpbf16ps(2, 5, 6);  \
        _tile_dpbf16ps(3, 5, 7);  \
    } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t *bf16_buffer(size_t n) {
    uint16_t *p = aligned_alloc(64, n * 2);
    for (size_t i = 0; i < n; i++) p[i] = (uint16_t)(0x3c00 + (rand() & 0x3ff)) ^ (uint16_t)((rand() & 1) << 15);
    return p;
}

int main(int argc, char **argv) {
    setvbuf(stdout, 0, _IONBF, 0);
    long reps = argc > 1 ? atol(argv[1]) : 100000;
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if (syscall(SYS_arch_prctl, 0x1023, 18)) {
        perror("AMX tile permission");
        return 1;
    }
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);

    const int n = 512, k = 2048, m = 256, kc = 16;
    const int ksteps = k / 32, tblocks = n / 16, tpairs = tblocks / 2, rblocks = m / 32;
    uint16_t *xp = bf16_buffer((size_t)tblocks * ksteps * 512);
    uint16_t *ap = bf16_buffer(2 * kc * 512);
    float *cb = aligned_alloc(64, (size_t)rblocks * tpairs * 4 * 1024);
    memset(cb, 0, (size_t)rblocks * tpairs * 4 * 1024);
    double t;

    LOAD_STEP(ap, ap + 512, xp, xp + 512);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    t = now();
    for (long i = 0; i < reps; i++) PRODUCTS();
    t = now() - t;
    printf("products:     %5.1f ns per tdpbf16ps, %5.0f GMAC/s\n", t / reps / 4 * 1e9, reps * 4 * 8192.0 / t * 1e-9);

    t = now();
    for (long i = 0; i < reps; i++) LOAD_STEP(ap, ap + 512, xp, xp + 512);
    t = now() - t;
    printf("loads:        %5.1f ns per 1 KiB tileloadd (L1)\n", t / reps / 4 * 1e9);

    t = now();
    for (long i = 0; i < reps; i++) {
        LOAD_STEP(ap, ap + 512, xp, xp + 512);
        PRODUCTS();
    }
    t = now() - t;
    printf("2x2, L1:      %5.1f ns per step, %5.0f GMAC/s\n", t / reps * 1e9, reps * 4 * 8192.0 / t * 1e-9);

    double best = 1e9;
    long passes = reps / 10000 + 1;
    for (long p = 0; p < passes; p++) {
        t = now();
        for (int s0 = 0; s0 < ksteps; s0 += kc)
            for (int rb = 0; rb < rblocks; rb++)
                for (int tp = 0; tp < tpairs; tp++) {
                    float *c = cb + (size_t)(rb * tpairs + tp) * 1024;
                    if (s0 == 0) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        _tile_loadd(0, c, 64);
                        _tile_loadd(1, c + 256, 64);
                        _tile_loadd(2, c + 512, 64);
                        _tile_loadd(3, c + 768, 64);
                    }
                    const uint16_t *b0 = xp + ((size_t)(2 * tp) * ksteps + s0) * 512;
                    const uint16_t *b1 = xp + ((size_t)(2 * tp + 1) * ksteps + s0) * 512;
                    for (int s = 0; s < kc; s++) {
                        LOAD_STEP(ap + s * 512, ap + (kc + s) * 512, b0 + s * 512, b1 + s * 512);
                        PRODUCTS();
                    }
                    _tile_stored(0, c, 64);
                    _tile_stored(1, c + 256, 64);
                    _tile_stored(2, c + 512, 64);
                    _tile_stored(3, c + 768, 64);
                }
        t = now() - t;
        if (t < best) best = t;
    }
    printf("kernel shape: %5.2f ms per 512 x 2048 x 256, %5.0f GMAC/s (best of %ld)\n", best * 1e3,
           (double)n * k * m / best * 1e-9, passes);
    _tile_release();
    return 0;
}
