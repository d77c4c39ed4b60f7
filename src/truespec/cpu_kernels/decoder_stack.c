/* A step through every decoder layer of a model on the CPU in one call (build.py builds it,
 * decoder_stack.py calls it; models/qwen3_5_cpu.py decides when): for each layer its bound call (gdn_layer.c,
 * attention_layer.c) on the rows the previous layer produced, the residual stream updated in place (each layer
 * reads a row's stream before it writes it), then the model's final add + RMSNorm (norm_core.c). The same functions
 * as one call per layer, in the same order, so the bits are those of the per-layer path; what it saves is the Python
 * between layers (~40 us a layer). */
#include <stdint.h>
#include <stdlib.h>

#include "stages.h"

enum { GDN_LAYER = 0, ATTENTION_LAYER = 1 };

void bound_free(void *bound) { free(bound); }

#define DEFINE_DECODER_STACK(T, SUFFIX)                                                                              \
    int decoder_stack_##SUFFIX(                                                                                      \
        int64_t L, void *const *bound, const int64_t *kinds, /* per layer: its bound call and kind */               \
        T *h, T *h_next, T *residual, int64_t M, int64_t D, /* [M, D] each: layer 0 input, a second buffer, the stream */ \
        const int64_t *qsl, int64_t R, const int64_t *src, const int64_t *dst, const int64_t *wstart, /* GDN */    \
        const T *cos, const T *sin, int64_t rot, const int64_t *block_tables, int64_t bt_req,                       \
        const int64_t *seq_lens, const int64_t *slot_mapping, int64_t num_slots,                                   \
        const T *norm_w, T norm_eps, int norm_unit, /* the model's final norm */                                   \
        T *work, /* the largest layer's scratch */                                                                   \
        T *normed /* [M, D]: norm(last output + stream), the model's hidden states */) {                            \
        for (int64_t l = 0; l < L; l++) {                                                                            \
            const T *res_in = l ? residual : 0;                                                                      \
            const int status = kinds[l] == GDN_LAYER                                                                 \
                ? gdn_layer_run_##SUFFIX(bound[l], h, res_in, M, qsl, src, dst, wstart, R, work, h_next, residual)   \
                : attention_layer_run_##SUFFIX(bound[l], h, res_in, M, cos, sin, rot, block_tables, bt_req, qsl,     \
                                               seq_lens, R, slot_mapping, num_slots, work, h_next, residual);       \
            if (status) return status;                                                                               \
            T *t = h; h = h_next; h_next = t;                                                                        \
        }                                                                                                            \
        return rms_norm_##SUFFIX(h, D, residual, D, norm_w, M, D, norm_eps, norm_unit, normed, D, residual, D);      \
    }

DEFINE_DECODER_STACK(float, f32)
DEFINE_DECODER_STACK(double, f64)
