/* y = x W^T (+ bias) on the CPU over a packed copy of W (build.py builds it, linear.py packs W once and calls it).
 *
 * Packed layout: a 64-byte header (int64 storage kind), then [panels][K][4 L]: panel p holds outputs p 4L .. p 4L +
 * 4L - 1 (zeros past N), so a panel's weights are read as one contiguous stream, 4 vectors of L lanes per k. Each
 * output is a sum over k in order, a = fma(x_k, w_k, a) from a = 0, one vector lane per output: the same arithmetic
 * whether its row is computed in a block of 4 rows or alone, so a row's bits never depend on the rows beside it
 * (invariant 4), with no horizontal reduction. Blocks of 4 rows share each loaded weight vector; a single row streams
 * the weights once at memory speed. The multiply-adds are explicit fused ones (mac_*: one rounding each, on every
 * machine); nothing else is contracted (-ffp-contract=off, see gdn_core.c). The GCC / Clang vector extension lowers
 * the rest to whatever SIMD the machine has.
 *
 * Storage: the weights in the rows' type (STORED_SAME), or as bfloat16 (STORED_BF16) when every weight is a bfloat16
 * value (a bf16 checkpoint run in float32 / float64): widening a bfloat16 to float is exact (its 16 bits become the
 * float's high half), so the products and sums are bit for bit those over the wide copy, from half (float64: a
 * quarter) of the bytes. A decode step streams every weight once, so its time is about bytes / cache bandwidth.
 */
#include <stdint.h>
#include <string.h>

#include "stages.h"

enum { STORED_SAME = 0, STORED_BF16 = 1, HEADER_BYTES = 64 };

typedef float vf32 __attribute__((vector_size(64)));
typedef double vf64 __attribute__((vector_size(64)));
typedef float vf32x8 __attribute__((vector_size(32)));
typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint16_t vu16x8 __attribute__((vector_size(16)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));
typedef uint32_t vu32x8 __attribute__((vector_size(32)));

/* a + x w per lane with one rounding (a fused multiply-add): the AVX-512 instruction where the target has it, C's
 * fma (exact by definition, in hardware or software) elsewhere, so the same bits on every machine. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf32 mac_f32(vf32 a, float x, vf32 w) {
    return (vf32)_mm512_fmadd_ps(_mm512_set1_ps(x), (__m512)w, (__m512)a);
}
static inline vf64 mac_f64(vf64 a, double x, vf64 w) {
    return (vf64)_mm512_fmadd_pd(_mm512_set1_pd(x), (__m512d)w, (__m512d)a);
}
#else
#include <math.h>
static inline vf32 mac_f32(vf32 a, float x, vf32 w) {
    for (int i = 0; i < 16; i++) a[i] = fmaf(x, w[i], a[i]);
    return a;
}
static inline vf64 mac_f64(vf64 a, double x, vf64 w) {
    for (int i = 0; i < 8; i++) a[i] = fma(x, w[i], a[i]);
    return a;
}
#endif
static inline vf32 load_same_f32(const float *p) { vf32 v; memcpy(&v, p, sizeof v); return v; }
static inline vf64 load_same_f64(const double *p) { vf64 v; memcpy(&v, p, sizeof v); return v; }
static inline vf32 load_bf16_f32(const uint16_t *p) { /* 16 bf16 -> 16 floats, exact */
    vu16x16 h;
    memcpy(&h, p, sizeof h);
    const vu32x16 bits = __builtin_convertvector(h, vu32x16) << 16;
    vf32 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
static inline vf64 load_bf16_f64(const uint16_t *p) { /* 8 bf16 -> 8 floats -> 8 doubles, exact */
    vu16x8 h;
    memcpy(&h, p, sizeof h);
    const vu32x8 bits = __builtin_convertvector(h, vu32x8) << 16;
    vf32x8 f;
    memcpy(&f, &bits, sizeof f);
    return __builtin_convertvector(f, vf64);
}

static inline uint16_t bf16_bits(float x) { uint32_t u; memcpy(&u, &x, sizeof u); return (uint16_t)(u >> 16); }

#define DEFINE_PACK(T, SUFFIX, L, W, STORED, TO_W)                                                                 \
    static void pack_##STORED##_##SUFFIX(const T *w, int64_t N, int64_t K, W *packed) {                           \
        const int64_t NR = 4 * L, panels = (N + NR - 1) / NR;                                                     \
        for (int64_t p = 0; p < panels; p++)                                                                      \
            for (int64_t k = 0; k < K; k++)                                                                       \
                for (int64_t j = 0; j < NR; j++) {                                                                \
                    const int64_t n = p * NR + j;                                                                 \
                    packed[(p * K + k) * NR + j] = n < N ? TO_W(w[n * K + k]) : (W)0;                             \
                }                                                                                                 \
    }

/* ``rows`` rows x one panel (4 x L outputs a row): each output's terms in k order, so its sum is the same whatever
 * block its row is in. Blocks of 6 rows (24 accumulators) keep the FMA units busier than blocks of 4 (BENCHMARKS.md,
 * session 25: CPU prefill and 16 decodes ~8-9% faster). */
