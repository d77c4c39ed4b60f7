/* Qwen3.5 attention's output gate on the CPU (build.py builds it; activation.py and attention_layer.c call it;
 * ops/activation.py's act_mul_ref is the formula): out = x * sigmoid(gate), sigmoid(g) = 1 / (1 + exp(-g)) with
 * vexp.h's exp, for [tokens, H, D] rows of strided x and gate, into a contiguous out. Each element by itself, so a
 * row's bits never depend on the rows beside it. */
#include <stdint.h>

#include "stages.h"
#include "vexp.h"

#define DEFINE_SIGMOID_GATE(T, SUFFIX)                                                                               \
    int sigmoid_gate_##SUFFIX(const T *x, int64_t x_tok, int64_t x_head, const T *gate, int64_t g_tok,             \
                              int64_t g_head, int64_t tokens, int64_t H, int64_t D, T *out) {                        \
        for (int64_t t = 0; t < tokens; t++)                                                                         \
            for (int64_t h = 0; h < H; h++) {                                                                        \
                const T *xh = x + t * x_tok + h * x_head, *gh = gate + t * g_tok + h * g_head;                      \
                T *oh = out + (t * H + h) * D;                                                                       \
                for (int64_t d = 0; d < D; d++) oh[d] = xh[d] * ((T)1 / ((T)1 + vexp_##SUFFIX(-gh[d])));             \
            }                                                                                                        \
        return 0;                                                                                                    \
    }

DEFINE_SIGMOID_GATE(float, f32)
DEFINE_SIGMOID_GATE(double, f64)
