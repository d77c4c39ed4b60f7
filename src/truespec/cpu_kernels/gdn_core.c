/* One Gated DeltaNet layer's core for a step on the CPU: causal conv + SiLU, L2-normalised q / k, the gates, the
 * gated delta rule and the gated RMSNorm, request by request and token by token (build.py builds it, gdn.py calls it;
 * ops/gdn.py, ops/conv.py and ops/norm.py are the formulas, in torch).
 *
 * The slot protocol is the Triton kernels' (layers/gdn.py): request r starts from slot src[r] (-1: zeros), and
 * after each query token t >= wstart[r] keeps its conv window and state in slot dst[r] + t - wstart[r] (dst -1:
 * nothing). Every source slot is copied before any slot is written. A token's arithmetic depends on its request's
 * inputs only, in a fixed order (sums over a head's dims first to last, conv taps oldest first), so a row's bits never
 * depend on the rest of the step. Compiled with -ffp-contract=off: no fused multiply-add, the same bits on every x86
 * or ARM machine (vectorisation here only runs independent lanes side by side: the conv runs channel-parallel, tap
 * by tap, and its SiLUs and the output gate's use vexp.h's arithmetic exp, which vectorises where libm's does not).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stages.h"
#include "vexp.h"

#define DEFINE_GDN_CORE(T, SUFFIX, EXP, SILU, SQRT, LOG1P)                                                           \
    int gdn_core_##SUFFIX(                                                                                           \
        const T *x, int64_t ld_x,           /* [tokens, C] conv inputs q | k | v, row stride ld_x */                 \
        const T *z, int64_t ld_z,           /* [tokens, HV * DV] the output gate */                                  \
        const T *a, const T *b, int64_t ld_ab, /* [tokens, HV] each */                                             \
        const T *conv_w,                    /* [C, K] */                                                             \
        const T *A_log, const T *dt_bias,   /* [HV] */                                                               \
        const T *norm_w,                    /* [DV] */                                                               \
        T *conv_state, int64_t conv_slot,   /* [slots, C, K - 1], slot stride conv_slot */                           \
        T *ssm_state, int64_t ssm_slot,     /* [slots, HV, DK, DV], slot stride ssm_slot */                          \
        const int64_t *qsl, const int64_t *src, const int64_t *dst, const int64_t *wstart, int64_t R,              \
        int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t K, T scale, T norm_eps, T l2_eps,                 \
        T *out /* [tokens, HV * DV]: rows of the requests' tokens written, others left as they are */) {          \
        const int64_t C = 2 * HK * DK + HV * DV, W = K - 1, S = HV * DK * DV, rep = HV / HK;                       \
        /* A plain decode batch (every request one token, kept in its own source slot, no slot shared) updates its    \
         * slots where they are; any other step first copies every source (every read before any write). */        \
        int in_place = 1;                                                                                            \
        for (int64_t r = 0; r < R && in_place; r++) {                                                                \
            const int64_t len = qsl[r + 1] - qsl[r];                                                                 \
            in_place = len == 0 || (len == 1 && src[r] >= 0 && dst[r] == src[r] && wstart[r] == 0);                \
            for (int64_t o = 0; o < r && in_place && len; o++) in_place = qsl[o + 1] == qsl[o] || src[o] != src[r]; \
        }                                                                                                            \
        /* per-token scratch; copies of the sources only where slots are not updated in place (no large allocation,    \
         * and so no mmap / munmap, for a plain decode batch) */                                                       \
        /* The scratch at a fixed place in a page: from the heap, its address bits 0-11 against the state rows the   \
         * delta rule streams varied by process, and some processes ran the core ~1.6x slower (4K aliasing of the   \
         * accumulators' stores with those loads; benchmarks/cpu_kernel_speed.py: 120 or 190-200 us at 16 decodes) */ \
        void *block = 0;                                                                                             \
        if (posix_memalign(&block, 4096, sizeof(T) * (C + 2 * HK * DK + 2 * DV) + 64)) block = 0;                  \
        T *y = block ? (T *)((char *)block + 64) : 0;                                                                \
        T *windows = in_place ? 0 : malloc(sizeof(T) * (R * C * W + R * S));                                        \
        if (!y || (!in_place && !windows)) { free(block); free(windows); return 1; }                                \
        T *states = in_place ? 0 : windows + R * C * W, *qn = y + C, *kn = qn + HK * DK, *kv = kn + HK * DK;         \
        T *o = kv + DV;                                                                                              \
        for (int64_t r = 0; r < R && !in_place; r++) { /* every read of a source slot before any write */          \
            if (src[r] >= 0) {                                                                                       \
                memcpy(windows + r * C * W, conv_state + src[r] * conv_slot, sizeof(T) * C * W);                    \
                memcpy(states + r * S, ssm_state + src[r] * ssm_slot, sizeof(T) * S);                               \
            } else {                                                                                                 \
                memset(windows + r * C * W, 0, sizeof(T) * C * W);                                                   \
                memset(states + r * S, 0, sizeof(T) * S);                                                            \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t r = 0; r < R; r++) {                                                                            \
            T *win = in_place ? conv_state + src[r] * conv_slot : windows + r * C * W;                               \
            T *st = in_place ? ssm_state + src[r] * ssm_slot : states + r * S;                                       \
            for (int64_t t = 0; t < qsl[r + 1] - qsl[r]; t++) {                                                      \
                const int64_t row = qsl[r] + t;                                                                      \
                const T *xt = x + row * ld_x;                                                                        \
                /* y_c = w_0 x_0 + ... + w_K-1 x_t (oldest first), tap by tap over all channels; then SiLU */        \
                for (int64_t c = 0; c < C; c++) y[c] = conv_w[c * K] * (W ? win[c * W] : xt[c]);                  \
                for (int64_t j = 1; j < W; j++)                                                                      \
                    for (int64_t c = 0; c < C; c++) y[c] = y[c] + conv_w[c * K + j] * win[c * W + j];              \
                if (W)                                                                                               \
                    for (int64_t c = 0; c < C; c++) y[c] = y[c] + conv_w[c * K + W] * xt[c];                       \
                for (int64_t c = 0; c < C; c++) y[c] = SILU(y[c]);                                                  \
                for (int64_t c = 0; W && c < C; c++) { /* the window moves on by this token */                      \
                    for (int64_t j = 0; j + 1 < W; j++) win[c * W + j] = win[c * W + j + 1];                        \
                    win[c * W + W - 1] = xt[c];                                                                      \
                }                                                                                                    \
                for (int64_t h = 0; h < HK; h++) { /* l2norm(q) * scale, l2norm(k) per key head */                  \
                    const T *qh = y + h * DK, *kh = y + HK * DK + h * DK;                                            \
                    T sq = qh[0] * qh[0], sk = kh[0] * kh[0];                                                        \
                    for (int64_t d = 1; d < DK; d++) { sq = sq + qh[d] * qh[d]; sk = sk + kh[d] * kh[d]; }          \
                    const T iq = (T)1 / SQRT(sq + l2_eps), ik = (T)1 / SQRT(sk + l2_eps);                          \
                    for (int64_t d = 0; d < DK; d++) { qn[h * DK + d] = qh[d] * iq * scale; kn[h * DK + d] = kh[d] * ik; } \
                }                                                                                                    \
                for (int64_t h = 0; h < HV; h++) {                                                                   \
                    const T *q = qn + (h / rep) * DK, *k = kn + (h / rep) * DK, *v = y + 2 * HK * DK + h * DV;     \
                    const T sp = a[row * ld_ab + h] + dt_bias[h];                                                    \
                    const T g = -EXP(A_log[h]) * (sp > (T)20 ? sp : LOG1P(EXP(sp)));                               \
                    const T decay = EXP(g), beta = (T)1 / ((T)1 + EXP(-b[row * ld_ab + h]));                       \
                    T *restrict sh = st + h * DK * DV, *restrict kvr = kv, *restrict orow = o;                                                                         \
                    for (int64_t dv = 0; dv < DV; dv++) { sh[dv] = sh[dv] * decay; kvr[dv] = sh[dv] * k[0]; }       \
                    for (int64_t dk = 1; dk < DK; dk++)                                                              \
                        for (int64_t dv = 0; dv < DV; dv++) {                                                        \
                            sh[dk * DV + dv] = sh[dk * DV + dv] * decay;                                             \
                            kvr[dv] = kvr[dv] + sh[dk * DV + dv] * k[dk];                                              \
                        }                                                                                            \
                    for (int64_t dv = 0; dv < DV; dv++) kvr[dv] = (v[dv] - kvr[dv]) * beta; /* delta */             \
                    for (int64_t dv = 0; dv < DV; dv++) { sh[dv] = sh[dv] + k[0] * kvr[dv]; orow[dv] = sh[dv] * q[0]; } \
                    for (int64_t dk = 1; dk < DK; dk++)                                                              \
                        for (int64_t dv = 0; dv < DV; dv++) {                                                        \
                            sh[dk * DV + dv] = sh[dk * DV + dv] + k[dk] * kvr[dv];                                    \
                            orow[dv] = orow[dv] + sh[dk * DV + dv] * q[dk];                                                \
                        }                                                                                            \
                    T ss = o[0] * o[0]; /* gated RMSNorm over the head: w * (o / rms(o)) * silu(z) */               \
                    for (int64_t dv = 1; dv < DV; dv++) ss = ss + o[dv] * o[dv];                                    \
                    const T inv = (T)1 / SQRT(ss / (T)DV + norm_eps);                                               \
                    const T *zh = z + row * ld_z + h * DV;                                                           \
                    T *oh = out + row * HV * DV + h * DV;                                                            \
                    for (int64_t dv = 0; dv < DV; dv++)                                                              \
                        oh[dv] = norm_w[dv] * (o[dv] * inv) * SILU(zh[dv]);                     \
                }                                                                                                    \
                if (!in_place && dst[r] >= 0 && t >= wstart[r]) {                                                    \
                    const int64_t slot = dst[r] + t - wstart[r];                                                     \
                    memcpy(conv_state + slot * conv_slot, win, sizeof(T) * C * W);                                   \
                    memcpy(ssm_state + slot * ssm_slot, st, sizeof(T) * S);                                          \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        free(block);                                                                                                 \
        free(windows);                                                                                               \
        return 0;                                                                                                    \
    }

DEFINE_GDN_CORE(float, f32, expf, vsilu_f32, sqrtf, log1pf)
DEFINE_GDN_CORE(double, f64, exp, vsilu_f64, sqrt, log1p)
