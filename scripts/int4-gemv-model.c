// A minimal model of spark's AVX2 int4 one-token GEMV tile (backend-cpu/src/kernels/qavx2.rs,
// `tile` with `SubPair` scales), used to tell what bounds AVX2 int4 decode on a machine: the
// same per-32-block arithmetic (vpmaddubsw, vpmaddwd by ones, convert, FMA by a per-block
// scale x activation scale product), four rows per tile, streamed over many matrices from
// memory on N threads (OpenMP, static split). Not part of the build; docs/BENCHMARKS.md
// (session 15) compares it with `cargo test --release -p backend-cpu --test qkernels
// bench_decode_stream -- --ignored --nocapture` on the same machine.
//
//   gcc -O3 -fopenmp -mavx2 -mfma -mf16c scripts/int4-gemv-model.c -o /tmp/int4-gemv-model
//   OMP_NUM_THREADS=2 /tmp/int4-gemv-model 2048 250    # rows per matrix, matrices
//   OMP_NUM_THREADS=1 /tmp/int4-gemv-model 512 1 2000  # ... and passes (default 7): in L2
//
// Variants: "weights only" reads the packed nibbles alone (a table of products stays in L1);
// "with sides" also reads, per tile, each row's 8-bit sub-scales k, super-block units u and f16
// biases, builds the product table from them and adds the bias term, as spark does (4.875 bits
// per weight read against 4). GB/s counts every byte read. Unlike spark's tile, neither variant
// issues software prefetches (its rows start on a cache line, and the hardware prefetchers
// alone kept it fastest here), and the threads split rows statically with no fork-join per
// call beyond OpenMP's own.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define K 2048
#define NB (K / 32)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __attribute__((always_inline)) float hsum(__m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

// Four rows at w (rb bytes apart) against activation bytes q.
static inline __attribute__((always_inline)) void tile(int sides, const uint8_t *w, size_t rb, const int8_t *q,
                                                       const float *prod0, float *out, const uint8_t *k,
                                                       const float *u, const uint16_t *bias, const float *d,
                                                       const float *ga) {
    float table[4 * NB];
    const float *prod = prod0;
    if (sides) {
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < NB; i += 8) {
                __m256 kv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k + r * NB + i))));
                __m256 s = _mm256_mul_ps(kv, _mm256_set1_ps(u[r * (NB / 8) + i / 8]));
                _mm256_storeu_ps(table + r * NB + i, _mm256_mul_ps(s, _mm256_loadu_ps(d + i)));
            }
        prod = table;
    }
    __m256 acc[4] = {0};
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(15);
    for (int c = 0; c < NB / 2; c++)
        for (int h = 0; h < 2; h++) {
            int b = 2 * c + h;
            __m256i qv = _mm256_loadu_si256((const __m256i *)(q + b * 32));
            for (int r = 0; r < 4; r++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + r * rb + c * 32));
                if (h) v = _mm256_srli_epi16(v, 4);
                v = _mm256_and_si256(v, mask);
                __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(v, qv), ones));
                acc[r] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(prod + r * NB + b), acc[r]);
            }
        }
    for (int r = 0; r < 4; r++) {
        out[r] = hsum(acc[r]);
        if (sides) {
            __m256 a = _mm256_setzero_ps();
            for (int i = 0; i < NB; i += 8) {
                __m256 kv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(k + r * NB + i))));
                __m256 s = _mm256_mul_ps(kv, _mm256_set1_ps(u[r * (NB / 8) + i / 8]));
                __m256 bw = _mm256_fmadd_ps(s, _mm256_set1_ps(-8.f),
                                            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bias + r * NB + i))));
                a = _mm256_fmadd_ps(bw, _mm256_loadu_ps(ga + i), a);
            }
            out[r] += hsum(a);
        }
    }
}

typedef struct {
    uint8_t *w, *k;
    float *u;
    uint16_t *bias;
} Mat;

static __attribute__((noinline)) void gemv(int sides, const Mat *m, int rows, const int8_t *q, const float *prod,
                                           const float *d, const float *ga, float *o) {
    const size_t rb = K / 2;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r += 4)
        tile(sides, m->w + r * rb, rb, q, prod, o + r, m->k + r * NB, m->u + r * (NB / 8), m->bias + r * NB, d, ga);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ROWS MATRICES [PASSES]\n", argv[0]);
        return 2;
    }
    int rows = atoi(argv[1]) / 4 * 4, nmat = atoi(argv[2]), passes = argc > 3 ? atoi(argv[3]) : 7;
    const size_t rb = K / 2;
    Mat *m = calloc(nmat, sizeof(Mat));
    uint32_t x = 1;
    for (int i = 0; i < nmat; i++) {
        m[i].w = aligned_alloc(64, rows * rb);
        m[i].k = aligned_alloc(64, rows * NB);
        m[i].u = aligned_alloc(64, rows * NB / 8 * 4);
        m[i].bias = aligned_alloc(64, rows * NB * 2);
        for (size_t j = 0; j < rows * rb; j += 4) *(uint32_t *)(m[i].w + j) = (x = x * 1664525u + 1013904223u);
        for (int j = 0; j < rows * NB; j++) m[i].k[j] = (uint8_t)(j * 37), m[i].bias[j] = 0x2c00;
        for (int j = 0; j < rows * NB / 8; j++) m[i].u[j] = 1e-3f;
    }
    int8_t q[K];
    float prod[4 * NB], d[NB], ga[NB], *o = malloc(rows * sizeof(float));
    for (int i = 0; i < K; i++) q[i] = (int8_t)((i * 97) % 255 - 127);
    for (int i = 0; i < 4 * NB; i++) prod[i] = 1.0f / (1 + i);
    for (int i = 0; i < NB; i++) d[i] = 0.01f, ga[i] = 1.0f;
    double best[2] = {1e9, 1e9};
    for (int it = 0; it < 7; it++)
        for (int v = 0; v < 2; v++) {
            double t = now();
            for (int p = 0; p < passes; p++)
                for (int i = 0; i < nmat; i++) gemv(v, &m[i], rows, q, prod, d, ga, o);
            t = (now() - t) / passes;
            if (t < best[v]) best[v] = t;
        }
    for (int v = 0; v < 2; v++) {
        double bytes = (double)rows * nmat * (rb + (v ? NB + NB / 8 * 4 + NB * 2 : 0));
        printf("%-13s %d x %dx%d, %d threads: %.1f GB/s, %.1f GMAC/s\n", v ? "with sides" : "weights only", nmat,
               rows, K, omp_get_max_threads(), bytes / best[v] * 1e-9, (double)rows * K * nmat / best[v] * 1e-9);
    }
    return o[0] == 12345.0f;
}
