/* Causal attention of a step's rows (decodes, verifies, prefill chunks) over the paged KV cache on the CPU
 * (build.py builds it, attention.py calls it; ops/attention.py's paged_attention_ref is the formula).
 *
 * Query row (request r, offset j, head h) sits at position p = seq_lens[r] - query_len + j and sees keys 0 .. p of
 * its request: scores q.k * scale, their maximum, then sum exp(s - max) and sum exp(s - max) v in key order, divided
 * at the end (exp: vexp.h's, vectorised over a row's keys). A row's arithmetic depends on its own query and keys only,
 * in a fixed order (lanes.h's dot product), so its bits never depend on the rows beside it: a verify row is computed
 * as the same decode row (invariant 4). Compiled with -ffp-contract=off (see gdn_core.c). For speed, up to ROW_TILE
 * rows of a request and the query heads of one kv head take each key and value from one load, a request's key
 * offsets are listed once (no division per key), and scores come 16 keys at a time (lanes.h's dots16); per (row,
 * head) the operations and their order stay those of the row alone (BENCHMARKS.md, session 25: CPU prefill).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lanes.h"
#include "vexp.h"
#include "stages.h"

#define ROW_TILE 4 /* query rows of a request that share each pass over its keys */

/* The rows [row0, row0 + rows) of a request and the query heads of kv head g: each key and value is loaded once for
 * all of them. Per (row, head) the operations are those of a row computed alone, in key order. ``at[n]``: where key n
 * of the request sits in the cache halves (its slot's first element of kv head 0). */
