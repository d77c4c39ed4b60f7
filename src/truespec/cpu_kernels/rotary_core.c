/* Per-head RMSNorm of q and k (optional) and rotate-half RoPE on their first rot dims, on the CPU (build.py builds
 * it, rotary.py calls it; ops/rotary.py's qk_norm_rope_ref is the formula): x <- x / sqrt(mean(x^2) + eps) scaled by
 * (1 + w) or w, then x_i cos_i - x_{i+rot/2} sin_i (i < rot/2) and x_i cos_i + x_{i-rot/2} sin_i (rot/2 <= i < rot).
 * Each head of each token by itself, in a fixed order (lanes.h's sum of squares). Compiled with -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"
#include "stages.h"

#define MAX_HEAD_DIM 1024

#define DEFINE_QK_NORM_ROPE(T, SUFFIX, SQRT)                                                                        \
    static void head_##SUFFIX(const T *x, const T *w, T eps, int unit_offset, const T *cos, const T *sin,           \
                              int64_t D, int64_t rot, T *out) {                                                      \
        T h[MAX_HEAD_DIM];                                                                                           \
        if (w) {                                                                                                     \
            const T inv = (T)1 / SQRT(lane_dot_##SUFFIX(x, x, D) / (T)D + eps);                                      \
            for (int64_t d = 0; d < D; d++) h[d] = unit_offset ? (x[d] * inv) * ((T)1 + w[d]) : w[d] * (x[d] * inv); \
        } else {                                                                                                     \
            memcpy(h, x, sizeof(T) * D);                                                                             \
        }                                                                                                            \
        const int64_t half = rot / 2;                                                                                \
        for (int64_t d = 0; d < half; d++) out[d] = h[d] * cos[d] + (-h[d + half]) * sin[d];                         \
        for (int64_t d = half; d < rot; d++) out[d] = h[d] * cos[d] + h[d - half] * sin[d];                          \
        for (int64_t d = rot; d < D; d++) out[d] = h[d];                                                             \
    }                                                                                                                \
    int qk_norm_rope_##SUFFIX(const T *q, int64_t q_tok, int64_t q_head, int64_t H, const T *k, int64_t k_tok,      \
                              int64_t k_head, int64_t H_kv, int64_t tokens, int64_t D, const T *cos, const T *sin,  \
                              int64_t rot, const T *q_w, const T *k_w, T eps, int unit_offset, T *q_out, T *k_out) { \
        if (D > MAX_HEAD_DIM) return 1;                                                                              \
        for (int64_t t = 0; t < tokens; t++) {                                                                       \
            const T *ct = cos + t * rot, *st = sin + t * rot;                                                        \
            for (int64_t h = 0; h < H; h++)                                                                          \
                head_##SUFFIX(q + t * q_tok + h * q_head, q_w, eps, unit_offset, ct, st, D, rot, q_out + (t * H + h) * D); \
            for (int64_t h = 0; h < H_kv; h++)                                                                       \
                head_##SUFFIX(k + t * k_tok + h * k_head, k_w, eps, unit_offset, ct, st, D, rot,                     \
                              k_out + (t * H_kv + h) * D);                                                           \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

DEFINE_QK_NORM_ROPE(float, f32, sqrtf)
DEFINE_QK_NORM_ROPE(double, f64, sqrt)
