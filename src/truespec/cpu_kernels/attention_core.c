/* Causal attention of a step's rows (decodes, verifies, prefill chunks) over the paged KV cache on the CPU
 * (build.py builds it, attention.py calls it; ops/attention.py's paged_attention_ref is the formula).
 *
 * Query row (request r, offset j, head h) sits at position p = seq_lens[r] - query_len + j and sees keys 0 .. p of
 * its request: scores q.k * scale, their maximum, then sum exp(s - max) and sum exp(s - max) v in key order, divided
 * at the end. A row's arithmetic depends on its own query and keys only, in a fixed order (lanes.h's dot product), so its bits never depend on the rows beside it: a verify row
 * is computed as the same decode row (invariant 4). Compiled with -ffp-contract=off (see gdn_core.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lanes.h"
#include "stages.h"

#define DEFINE_ATTENTION_ROWS(T, SUFFIX, EXP)                                                                       \
    int attention_rows_##SUFFIX(                                                                                     \
        const T *q, int64_t q_tok, int64_t q_head, /* [tokens, H, D] strides */                                     \
        const T *keys, const T *values,            /* [blocks, block_size, H_kv, D] each, contiguous */             \
        const int64_t *block_tables, int64_t bt_req, const int64_t *qsl, const int64_t *seq_lens, int64_t R,       \
        int64_t H, int64_t H_kv, int64_t D, int64_t block_size, T scale,                                            \
        T *out, int64_t o_tok, int64_t o_head /* every request's rows written; padding rows left as they are */) { \
        int64_t max_keys = 1;                                                                                        \
        for (int64_t r = 0; r < R; r++) max_keys = seq_lens[r] > max_keys ? seq_lens[r] : max_keys;               \
        T *scores = malloc(sizeof(T) * max_keys);                                                                    \
        if (!scores) return 1;                                                                                       \
        const int64_t group = H / H_kv;                                                                              \
        for (int64_t r = 0; r < R; r++) {                                                                            \
            const int64_t len = qsl[r + 1] - qsl[r];                                                                 \
            if (len < 1) continue;                                                                                   \
            const int64_t *table = block_tables + r * bt_req;                                                        \
            for (int64_t j = 0; j < len; j++) {                                                                      \
                const int64_t row = qsl[r] + j, num_keys = seq_lens[r] - len + j + 1;                               \
                for (int64_t h = 0; h < H; h++) {                                                                    \
                    const T *qh = q + row * q_tok + h * q_head;                                                      \
                    const int64_t kv_head = h / group;                                                               \
                    T m = -INFINITY;                                                                                 \
                    for (int64_t n = 0; n < num_keys; n++) {                                                         \
                        const int64_t slot = table[n / block_size] * block_size + n % block_size;                   \
                        scores[n] = lane_dot_##SUFFIX(qh, keys + (slot * H_kv + kv_head) * D, D) * scale;                \
                        m = scores[n] > m ? scores[n] : m;                                                           \
                    }                                                                                                \
                    T *oh = out + row * o_tok + h * o_head, l = 0;                                                   \
                    for (int64_t d = 0; d < D; d++) oh[d] = 0;                                                       \
                    for (int64_t n = 0; n < num_keys; n++) {                                                         \
                        const int64_t slot = table[n / block_size] * block_size + n % block_size;                   \
                        const T p = EXP(scores[n] - m), *vn = values + (slot * H_kv + kv_head) * D;                \
                        l = l + p;                                                                                   \
                        for (int64_t d = 0; d < D; d++) oh[d] = oh[d] + p * vn[d];                                   \
                    }                                                                                                \
                    for (int64_t d = 0; d < D; d++) oh[d] = oh[d] / l;                                               \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        free(scores);                                                                                                \
        return 0;                                                                                                    \
    }

DEFINE_ATTENTION_ROWS(float, f32, expf)
DEFINE_ATTENTION_ROWS(double, f64, exp)

/* Store a step's keys and values at their cache slots (ops/attention.py's reshape_and_cache_ref): row t of k / v
 * [tokens, H_kv, D] (strided rows and heads) into slot slot_mapping[t] of the cache halves; slot -1 writes nothing. */
#define DEFINE_STORE_KV(T, SUFFIX)                                                                                  \
    int store_kv_##SUFFIX(const T *k, int64_t k_tok, int64_t k_head, const T *v, int64_t v_tok, int64_t v_head,      \
                          const int64_t *slot_mapping, int64_t tokens, int64_t H_kv, int64_t D, T *keys, T *values) { \
        for (int64_t t = 0; t < tokens; t++) {                                                                       \
            const int64_t slot = slot_mapping[t];                                                                    \
            if (slot < 0) continue;                                                                                  \
            for (int64_t h = 0; h < H_kv; h++) {                                                                     \
                memcpy(keys + (slot * H_kv + h) * D, k + t * k_tok + h * k_head, sizeof(T) * D);                    \
                memcpy(values + (slot * H_kv + h) * D, v + t * v_tok + h * v_head, sizeof(T) * D);                  \
            }                                                                                                        \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

DEFINE_STORE_KV(float, f32)
DEFINE_STORE_KV(double, f64)
