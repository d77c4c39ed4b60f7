"""Static instruction counts of the split-KV attention kernel's key loop, per cache dtype, compiled for Hopper (sm_90)
on any machine (no GPU needed: ``triton.compile`` with an explicit target, then triton's bundled ``cuobjdump``).

    python3 benchmarks/kernel_sass.py [--kv-cache-dtypes auto fp8 ...] [--aligned-slots] [--sass-out DIR]

The kernel is compiled as the engine runs it for the Qwen3.5-0.8B attention shape in bf16 (8 q / 2 kv heads of 256,
block size 16, BLOCK_N 32, the format's warps, sparse-V off). The loop over a split's key tiles is the SASS between
the last backward branch and its target; its instructions are counted by opcode family. On an H200 the packed
kernels were issue-bound (Nsight Compute, BENCHMARKS.md session 31: ~1 program per SM, IPC 0.8-1.4), so the loop's
instructions per tile are what a change to the tile decode must cut; a GPU call then times it
(benchmarks/packed_attention_speed.py). The counts matched Nsight Compute's executed instructions on an H200 within
2-7% (BENCHMARKS.md session 31). ``--aligned-slots``: compile as if every packed slot's fields started at a multiple
of 16 bytes (the launch's strides rounded up to 16: what a block layout with one plane per field would give, with
no byte added), to see what the byte-by-byte loads of today's 262-byte slots cost. Prints a markdown table last.
"""

import argparse
import collections
import importlib
import inspect
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from truespec.kv_cache.formats import FORMATS
from truespec.ops.kv_quant import packed_size

attention = importlib.import_module("truespec.kernels.paged_attention")  # the modules (the package exports functions)
packed = importlib.import_module("truespec.kernels.paged_attention_packed")
D, GROUP, BLOCK_N = 256, 4, 32
DTYPES = ["auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
FAMILIES = {"MMA": ("HMMA",), "convert": ("F2F", "F2I", "I2F", "F2FP", "I2FP"), "permute": ("PRMT",),
            "load": ("LDG", "LDS", "LDSM", "LD"), "store": ("STS", "STG", "ST"), "shuffle": ("SHFL",),
            "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "FSEL", "FSETP"),
            "int/logic": ("IADD3", "IMAD", "LOP3", "SHF", "ISETP", "SEL", "LEA", "IMNMX", "BFE", "BMSK", "SGXT"),
            "move": ("MOV", "S2R", "CS2R", "R2UR", "UMOV", "ULDC", "ULOP3", "UIADD3", "USHF", "UISETP", "USEL"),
            "barrier": ("BAR", "DEPBAR", "WARPSYNC", "NOP")}  # fmt: skip


def compile_split_kernel(name: str, aligned_slots: bool = False) -> triton.compiler.CompiledKernel:
    """The split kernel of ``name``'s cache for a bf16 model (the engine's layout), compiled for sm_90;
    ``aligned_slots``: with the packed cache's strides and value offset rounded up to multiples of 16."""
    layout = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, GROUP=GROUP, GROUP_PAD=16, BLOCK_SIZE=16, BLOCK_N=BLOCK_N,
                  MAX_SPLITS=attention.MAX_SPLITS, MIN_SPLIT_KEYS=attention.MIN_SPLIT_KEYS, ACC_DTYPE=tl.float32,
                  DOT_DTYPE=tl.bfloat16, UPCAST=False, KEY_DIM_CHUNK=D, KEY_DIM_UNROLL=True,
                  SPARSE_V=False)  # fmt: skip
    types = dict(out_ptr="*bf16", ws_m_ptr="*fp32", ws_l_ptr="*fp32", ws_acc_ptr="*fp32", q_ptr="*bf16",
                 kv_cache_ptr="*bf16", centroids_ptr="*fp32", query_start_loc_ptr="*i64", seq_lens_ptr="*i64",
                 block_tables_ptr="*i64", num_prompt_rows_ptr="*i64", scale="fp64",
                 sparse_v_threshold="fp64")  # fmt: skip
    if name == "auto":
        encoding, warps = dict(KEY_ENC=0, KEY_BITS=0, KEY_CODE_BYTES=0, VALUE_ENC=0, VALUE_BITS=0,
                               VALUE_CODE_BYTES=0, FP16_ALIGNED=False), attention.NUM_WARPS  # fmt: skip
    else:
        fmt = FORMATS[name]
        key_bits, value_bits = fmt.key_bits or 8, fmt.value_bits or 8
        encoding = dict(KEY_ENC=packed.KEY_ENCODINGS[fmt.key_encoding], KEY_BITS=key_bits,
                        KEY_CODE_BYTES=packed_size(D, key_bits), VALUE_ENC=packed.VALUE_ENCODINGS[fmt.value_encoding],
                        VALUE_BITS=value_bits, VALUE_CODE_BYTES=packed_size(D, value_bits),
                        FP16_ALIGNED=name != "fp8")  # fmt: skip
        types.update(kv_cache_ptr="*u8", q_ptr="*fp32" if fmt.is_rotated else "*bf16")
        warps = packed.format_num_warps(fmt)
    fn = attention._paged_attention_kernel
    params = list(inspect.signature(fn.fn).parameters)
    constexprs = dict(layout, **encoding)
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    # what a launch specialises on (as triton's jit does): pointers (allocations are 256-byte aligned) and the int
    # arguments of a BS 1 decode step that are multiples of 16 get tt.divisibility 16 (vectorised loads follow)
    ints = launch_ints(name)
    if aligned_slots and name != "auto":
        ints = {k: -(-v // 16) * 16 if k.startswith("stride_cache") or k == "value_offset" else v
                for k, v in ints.items()}  # fmt: skip
    aligned = [p for p in params if signature[p].startswith("*") or ints.get(p, 1) % 16 == 0]
    source = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in constexprs.items()},
                       attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned})  # fmt: skip
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def launch_ints(name: str) -> dict[str, int]:
    """The split kernel's int arguments in the engine's BS 1 decode step over ``name``'s cache (q / out [1, 8, 256]
    contiguous; the cache [num_blocks, 16, 2, bytes] packed, [2, num_blocks, 16, 2, 256] in the model dtype; a
    block table of 2,053 blocks a request)."""
    num_blocks = 4096
    if name == "auto":
        slot_bytes, value_offset = 256, num_blocks * 16 * 2 * 256
    else:
        slot_bytes, value_offset = FORMATS[name].bytes_per_token(D), FORMATS[name].key_bytes(D)
    return dict(num_reqs=1, row_offset=0, ws_splits=attention.MAX_SPLITS, skip_prompt_rows=0, sparse_v_min_keys=0,
                stride_q_tok=8 * D, stride_q_head=D, stride_o_tok=8 * D, stride_o_head=D, value_offset=value_offset,
                stride_cache_block=16 * 2 * slot_bytes, stride_cache_slot=2 * slot_bytes, stride_cache_head=slot_bytes,
                stride_bt_req=2053)  # fmt: skip


