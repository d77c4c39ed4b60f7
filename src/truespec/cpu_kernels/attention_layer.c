/* A whole Qwen3.5 gated-attention decoder layer for a step on the CPU in one call (build.py builds
 * it, attention_layer.py calls it; models/qwen3_5.py's Qwen3_5DecoderLayer is the layer): add + RMSNorm, the qkv
 * projection, q / k norm + RoPE, the KV store, the attention of every request's rows, the sigmoid
 * output gate, o_proj, then the post-attention norm and MLP (mlp_block.c). Each stage is the function that computes
 * it alone (stages.h) on the same rows, strides and order as the stage-by-stage path, so a row's bits are the same on
 * both paths and never depend on the rest of the step. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stages.h"

#define DEFINE_ATTENTION_LAYER(T, SUFFIX)                                                                            \
    int attention_layer_##SUFFIX(                                                                                    \
        const T *h, const T *residual, int64_t M, int64_t D, /* [M, D] in; residual NULL: h starts the stream */    \
        const T *norm_w, T norm_eps, int norm_unit, const T *post_w, T post_eps, int post_unit,                      \
        const T *qkv_packed, const T *o_packed, const T *gate_up_packed, int64_t I, const T *down_packed,           \
        const T *q_norm_w, const T *k_norm_w, T qk_eps, int qk_unit, /* per-head norms, before RoPE */              \
        const T *cos, const T *sin, int64_t rot, /* [M, rot] each */                                                \
        T *keys, T *values, int64_t block_size, /* the cache's halves [blocks, block_size, H_kv, Dh] */            \
        const int64_t *block_tables, int64_t bt_req, const int64_t *qsl, const int64_t *seq_lens, int64_t R,       \
        const int64_t *slot_mapping, int64_t num_slots,                                                              \
        int64_t H, int64_t H_kv, int64_t Dh, T scale,                                                                \
        T *work, /* scratch: M * (3 D + N_qkv + 3 H Dh + H_kv Dh + 3 I) */                                          \
        T *out, T *residual_out /* [M, D] each: the MLP's output, the stream after the attention */) {             \
        const int64_t QD = H * Dh, KD = H_kv * Dh, N_qkv = 2 * QD + 2 * KD;                                         \
        T *x1 = work, *proj = x1 + M * D, *q = proj + M * N_qkv, *k = q + M * QD, *attn = k + M * KD;                \
        T *gated = attn + M * QD, *a = gated + M * QD, *mlp_work = a + M * D;                                        \
        rms_norm_##SUFFIX(h, D, residual, D, norm_w, M, D, norm_eps, norm_unit, x1, D, residual ? residual_out : 0, D); \
        const T *stream = residual ? residual_out : h;                                                               \
        linear_##SUFFIX(x1, D, qkv_packed, 0, M, N_qkv, D, proj, N_qkv); /* per head [q | gate], then k, v */       \
        if (qk_norm_rope_##SUFFIX(proj, N_qkv, 2 * Dh, H, proj + 2 * QD, N_qkv, Dh, H_kv, M, Dh, cos, sin, rot,    \
                                  q_norm_w, k_norm_w, qk_eps, qk_unit, q, k))                                       \
            return 2;                                                                                                \
        store_kv_##SUFFIX(k, KD, Dh, proj + 2 * QD + KD, N_qkv, Dh, slot_mapping, num_slots, H_kv, Dh, keys, values); \
        memset(attn, 0, sizeof(T) * M * QD); /* rows no request owns stay zero */                                    \
        if (attention_rows_##SUFFIX(q, QD, Dh, keys, values, block_tables, bt_req, qsl, seq_lens, R, H, H_kv, Dh,   \
                                    block_size, scale, attn, QD, Dh))                                                \
            return 1;                                                                                                \
        sigmoid_gate_##SUFFIX(attn, QD, Dh, proj + Dh, N_qkv, 2 * Dh, M, H, Dh, gated);                              \
        linear_##SUFFIX(gated, QD, o_packed, 0, M, D, QD, a, D);                                                     \
        return mlp_block_##SUFFIX(a, stream, M, D, post_w, post_eps, post_unit, gate_up_packed, I, down_packed,     \
                                  mlp_work, out, residual_out);                                                      \
    }

/* The bound form, as gdn_layer.c's: weights, cache and shapes copied once (attention_layer_bind, freed with
 * bound_free); a step passes its rows, RoPE tables and metadata (attention_layer_run, or decoder_stack.c). */
#define DEFINE_ATTENTION_LAYER_BOUND(T, SUFFIX)                                                                      \
    typedef struct {                                                                                                 \
        const T *norm_w, *post_w, *qkv_packed, *o_packed, *gate_up_packed, *down_packed, *q_norm_w, *k_norm_w;      \
        T norm_eps, post_eps, qk_eps, scale, *keys, *values;                                                         \
        int norm_unit, post_unit, qk_unit;                                                                           \
        int64_t D, I, block_size, H, H_kv, Dh;                                                                       \
    } attention_bound_##SUFFIX;                                                                                      \
    void *attention_layer_bind_##SUFFIX(int64_t D, const T *norm_w, T norm_eps, int norm_unit, const T *post_w,    \
                                        T post_eps, int post_unit, const T *qkv_packed, const T *o_packed,           \
                                        const T *gate_up_packed, int64_t I, const T *down_packed,                    \
                                        const T *q_norm_w, const T *k_norm_w, T qk_eps, int qk_unit, T *keys,       \
                                        T *values, int64_t block_size, int64_t H, int64_t H_kv, int64_t Dh,          \
                                        T scale) {                                                                   \
        attention_bound_##SUFFIX *b = malloc(sizeof *b);                                                             \
        if (!b) return 0;                                                                                            \
        *b = (attention_bound_##SUFFIX){norm_w, post_w, qkv_packed, o_packed, gate_up_packed, down_packed, q_norm_w, \
                                        k_norm_w, norm_eps, post_eps, qk_eps, scale, keys, values, norm_unit,       \
                                        post_unit, qk_unit, D, I, block_size, H, H_kv, Dh};                          \
        return b;                                                                                                    \
    }                                                                                                                \
    int attention_layer_run_##SUFFIX(const void *bound, const T *h, const T *residual, int64_t M, const T *cos,     \
                                     const T *sin, int64_t rot, const int64_t *block_tables, int64_t bt_req,         \
                                     const int64_t *qsl, const int64_t *seq_lens, int64_t R,                         \
                                     const int64_t *slot_mapping, int64_t num_slots, T *work, T *out,              \
                                     T *residual_out) {                                                              \
        const attention_bound_##SUFFIX *b = bound;                                                                   \
        return attention_layer_##SUFFIX(h, residual, M, b->D, b->norm_w, b->norm_eps, b->norm_unit, b->post_w,       \
                                        b->post_eps, b->post_unit, b->qkv_packed, b->o_packed, b->gate_up_packed,   \
                                        b->I, b->down_packed, b->q_norm_w, b->k_norm_w, b->qk_eps, b->qk_unit, cos,  \
                                        sin, rot, b->keys, b->values, b->block_size, block_tables, bt_req, qsl,      \
                                        seq_lens, R, slot_mapping, num_slots, b->H, b->H_kv, b->Dh, b->scale, work,  \
                                        out, residual_out);                                                          \
    }

DEFINE_ATTENTION_LAYER(float, f32)
DEFINE_ATTENTION_LAYER(double, f64)
DEFINE_ATTENTION_LAYER_BOUND(float, f32)
DEFINE_ATTENTION_LAYER_BOUND(double, f64)
