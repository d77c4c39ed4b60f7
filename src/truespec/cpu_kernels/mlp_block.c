/* A decoder layer's second half on the CPU in one call (build.py builds it; mlp_block.py and gdn_layer.c call it):
 * s = stream + x (kept: the residual stream), RMSNorm of s, gate_up, SiLU(gate) * up (vexp.h's SiLU), down. Each
 * stage is the function that runs it alone (norm_core.c, linear_core.c), so a row's bits never depend on the rest of
 * the step.
 */
#include <stdint.h>

#include "stages.h"
#include "vexp.h"

#define DEFINE_MLP_BLOCK(T, SUFFIX, SILU)                                                                            \
    int mlp_block_##SUFFIX(                                                                                          \
        const T *x, const T *stream, int64_t M, int64_t D, /* [M, D] each: the attention's output, the stream */    \
        const T *norm_w, T norm_eps, int norm_unit, const T *gate_up_packed, int64_t I, const T *down_packed,       \
        T *work, /* scratch: M * (D + 3 I) */                                                                        \
        T *out, T *stream_out /* [M, D] each: the MLP's output, stream + x (may be stream itself) */) {           \
        T *normed = work, *gate_up = normed + M * D, *act = gate_up + M * 2 * I;                                    \
        rms_norm_##SUFFIX(x, D, stream, D, norm_w, M, D, norm_eps, norm_unit, normed, D, stream_out, D);             \
        linear_##SUFFIX(normed, D, gate_up_packed, 0, M, 2 * I, D, gate_up, 2 * I);                                  \
        for (int64_t m = 0; m < M; m++) {                                                                            \
            const T *g = gate_up + m * 2 * I, *u = g + I;                                                            \
            T *am = act + m * I;                                                                                     \
            for (int64_t i = 0; i < I; i++) am[i] = SILU(g[i]) * u[i];                                              \
        }                                                                                                            \
        return linear_##SUFFIX(act, I, down_packed, 0, M, D, I, out, D);                                             \
    }

DEFINE_MLP_BLOCK(float, f32, vsilu_f32)
DEFINE_MLP_BLOCK(double, f64, vsilu_f64)
