/* A whole Qwen3.5 Gated DeltaNet decoder layer for a step on the CPU in one call (build.py builds it, gdn_layer.py
 * calls it; models/qwen3_5.py's Qwen3_5DecoderLayer is the layer): add + RMSNorm, in_proj, the GDN core, out_proj,
 * add + RMSNorm, and the SwiGLU MLP (mlp_block.c), with no Python between the stages (one layer was ~25 torch and
 * ctypes calls, most of a small model's decode step on the CPU). Each stage is the function that computes it alone
 * (stages.h), on the same rows in the same order, so a row's bits never depend on the rest of the step, as in each of
 * them; the MLP's act(gate) * up is SiLU from vexp.h, then the product. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stages.h"

#define DEFINE_GDN_LAYER(T, SUFFIX)                                                                                  \
    int gdn_layer_##SUFFIX(                                                                                          \
        const T *h, const T *residual, int64_t M, int64_t D, /* [M, D] in; residual NULL: h starts the stream */    \
        const T *norm_w, T norm_eps, int norm_unit, const T *post_w, T post_eps, int post_unit,                      \
        const T *in_packed, int64_t N_in, const T *out_packed, const T *gate_up_packed, int64_t I,                  \
        const T *down_packed, /* the four projections, packed by linear.py */                                       \
        const T *conv_w, const T *A_log, const T *dt_bias, const T *gated_w, T gated_eps,                            \
        T *conv_state, int64_t conv_slot, T *ssm_state, int64_t ssm_slot,                                            \
        const int64_t *qsl, const int64_t *src, const int64_t *dst, const int64_t *wstart, int64_t R,              \
        int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t K, T scale, T l2_eps,                             \
        T *work, /* scratch: M * (3 D + N_in + HV DV + 3 I) */                                                       \
        T *out, T *residual_out /* [M, D] each: the MLP's output, the stream after the GDN (the layer's result) */) { \
        const int64_t C = 2 * HK * DK + HV * DV, VD = HV * DV;                                                      \
        T *x1 = work, *proj = x1 + M * D, *core = proj + M * N_in, *attn = core + M * VD, *x2 = attn + M * D;        \
        /* the stream before the GDN: residual + h (kept in residual_out, which the second add updates in place) */ \
        rms_norm_##SUFFIX(h, D, residual, D, norm_w, M, D, norm_eps, norm_unit, x1, D, residual ? residual_out : 0, D); \
        const T *stream = residual ? residual_out : h;                                                               \
        linear_##SUFFIX(x1, D, in_packed, 0, M, N_in, D, proj, N_in); /* q | k | v, z, b, a */                     \
        memset(core, 0, sizeof(T) * M * VD); /* rows no request owns stay zero */                                    \
        if (gdn_core_##SUFFIX(proj, N_in, proj + C, N_in, proj + C + VD + HV, proj + C + VD, N_in, conv_w, A_log,    \
                              dt_bias, gated_w, conv_state, conv_slot, ssm_state, ssm_slot, qsl, src, dst, wstart, R, \
                              HK, HV, DK, DV, K, scale, gated_eps, l2_eps, core))                                   \
            return 1;                                                                                                \
        linear_##SUFFIX(core, VD, out_packed, 0, M, D, VD, attn, D);                                                 \
        return mlp_block_##SUFFIX(attn, stream, M, D, post_w, post_eps, post_unit, gate_up_packed, I, down_packed, x2, \
                                  out, residual_out);                                                         \
    }

/* The bound form: what a step does not change (weights, states, shapes) copied once into a heap block by
 * gdn_layer_bind (freed with bound_free, decoder_stack.c), so that a step's call (gdn_layer_run, or decoder_stack.c's
 * loop over layers) passes only the step's rows and metadata. */
#define DEFINE_GDN_LAYER_BOUND(T, SUFFIX)                                                                            \
    typedef struct {                                                                                                 \
        const T *norm_w, *post_w, *in_packed, *out_packed, *gate_up_packed, *down_packed, *conv_w, *A_log, *dt_bias, \
            *gated_w;                                                                                                \
        T norm_eps, post_eps, gated_eps, scale, l2_eps, *conv_state, *ssm_state;                                     \
        int norm_unit, post_unit;                                                                                    \
        int64_t D, N_in, I, conv_slot, ssm_slot, HK, HV, DK, DV, K;                                                  \
    } gdn_bound_##SUFFIX;                                                                                            \
    void *gdn_layer_bind_##SUFFIX(int64_t D, const T *norm_w, T norm_eps, int norm_unit, const T *post_w,          \
                                  T post_eps, int post_unit, const T *in_packed, int64_t N_in, const T *out_packed,  \
                                  const T *gate_up_packed, int64_t I, const T *down_packed, const T *conv_w,        \
                                  const T *A_log, const T *dt_bias, const T *gated_w, T gated_eps, T *conv_state,   \
                                  int64_t conv_slot, T *ssm_state, int64_t ssm_slot, int64_t HK, int64_t HV,        \
                                  int64_t DK, int64_t DV, int64_t K, T scale, T l2_eps) {                            \
        gdn_bound_##SUFFIX *b = malloc(sizeof *b);                                                                   \
        if (!b) return 0;                                                                                            \
        *b = (gdn_bound_##SUFFIX){norm_w, post_w, in_packed, out_packed, gate_up_packed, down_packed, conv_w, A_log, \
                                  dt_bias, gated_w, norm_eps, post_eps, gated_eps, scale, l2_eps, conv_state,         \
                                  ssm_state, norm_unit, post_unit, D, N_in, I, conv_slot, ssm_slot, HK, HV, DK, DV,   \
                                  K};                                                                                \
        return b;                                                                                                    \
    }                                                                                                                \
    int gdn_layer_run_##SUFFIX(const void *bound, const T *h, const T *residual, int64_t M, const int64_t *qsl,     \
                               const int64_t *src, const int64_t *dst, const int64_t *wstart, int64_t R, T *work,   \
                               T *out, T *residual_out) {                                                            \
        const gdn_bound_##SUFFIX *b = bound;                                                                         \
        return gdn_layer_##SUFFIX(h, residual, M, b->D, b->norm_w, b->norm_eps, b->norm_unit, b->post_w, b->post_eps, \
                                  b->post_unit, b->in_packed, b->N_in, b->out_packed, b->gate_up_packed, b->I,       \
                                  b->down_packed, b->conv_w, b->A_log, b->dt_bias, b->gated_w, b->gated_eps,         \
                                  b->conv_state, b->conv_slot, b->ssm_state, b->ssm_slot, qsl, src, dst, wstart, R,  \
                                  b->HK, b->HV, b->DK, b->DV, b->K, b->scale, b->l2_eps, work, out, residual_out);   \
    }

DEFINE_GDN_LAYER(float, f32)
DEFINE_GDN_LAYER(double, f64)
DEFINE_GDN_LAYER_BOUND(float, f32)
DEFINE_GDN_LAYER_BOUND(double, f64)