#define DEFINE_ATTENTION_TILE(T, SUFFIX, EXP)                                                                       \
    static void attention_tile_##SUFFIX(                                                                            \
        const T *q, int64_t q_tok, int64_t q_head, const T *keys, const T *values, const int64_t *at, int64_t row0,  \
        int64_t rows, int64_t first_keys, int64_t g, int64_t group, int64_t D, T scale, T *out, int64_t o_tok,       \
        int64_t o_head, T *scores, int64_t stride, T *m, T *l) {                                                     \
        const int64_t last_keys = first_keys + rows - 1; /* row t sees keys 0 .. first_keys + t - 1 */             \
        for (int64_t i = 0; i < rows * group; i++) m[i] = -INFINITY, l[i] = 0;                                     \
        for (int64_t n = 0; n < last_keys; n += 16) { /* 16 keys at a time (lanes.h's dots16: each the same sum) */ \
            const int64_t count = last_keys - n < 16 ? last_keys - n : 16;                                          \
            const T *kp[16];                                                                                         \
            T dots[16];                                                                                              \
            for (int c = 0; c < 16; c++) /* past count: the last key again (a real one), its dot unused */        \
                kp[c] = keys + at[n + (c < count ? c : count - 1)] + g * D;                                         \
            for (int64_t t = n < first_keys ? 0 : n - first_keys + 1; t < rows; t++) {                              \
                const int64_t seen = first_keys + t - n < count ? first_keys + t - n : count; /* keys it sees */      \
                for (int64_t hh = 0, k = t * group; hh < group; hh++, k++) {                                         \
                    dots16_##SUFFIX(q + (row0 + t) * q_tok + (g * group + hh) * q_head, kp, D, dots);                \
                    for (int64_t c = 0; c < seen; c++) {                                                             \
                        const T s = dots[c] * scale;                                                                 \
                        scores[k * stride + n + c] = s;                                                              \
                        m[k] = s > m[k] ? s : m[k];                                                                  \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t t = 0; t < rows; t++)                                                                           \
            for (int64_t hh = 0, k = t * group; hh < group; hh++, k++) { /* scores -> exp(s - max), vectorised */  \
                T *oh = out + (row0 + t) * o_tok + (g * group + hh) * o_head, *sk = scores + k * stride;             \
                const T mk = m[k];                                                                                   \
                for (int64_t d = 0; d < D; d++) oh[d] = 0;                                                           \
                for (int64_t n = 0; n < first_keys + t; n++) sk[n] = EXP(sk[n] - mk);                                \
            }                                                                                                        \
        for (int64_t n = 0; n < last_keys; n++) {                                                                    \
            const T *vn = values + at[n] + g * D;                                                                    \
            for (int64_t t = n < first_keys ? 0 : n - first_keys + 1; t < rows; t++)                                \
                for (int64_t hh = 0, k = t * group; hh < group; hh++, k++) {                                         \
                    const T p = scores[k * stride + n];                                                              \
                    T *oh = out + (row0 + t) * o_tok + (g * group + hh) * o_head;                                    \
                    l[k] = l[k] + p;                                                                                 \
                    for (int64_t d = 0; d < D; d++) oh[d] = oh[d] + p * vn[d];                                       \
                }                                                                                                    \
        }                                                                                                            \
        for (int64_t t = 0; t < rows; t++)                                                                           \
            for (int64_t hh = 0; hh < group; hh++) {                                                                 \
                T *oh = out + (row0 + t) * o_tok + (g * group + hh) * o_head;                                        \
                for (int64_t d = 0; d < D; d++) oh[d] = oh[d] / l[t * group + hh];                                   \
            }                                                                                                        \
    }

#define DEFINE_ATTENTION_ROWS(T, SUFFIX, EXP)                                                                       \
    DEFINE_ATTENTION_TILE(T, SUFFIX, EXP)                                                                            \
    int attention_rows_##SUFFIX(                                                                                     \
        const T *q, int64_t q_tok, int64_t q_head, /* [tokens, H, D] strides */                                     \
        const T *keys, const T *values,            /* [blocks, block_size, H_kv, D] each, contiguous */             \
        const int64_t *block_tables, int64_t bt_req, const int64_t *qsl, const int64_t *seq_lens, int64_t R,       \
        int64_t H, int64_t H_kv, int64_t D, int64_t block_size, T scale,                                            \
        T *out, int64_t o_tok, int64_t o_head /* every request's rows written; padding rows left as they are */) { \
        int64_t max_keys = 1;                                                                                        \
        for (int64_t r = 0; r < R; r++) max_keys = seq_lens[r] > max_keys ? seq_lens[r] : max_keys;               \
        const int64_t group = H / H_kv, heads = ROW_TILE * group;                                                    \
        T *scores = malloc(sizeof(T) * (heads * max_keys + 2 * heads));                                              \
        int64_t *at = malloc(sizeof(int64_t) * max_keys);                                                            \
        if (!scores || !at) {                                                                                        \
            free(scores);                                                                                            \
            free(at);                                                                                                \
            return 1;                                                                                                \
        }                                                                                                            \
        for (int64_t r = 0; r < R; r++) {                                                                            \
            const int64_t len = qsl[r + 1] - qsl[r], *table = block_tables + r * bt_req;                            \
            if (len < 1) continue;                                                                                   \
            for (int64_t n = 0, b = 0, i = 0; n < seq_lens[r]; n++, i++) { /* the request's keys, block by block */ \
                if (i == block_size) b++, i = 0;                                                                     \
                at[n] = (table[b] * block_size + i) * H_kv * D;                                                      \
            }                                                                                                        \
            for (int64_t j0 = 0; j0 < len; j0 += ROW_TILE)                                                           \
                for (int64_t g = 0; g < H_kv; g++)                                                                   \
                    attention_tile_##SUFFIX(q, q_tok, q_head, keys, values, at, qsl[r] + j0,                        \
                                            len - j0 < ROW_TILE ? len - j0 : ROW_TILE, seq_lens[r] - len + j0 + 1, g, \
                                            group, D, scale, out, o_tok, o_head, scores, max_keys,                    \
                                            scores + heads * max_keys, scores + heads * max_keys + heads);           \
        }                                                                                                            \
        free(scores);                                                                                                \
        free(at);                                                                                                    \
        return 0;                                                                                                    \
    }

DEFINE_ATTENTION_ROWS(float, f32, vexp_f32)
DEFINE_ATTENTION_ROWS(double, f64, vexp_f64)

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
