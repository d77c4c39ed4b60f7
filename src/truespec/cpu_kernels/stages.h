/* The kernels that a fused call (gdn_layer.c, attention_layer.c, mlp_block.c,
 * decoder_stack.c) runs as its stages, declared once: the files that define
 * them include this too, so the compiler checks every caller's view of a stage against its definition. */
#ifndef TRUESPEC_STAGES_H
#define TRUESPEC_STAGES_H
#include <stdint.h>

#define DECLARE_STAGES(T, SUFFIX)                                                                                    \
    int rms_norm_##SUFFIX(const T *x, int64_t ld_x, const T *residual, int64_t ld_res, const T *w, int64_t M,      \
                          int64_t D, T eps, int unit_offset, T *out, int64_t ld_out, T *sum_out, int64_t ld_sum);   \
    int linear_##SUFFIX(const T *x, int64_t ld_x, const void *packed, const T *bias, int64_t M, int64_t N, int64_t K, \
                        T *y, int64_t ld_y);                                                                         \
    int gdn_core_##SUFFIX(const T *x, int64_t ld_x, const T *z, int64_t ld_z, const T *a, const T *b, int64_t ld_ab, \
                          const T *conv_w, const T *A_log, const T *dt_bias, const T *norm_w, T *conv_state,         \
                          int64_t conv_slot, T *ssm_state, int64_t ssm_slot, const int64_t *qsl, const int64_t *src, \
                          const int64_t *dst, const int64_t *wstart, int64_t R, int64_t HK, int64_t HV, int64_t DK,  \
                          int64_t DV, int64_t K, T scale, T norm_eps, T l2_eps, T *out);                             \
    int qk_norm_rope_##SUFFIX(const T *q, int64_t q_tok, int64_t q_head, int64_t H, const T *k, int64_t k_tok,      \
                              int64_t k_head, int64_t H_kv, int64_t tokens, int64_t D, const T *cos, const T *sin,  \
                              int64_t rot, const T *q_w, const T *k_w, T eps, int unit_offset, T *q_out, T *k_out); \
    int store_kv_##SUFFIX(const T *k, int64_t k_tok, int64_t k_head, const T *v, int64_t v_tok, int64_t v_head,      \
                          const int64_t *slot_mapping, int64_t tokens, int64_t H_kv, int64_t D, T *keys, T *values); \
    int attention_rows_##SUFFIX(const T *q, int64_t q_tok, int64_t q_head, const T *keys, const T *values,          \
                                const int64_t *block_tables, int64_t bt_req, const int64_t *qsl,                     \
                                const int64_t *seq_lens, int64_t R, int64_t H, int64_t H_kv,                         \
                                int64_t D, int64_t block_size, T scale, T *out, int64_t o_tok, int64_t o_head);      \
    int sigmoid_gate_##SUFFIX(const T *x, int64_t x_tok, int64_t x_head, const T *gate, int64_t g_tok,             \
                              int64_t g_head, int64_t tokens, int64_t H, int64_t D, T *out);                         \
    int gdn_layer_run_##SUFFIX(const void *bound, const T *h, const T *residual, int64_t M, const int64_t *qsl,     \
                               const int64_t *src, const int64_t *dst, const int64_t *wstart, int64_t R, T *work,   \
                               T *out, T *residual_out);                                                             \
    int attention_layer_run_##SUFFIX(const void *bound, const T *h, const T *residual, int64_t M, const T *cos,     \
                                     const T *sin, int64_t rot, const int64_t *block_tables, int64_t bt_req,         \
                                     const int64_t *qsl, const int64_t *seq_lens, int64_t R,                         \
                                     const int64_t *slot_mapping, int64_t num_slots, T *work, T *out,              \
                                     T *residual_out);                                                               \
    int mlp_block_##SUFFIX(const T *x, const T *stream, int64_t M, int64_t D, const T *norm_w, T norm_eps,           \
                           int norm_unit, const T *gate_up_packed, int64_t I, const T *down_packed, T *work, T *out, \
                           T *stream_out);

DECLARE_STAGES(float, f32)
DECLARE_STAGES(double, f64)
#undef DECLARE_STAGES
#endif
