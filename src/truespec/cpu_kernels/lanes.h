/* A dot product whose summation order is fixed: 16 interleaved partial sums (element d goes to sum d % 16), combined
 * in a fixed tree. Vectorised as 16 independent lanes, the same bits on any machine (with -ffp-contract=off), and for
 * a row the same whatever rows the caller computes beside it. */
#ifndef TRUESPEC_LANES_H
#define TRUESPEC_LANES_H
#include <stdint.h>

#define LANES 16

#define DEFINE_LANE_DOT(T, SUFFIX)                                                                                  \
    static inline T lane_dot_##SUFFIX(const T *a, const T *b, int64_t n) {                                          \
        T part[LANES] = {0};                                                                                         \
        int64_t d = 0;                                                                                               \
        for (; d + LANES <= n; d += LANES)                                                                           \
            for (int i = 0; i < LANES; i++) part[i] = part[i] + a[d + i] * b[d + i];                                \
        for (int i = 0; d + i < n; i++) part[i] = part[i] + a[d + i] * b[d + i];                                    \
        for (int width = LANES / 2; width > 0; width /= 2)                                                           \
            for (int i = 0; i < width; i++) part[i] = part[i] + part[i + width];                                    \
        return part[0];                                                                                              \
    }

DEFINE_LANE_DOT(float, f32)
DEFINE_LANE_DOT(double, f64)

/* dots[k] = lane_dot(a, b[k], n) for 16 vectors b[k]; with AVX-512 (float, n a multiple of 16) the tree's four levels
 * are done for the 16 at once, two vectors' partial sums per add: for each k the same products, partial sums and
 * tree, so the same bits. */
static inline void dots16_f64(const double *a, const double *const *b, int64_t n, double *dots) {
    for (int k = 0; k < 16; k++) dots[k] = lane_dot_f64(a, b[k], n);
}

#if !defined(__AVX512F__)
static inline void dots16_f32(const float *a, const float *const *b, int64_t n, float *dots) {
    for (int k = 0; k < 16; k++) dots[k] = lane_dot_f32(a, b[k], n);
}
#else
#include <immintrin.h>
static inline void dots16_f32(const float *a, const float *const *b, int64_t n, float *dots) {
    if (n % 16) {
        for (int k = 0; k < 16; k++) dots[k] = lane_dot_f32(a, b[k], n);
        return;
    }
    __m512 v[16], w[8];
    for (int k = 0; k < 16; k++) {
        __m512 part = _mm512_setzero_ps();
        for (int64_t d = 0; d < n; d += 16)
            part = _mm512_add_ps(part, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b[k] + d)));
        v[k] = part;
    }
    for (int m = 0; m < 8; m++) /* width 8: part[i] + part[i + 8]; vector m holds k = 2m, 2m + 1 */
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; m++) /* width 4; 128-bit chunk c of vector m holds k = 4m + c */
        v[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; m++) /* width 2; chunk c of vector m: k = 8m + c (lanes 0-1), 8m + 4 + c (lanes 2-3) */
        w[m] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * m], v[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * m], v[2 * m + 1], 0xEE));
    /* width 1; lane 4c + j holds k = 4j + c */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __m512i by_k = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_ps(dots, _mm512_permutexvar_ps(by_k, sums));
}
#endif
#endif