def cuobjdump(kernel: triton.compiler.CompiledKernel, option: str) -> str:
    """The output of the cuobjdump triton ships, run with ``option`` on the kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True, check=True).stdout


def sass(kernel: triton.compiler.CompiledKernel) -> list[str]:
    """The kernel's SASS instructions, one string each, address first."""
    text = cuobjdump(kernel, "-sass")
    return [line.strip() for line in text.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]


def resources(kernel: triton.compiler.CompiledKernel) -> tuple[int, int]:
    """(registers a thread, bytes of local memory a thread: spills) from the cubin's resource usage."""
    text = cuobjdump(kernel, "-res-usage")
    return int(re.search(r"REG:(\d+)", text).group(1)), int(re.search(r"LOCAL:(\d+)", text).group(1))


def key_loop(lines: list[str]) -> list[str]:
    """The instructions of the largest loop: from the target of the backward branch spanning the most code."""
    addr = [int(re.match(r"/\*([0-9a-f]+)\*/", x).group(1), 16) for x in lines]
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line) or re.search(r"BRA.*?0x([0-9a-f]+)", line)
        if m and int(m.group(1), 16) < addr[i] and addr[i] - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), addr[i])
    return [x for x, a in zip(lines, addr, strict=True) if best[0] <= a <= best[1]]


def opcode(line: str) -> str:
    body = re.sub(r"/\*[0-9a-f]+\*/", "", line).strip().lstrip("{").strip()
    body = re.sub(r"^@!?U?P\w+\s+", "", body)
    return body.split()[0].split(".")[0] if body else ""


def families(loop: list[str]) -> dict[str, int]:
    counts = collections.Counter()
    for line in loop:
        op = opcode(line)
        family = next((f for f, ops in FAMILIES.items() if op in ops), "other")
        counts[family] += 1
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=DTYPES)
    parser.add_argument("--aligned-slots", action="store_true", help="packed slots' fields at 16-byte multiples")
    parser.add_argument("--sass-out", default=None, help="write each kernel's whole SASS here")
    args = parser.parse_args()
    rows = []
    for name in args.kv_cache_dtypes:
        kernel = compile_split_kernel(name, args.aligned_slots)
        lines = sass(kernel)
        loop = key_loop(lines)
        if args.sass_out:
            os.makedirs(args.sass_out, exist_ok=True)
            with open(os.path.join(args.sass_out, f"{name}.sass"), "w") as f:
                f.write("\n".join(lines))
        rows.append((name, len(lines), len(loop), families(loop), *resources(kernel)))
        print(rows[-1], flush=True)
    names = list(FAMILIES) + ["other"]
    aligned = ", slots' fields 16-byte aligned" if args.aligned_slots else ""
    print(f"\nsplit-KV kernel, bf16 model, head_dim {D}, BLOCK_N {BLOCK_N}, sm_90{aligned}: SASS instructions in the "
          "key-tile loop (one tile, one warp)")
    print("| kv_cache_dtype | kernel | loop | " + " | ".join(names) + " | registers | local bytes |")
    print("|---|---:|---:|" + "---:|" * len(names) + "---:|---:|")
    for name, total, loop, counts, regs, spills in rows:
        print(f"| {name} | {total} | {loop} | " + " | ".join(str(counts.get(n, 0)) for n in names)
              + f" | {regs} | {spills} |")


if __name__ == "__main__":
    main()
