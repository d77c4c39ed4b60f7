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
#endif
