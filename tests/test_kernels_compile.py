"""The attention and packed-store kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter runs a kernel as Python, so it accepts code the compiler rejects: a kernel reading a global
that is not a ``tl.constexpr`` (the packed attention kernel once read MAX_SPLITS that way and never compiled), an
op with no lowering for a dtype. ``triton.compile`` with an explicit target runs the whole pipeline, ptxas included,
on the CPU. The kernels must be defined compiled, so this runs in a subprocess without ``TRITON_INTERPRET``.
Each cache dtype's attention loop (sparse-V on; off too for the model dtype; a bf16 model's tensor-core tiles, and
an fp32 model's for two formats; each at its format's warps; fp16 fields by 16-bit loads, for k3v4_nc also by
byte loads; 4bit_nc's keys also scored 64 head dims at a time, ``key_dim_chunk``, in both loop forms) and store
kernel, the split merge kernel and the model-dtype loop at split caps 16 and 128, and the prefill kernel (model
dtype, 4bit_nc), at head_dim 256; q's Hadamard rotation (kernels/hadamard.py); and the speculative-step kernels
(kernels/spec_step.py, the drafting chain's metadata at its largest size: 64 requests, k = 8).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import importlib, inspect
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from truespec.kv_cache.formats import FORMATS
from truespec.ops.kv_quant import packed_size

attention = importlib.import_module("truespec.kernels.paged_attention")
packed = importlib.import_module("truespec.kernels.paged_attention_packed")
store = importlib.import_module("truespec.kernels.kv_store_packed")
prefill = importlib.import_module("truespec.kernels.prefill_attention")
D = 256


def compile_kernel(fn, constexprs, types, num_warps=4):
    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    source = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def attention_types(cache, q):
    return dict(out_ptr="*bf16", ws_m_ptr="*fp32", ws_l_ptr="*fp32", ws_acc_ptr="*fp32", q_ptr=q, kv_cache_ptr=cache,
                centroids_ptr="*fp32", query_start_loc_ptr="*i64", seq_lens_ptr="*i64", block_tables_ptr="*i64",
                num_prompt_rows_ptr="*i64", scale="fp64", sparse_v_threshold="fp64")


layout = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, GROUP=4, GROUP_PAD=16, BLOCK_SIZE=16, BLOCK_N=32, MAX_SPLITS=16,
              MIN_SPLIT_KEYS=64, ACC_DTYPE=tl.float32, DOT_DTYPE=tl.bfloat16, UPCAST=False, KEY_DIM_CHUNK=D,
              KEY_DIM_UNROLL=True)
model = dict(KEY_ENC=0, KEY_BITS=0, KEY_CODE_BYTES=0, VALUE_ENC=0, VALUE_BITS=0, VALUE_CODE_BYTES=0,
             FP16_ALIGNED=False)
for sparse_v in (False, True):
    compile_kernel(attention._paged_attention_kernel, dict(layout, **model, SPARSE_V=sparse_v),
                   attention_types("*bf16", "*bf16"))
for name in ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]:
    fmt = FORMATS[name]
    key_bits = fmt.key_bits or 8
    value_bits = fmt.value_bits or 8
    encoding = dict(KEY_ENC=packed.KEY_ENCODINGS[fmt.key_encoding], KEY_BITS=key_bits,
                    KEY_CODE_BYTES=packed_size(D, key_bits), VALUE_ENC=packed.VALUE_ENCODINGS[fmt.value_encoding],
                    VALUE_BITS=value_bits, VALUE_CODE_BYTES=packed_size(D, value_bits))
    # fp16 key / value scales at even addresses (every preset's contiguous cache at D 256): one 16-bit load each
    for aligned in (True, False) if name == "turboquant_k3v4_nc" else (name != "fp8",):
        compile_kernel(attention._paged_attention_kernel, dict(layout, **encoding, SPARSE_V=True, FP16_ALIGNED=aligned),
                       attention_types("*u8", "*fp32" if fmt.is_rotated else "*bf16"), packed.format_num_warps(fmt))
    for unroll in (True, False) if name == "turboquant_4bit_nc" else ():  # keys scored 64 head dims at a time
        compile_kernel(attention._paged_attention_kernel, dict(layout, **encoding, SPARSE_V=True, FP16_ALIGNED=True,
                                                               KEY_DIM_CHUNK=64, KEY_DIM_UNROLL=unroll),
                       attention_types("*u8", "*fp32"))
    if name in ("turboquant_k8v4", "turboquant_4bit_nc"):  # an fp32 model: tiles decoded in fp32, IEEE products
        types = dict(attention_types("*u8", "*fp32"), out_ptr="*fp32")
        compile_kernel(attention._paged_attention_kernel, dict(layout, **encoding, SPARSE_V=True,
                                                               DOT_DTYPE=tl.float32, FP16_ALIGNED=True), types)
    compile_kernel(store._kv_store_packed_kernel,
                   dict(HEAD_DIM=D, HEAD_DIM_PAD=D, **encoding, KEY_BYTES=fmt.key_bytes(D), CODE_BLOCK=32,
                        NORM_CORRECTION=fmt.norm_correction, COMPUTE_DTYPE=tl.float32,
                        TINY=1.1754943508222875e-38,
                        IS_FP64=False),
                   dict(k_ptr="*bf16", v_ptr="*bf16", kv_cache_ptr="*u8", slot_mapping_ptr="*i64",
                        h00_ptr="*fp32", boundaries_ptr="*fp32", centroids_ptr="*fp64"))
merge = importlib.import_module("truespec.kernels.split_merge")
for cap in (16, 128):  # the merge kernel at the smallest and largest split caps the engine may use
    grid, tile = merge.merge_grid_and_tile(1, 8, D, cap, attention.MERGE_SPLITS, attention.MERGE_DIM)
    compile_kernel(merge.combine_splits_kernel, dict(HEAD_DIM=D, BLOCK_N=32, MAX_SPLITS=cap, MIN_SPLIT_KEYS=64,
                                                     **tile),
                   dict(out_ptr="*bf16", ws_m_ptr="*fp32", ws_l_ptr="*fp32", ws_acc_ptr="*fp32",
                        query_start_loc_ptr="*i64", seq_lens_ptr="*i64", num_prompt_rows_ptr="*i64"))
compile_kernel(attention._paged_attention_kernel, dict(layout, **model, SPARSE_V=False, MAX_SPLITS=128),
               attention_types("*bf16", "*bf16"))
prefill_types = dict(out_ptr="*bf16", q_ptr="*bf16", kv_cache_ptr="*bf16", centroids_ptr="*fp32",
                     query_start_loc_ptr="*i64", seq_lens_ptr="*i64", block_tables_ptr="*i64", num_rows_ptr="*i64",
                     tile_offsets_ptr="*i64", scale="fp64")
prefill_layout = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, GROUP=4, GROUP_PAD=4, BLOCK_SIZE=16, BLOCK_M=32, BLOCK_N=64,
                      ACC_DTYPE=tl.float32, DOT_DTYPE=tl.bfloat16, UPCAST=False, KEY_DIM_CHUNK=D, KEY_DIM_UNROLL=True)
compile_kernel(prefill._prefill_attention_kernel, dict(prefill_layout, **model), prefill_types)
fmt = FORMATS["turboquant_4bit_nc"]
compile_kernel(prefill._prefill_attention_kernel, dict(prefill_layout, KEY_ENC=packed.KEY_ENCODINGS[fmt.key_encoding],
               KEY_BITS=4, KEY_CODE_BYTES=packed_size(D, 4), VALUE_ENC=packed.VALUE_ENCODINGS[fmt.value_encoding],
               VALUE_BITS=4, VALUE_CODE_BYTES=packed_size(D, 4), FP16_ALIGNED=True),
               dict(prefill_types, kv_cache_ptr="*u8", q_ptr="*fp32"))
hadamard = importlib.import_module("truespec.kernels.hadamard")  # q rotated once per step, rows from bf16
for x_type in ("*bf16", "*fp32"):  # a 16-bit model's q, an fp32 model's
    compile_kernel(hadamard._rotate_rows_kernel, dict(D=D, BLOCK_R=hadamard.BLOCK_ROWS, COMPUTE_DTYPE=tl.float32),
                   dict(x_ptr=x_type, out_ptr="*fp32", h00_ptr="*fp32"))
spec = importlib.import_module("truespec.kernels.spec_step")  # a queued step's updates, a drafting chain's metadata
for fn, constexprs in ((spec._move_positions_kernel, {}), (spec._greedy_accepted_kernel, {}),
                       (spec._chain_metadata_kernel, dict(K=8, BLOCK_R=128, BLOCK_T=1024))):  # 64 requests, k 8
    compile_kernel(fn, constexprs, {p: "*i64" for p in inspect.signature(fn.fn).parameters if p.endswith("_ptr")})
print("compiled")
"""


def test_attention_and_store_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's truespec, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
