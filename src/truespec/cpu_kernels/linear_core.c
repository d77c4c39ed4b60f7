/* y = x W^T (+ bias) on the CPU over a packed copy of W (build.py builds it, linear.py packs W once and calls it).
 *
 * Packed layout: [panels][K][4 L]: panel p holds outputs p 4L .. p 4L + 4L - 1 (zeros past N), so a panel's weights
 * are read as one contiguous stream, 4 vectors of L lanes per k. Each output is a sum over k in order, 0 + x_0 w_0 +
 * x_1 w_1 + ..., one vector lane per output: the same arithmetic whether its row is computed in a block of 4 rows or
 * alone, so a row's bits never depend on the rows beside it (invariant 4), with no horizontal reduction. Blocks of 4
 * rows share each loaded weight vector; a single row streams the weights once at memory speed. Compiled with
 * -ffp-contract=off (see gdn_core.c); the GCC / Clang vector extension lowers to whatever SIMD the machine has.
 */
#include <stdint.h>
#include <string.h>

#include "stages.h"

typedef float vf32 __attribute__((vector_size(64)));
typedef double vf64 __attribute__((vector_size(64)));

#define DEFINE_LINEAR(T, V, SUFFIX, L)                                                                             \
    int pack_##SUFFIX(const T *w, int64_t N, int64_t K, T *packed) {                                             \
        const int64_t NR = 4 * L, panels = (N + NR - 1) / NR;                                                     \
        for (int64_t p = 0; p < panels; p++)                                                                      \
            for (int64_t k = 0; k < K; k++)                                                                       \
                for (int64_t j = 0; j < NR; j++) {                                                                \
                    const int64_t n = p * NR + j;                                                                 \
                    packed[(p * K + k) * NR + j] = n < N ? w[n * K + k] : (T)0;                                   \
                }                                                                                                 \
        return 0;                                                                                                 \
    }                                                                                                             \
    static inline V load_##SUFFIX(const T *p) { V v; memcpy(&v, p, sizeof(V)); return v; }                        \
    static inline void store_##SUFFIX(T *y, const T *bias, V v, int64_t count) { /* the first count lanes */     \
        T lanes[L];                                                                                               \
        memcpy(lanes, &v, sizeof(V));                                                                             \
        for (int64_t i = 0; i < count && i < L; i++) y[i] = bias ? lanes[i] + bias[i] : lanes[i];                \
    }                                                                                                             \
    static inline void store_panel_##SUFFIX(T *y, const T *bias, const V *a, int64_t left) {                      \
        for (int v = 0; v < 4; v++) store_##SUFFIX(y + v * L, bias ? bias + v * L : 0, a[v], left - v * L);      \
    }                                                                                                             \
    int linear_##SUFFIX(const T *x, int64_t ld_x, const T *packed, const T *bias, int64_t M, int64_t N, int64_t K, \
                        T *y, int64_t ld_y) {                                                                     \
        const int64_t NR = 4 * L, panels = (N + NR - 1) / NR;                                                     \
        for (int64_t p = 0; p < panels; p++) { /* a panel (K x 4L weights) stays in cache for every row */        \
            const T *pk = packed + p * K * NR, *bp = bias ? bias + p * NR : 0;                                    \
            int64_t m = 0;                                                                                        \
            for (; m + 4 <= M; m += 4) {                                                                          \
                V a[4][4] = {{{0}}};                                                                              \
                for (int64_t k = 0; k < K; k++) {                                                                 \
                    const V w0 = load_##SUFFIX(pk + k * NR), w1 = load_##SUFFIX(pk + k * NR + L);                 \
                    const V w2 = load_##SUFFIX(pk + k * NR + 2 * L), w3 = load_##SUFFIX(pk + k * NR + 3 * L);     \
                    for (int r = 0; r < 4; r++) {                                                                 \
                        const T xv = x[(m + r) * ld_x + k];                                                       \
                        a[r][0] = a[r][0] + xv * w0; a[r][1] = a[r][1] + xv * w1;                                 \
                        a[r][2] = a[r][2] + xv * w2; a[r][3] = a[r][3] + xv * w3;                                 \
                    }                                                                                             \
                }                                                                                                 \
                for (int r = 0; r < 4; r++) store_panel_##SUFFIX(y + (m + r) * ld_y + p * NR, bp, a[r], N - p * NR); \
            }                                                                                                     \
            for (; m < M; m++) {                                                                                  \
                V a[4] = {{0}};                                                                                   \
                for (int64_t k = 0; k < K; k++) {                                                                 \
                    const T xv = x[m * ld_x + k];                                                                 \
                    a[0] = a[0] + xv * load_##SUFFIX(pk + k * NR); a[1] = a[1] + xv * load_##SUFFIX(pk + k * NR + L); \
                    a[2] = a[2] + xv * load_##SUFFIX(pk + k * NR + 2 * L);                                        \
                    a[3] = a[3] + xv * load_##SUFFIX(pk + k * NR + 3 * L);                                        \
                }                                                                                                 \
                store_panel_##SUFFIX(y + m * ld_y + p * NR, bp, a, N - p * NR);                                   \
            }                                                                                                     \
        }                                                                                                         \
        return 0;                                                                                                 \
    }

DEFINE_LINEAR(float, vf32, f32, 16)
DEFINE_LINEAR(double, vf64, f64, 8)
