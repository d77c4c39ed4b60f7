/* RMSNorm of rows on the CPU, with the residual add in front of it (build.py builds it, norm.py calls it;
 * ops/norm.py is the formula): s = residual + x (kept), h = s / sqrt(mean(s^2) + eps), then h * (1 + w) (unit
 * offset, Qwen3.5) or w * h. A row's sum of squares runs over 16 interleaved partial sums combined in a fixed tree,
 * so a row's bits never depend on the rows beside it. Compiled with -ffp-contract=off (see gdn_core.c).
 */
#include <math.h>
#include <stdint.h>

#define LANES 16

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
            T part[LANES] = {0};                                                                                     \
            int64_t d = 0;                                                                                           \
            for (; d + LANES <= D; d += LANES)                                                                       \
                for (int i = 0; i < LANES; i++) part[i] = part[i] + xm[d + i] * xm[d + i];                          \
            for (int i = 0; d + i < D; i++) part[i] = part[i] + xm[d + i] * xm[d + i];                              \
            for (int width = LANES / 2; width > 0; width /= 2)                                                       \
                for (int i = 0; i < width; i++) part[i] = part[i] + part[i + width];                                \
            const T inv = (T)1 / SQRT(part[0] / (T)D + eps);                                                         \
            if (unit_offset)                                                                                         \
                for (d = 0; d < D; d++) om[d] = (xm[d] * inv) * ((T)1 + w[d]);                                       \
            else                                                                                                     \
                for (d = 0; d < D; d++) om[d] = w[d] * (xm[d] * inv);                                                \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

DEFINE_RMS_NORM(float, f32, sqrtf)
DEFINE_RMS_NORM(double, f64, sqrt)
