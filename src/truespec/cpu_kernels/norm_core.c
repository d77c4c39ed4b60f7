/* RMSNorm of rows on the CPU, with the residual add in front of it (build.py builds it, norm.py calls it;
 * ops/norm.py is the formula): s = residual + x (kept), h = s / sqrt(mean(s^2) + eps), then h * (1 + w) (unit
 * offset, Qwen3.5) or w * h. A row's sum of squares is lanes.h's dot product, so a row's bits never depend on the
 * rows beside it. Compiled with -ffp-contract=off (see gdn_core.c).
 */
#include <math.h>
#include <stdint.h>

#include "stages.h"
#include "lanes.h"

#define DEFINE_RMS_NORM(T, SUFFIX, SQRT)                                                                            \
    int rms_norm_##SUFFIX(const T *x, int64_t ld_x, const T *residual, int64_t ld_res, const T *w, int64_t M,     \
                          int64_t D, T eps, int unit_offset, T *out, int64_t ld_out, T *sum_out, int64_t ld_sum) {  \
        for (int64_t m = 0; m < M; m++) {                                                                            \
            const T *xm = x + m * ld_x;                                                                              \
            T *sm = sum_out ? sum_out + m * ld_sum : 0, *om = out + m * ld_out;                                      \
            if (residual) { /* the sum first, kept: the residual stream */                                          \
                const T *rm = residual + m * ld_res;                                                                 \
                for (int64_t d = 0; d < D; d++) sm[d] = rm[d] + xm[d];                                               \
                xm = sm;                                                                                             \
            }                                                                                                        \
            const T squares = lane_dot_##SUFFIX(xm, xm, D);                                                     \
            const T inv = (T)1 / SQRT(squares / (T)D + eps);                                                         \
            if (unit_offset)                                                                                         \
                for (int64_t d = 0; d < D; d++) om[d] = (xm[d] * inv) * ((T)1 + w[d]);                                       \
            else                                                                                                     \
                for (int64_t d = 0; d < D; d++) om[d] = w[d] * (xm[d] * inv);                                                \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

DEFINE_RMS_NORM(float, f32, sqrtf)
DEFINE_RMS_NORM(double, f64, sqrt)