#define ROW_BLOCK(rows, T, V, SUFFIX, L, LOAD)                                                                    \
    {                                                                                                             \
        V a[rows][4] = {{{0}}};                                                                                   \
        for (int64_t k = 0; k < K; k++) {                                                                         \
            const V w0 = LOAD(pk + k * NR), w1 = LOAD(pk + k * NR + L);                                           \
            const V w2 = LOAD(pk + k * NR + 2 * L), w3 = LOAD(pk + k * NR + 3 * L);                               \
            for (int r = 0; r < rows; r++) {                                                                      \
                const T xv = x[(m + r) * ld_x + k];                                                               \
                a[r][0] = mac_##SUFFIX(a[r][0], xv, w0); a[r][1] = mac_##SUFFIX(a[r][1], xv, w1);                 \
                a[r][2] = mac_##SUFFIX(a[r][2], xv, w2); a[r][3] = mac_##SUFFIX(a[r][3], xv, w3);                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < rows; r++) store_panel_##SUFFIX(y + (m + r) * ld_y + p * NR, bp, a[r], N - p * NR);   \
    }

/* The product over one storage: W the stored element, LOAD its widening load. */
#define DEFINE_PRODUCT(T, V, SUFFIX, L, W, STORED, LOAD)                                                           \
    static void linear_##STORED##_##SUFFIX(const T *x, int64_t ld_x, const W *packed, const T *bias, int64_t M,   \
                                           int64_t N, int64_t K, T *y, int64_t ld_y) {                            \
        const int64_t NR = 4 * L, panels = (N + NR - 1) / NR;                                                     \
        for (int64_t p = 0; p < panels; p++) { /* a panel (K x 4L weights) stays in cache for every row */        \
            const W *pk = packed + p * K * NR;                                                                    \
            const T *bp = bias ? bias + p * NR : 0;                                                               \
            int64_t m = 0;                                                                                        \
            for (; m + 6 <= M; m += 6) ROW_BLOCK(6, T, V, SUFFIX, L, LOAD)                                        \
            for (; m + 4 <= M; m += 4) ROW_BLOCK(4, T, V, SUFFIX, L, LOAD)                                        \
            for (; m < M; m++) ROW_BLOCK(1, T, V, SUFFIX, L, LOAD)                                                \
        }                                                                                                         \
    }

#define DEFINE_LINEAR(T, V, SUFFIX, L)                                                                             \
    static inline void store_##SUFFIX(T *y, const T *bias, V v, int64_t count) { /* the first count lanes */     \
        T lanes[L];                                                                                               \
        memcpy(lanes, &v, sizeof(V));                                                                             \
        for (int64_t i = 0; i < count && i < L; i++) y[i] = bias ? lanes[i] + bias[i] : lanes[i];                \
    }                                                                                                             \
    static inline void store_panel_##SUFFIX(T *y, const T *bias, const V *a, int64_t left) {                      \
        for (int v = 0; v < 4; v++) store_##SUFFIX(y + v * L, bias ? bias + v * L : 0, a[v], left - v * L);      \
    }                                                                                                             \
    static inline T same_##SUFFIX(T v) { return v; }                                                              \
    static inline uint16_t to_bf16_##SUFFIX(T v) { return bf16_bits((float)v); }                                  \
    DEFINE_PACK(T, SUFFIX, L, T, same, same_##SUFFIX)                                                             \
    DEFINE_PACK(T, SUFFIX, L, uint16_t, bf16, to_bf16_##SUFFIX)                                                   \
    DEFINE_PRODUCT(T, V, SUFFIX, L, T, same, load_same_##SUFFIX)                                                  \
    DEFINE_PRODUCT(T, V, SUFFIX, L, uint16_t, bf16, load_bf16_##SUFFIX)                                           \
    int64_t packed_bytes_##SUFFIX(int64_t N, int64_t K, int64_t stored) { /* what pack_ writes */                 \
        const int64_t NR = 4 * L, panels = (N + NR - 1) / NR;                                                     \
        return HEADER_BYTES + panels * K * NR * (stored == STORED_BF16 ? 2 : (int64_t)sizeof(T));                 \
    }                                                                                                             \
    /* stored STORED_BF16 only for weights that are all bfloat16 values (linear.py checks): else not exact */      \
    int pack_##SUFFIX(const T *w, int64_t N, int64_t K, int64_t stored, void *packed) {                           \
        memset(packed, 0, HEADER_BYTES);                                                                          \
        memcpy(packed, &stored, sizeof stored);                                                                   \
        if (stored == STORED_BF16)                                                                                \
            pack_bf16_##SUFFIX(w, N, K, (uint16_t *)((char *)packed + HEADER_BYTES));                             \
        else                                                                                                      \
            pack_same_##SUFFIX(w, N, K, (T *)((char *)packed + HEADER_BYTES));                                    \
        return 0;                                                                                                 \
    }                                                                                                             \
    int linear_##SUFFIX(const T *x, int64_t ld_x, const void *packed, const T *bias, int64_t M, int64_t N,        \
                        int64_t K, T *y, int64_t ld_y) {                                                          \
        int64_t stored;                                                                                           \
        memcpy(&stored, packed, sizeof stored);                                                                   \
        const char *data = (const char *)packed + HEADER_BYTES;                                                   \
        if (stored == STORED_BF16)                                                                                \
            linear_bf16_##SUFFIX(x, ld_x, (const uint16_t *)data, bias, M, N, K, y, ld_y);                        \
        else                                                                                                      \
            linear_same_##SUFFIX(x, ld_x, (const T *)data, bias, M, N, K, y, ld_y);                               \
        return 0;                                                                                                 \
    }

DEFINE_LINEAR(float, vf32, f32, 16)
DEFINE_LINEAR(double, vf64, f64, 8)
