"""kernels/code_operands.py: the PTX byte-permute lookups give exactly the centroids and value codes of the portable
path, for every code, codebook (3 / 4 bits, head dims 64..256) and 16-bit operand dtype.

On the CPU the module's PTX strings themselves run on a small emulator of the few instructions they use (``prmt``
in its default mode, bitwise ops, shifts, adds, packed 16-bit subtraction); on the GPU a kernel runs them for real
beside the select tree / ``code_floats`` path (bitwise equal)."""

import re

import pytest
import torch
import triton
import triton.language as tl

from helpers.kernels import gpu, needs_cuda  # (sets TRITON_INTERPRET before the kernels import on CPU)
from truespec.kernels import code_operands as co  # noqa: E402
from truespec.kernels.paged_attention_packed import _centroid_table  # noqa: E402
from truespec.ops.lloyd_max import lloyd_max_codebook

MASK = 0xFFFFFFFF
NARROW = {"bf16": torch.bfloat16, "f16": torch.float16}


def prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 (default mode): output byte i is byte (c >> 4i) & 7 of b:a, sign-replicated if bit 3 is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (c >> (4 * i)) & 0xF
        byte = pool[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def sub_x2(a: int, b: int, kind: str) -> int:
    """sub.rn.bf16x2 / sub.rn.f16x2 on two packed 16-bit numbers."""
    dtype = NARROW[kind]
    x = torch.tensor([a & 0xFFFF, a >> 16], dtype=torch.int32).to(torch.int16).view(dtype).float()
    y = torch.tensor([b & 0xFFFF, b >> 16], dtype=torch.int32).to(torch.int16).view(dtype).float()
    bits = (x - y).to(dtype).view(torch.int16).int() & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


def run_ptx(asm: str, operands: list[int], num_out: int) -> list[int]:
    """Run one of the module's PTX blocks on 32-bit operands ``$num_out ..``; returns ``$0 .. $num_out-1``."""
    regs = {f"${i + num_out}": v & MASK for i, v in enumerate(operands)}

    def val(x: str) -> int:
        return int(x, 16) if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [x.strip() for x in args.split(",")]
        v = [val(x) for x in src]
        if op == "prmt.b32":
            out = prmt(*v)
        elif op in ("and.b32", "or.b32", "xor.b32"):
            out = {"and": v[0] & v[1], "or": v[0] | v[1], "xor": v[0] ^ v[1]}[op.split(".")[0]]
        elif op == "shr.u32":
            out = v[0] >> v[1]
        elif op == "shl.b32":
            out = v[0] << v[1]
        elif op == "add.u32":
            out = v[0] + v[1]
        elif op == "mov.b32":
            out = v[0]
        elif (m := re.fullmatch(r"sub\.rn\.(bf16|f16)x2", op)) is not None:
            out = sub_x2(v[0], v[1], m.group(1))
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
        regs[dst] = out & MASK
    return [regs[f"${i}"] for i in range(num_out)]


def halves(words: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Two 32-bit registers of packed 16-bit numbers as 4 floats (element 0 in the low half of the first)."""
    bits = [(w >> s) & 0xFFFF for w in words for s in (0, 16)]
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype).double()


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_centroid_ptx_gives_every_centroid_in_every_lane(bits: int, head_dim: int) -> None:
    centroids = lloyd_max_codebook(head_dim, bits)[0].double()
    words = co.lut_words(centroids.float()).tolist()
    asm = (co.CENTROID_PTX_4 if bits == 4 else co.CENTROID_PTX_3).value
    gen = torch.Generator().manual_seed(bits * head_dim)
    quads = [[c] * 4 for c in range(1 << bits)] + torch.randint(0, 1 << bits, (64, 4), generator=gen).tolist()
    for which, dtype in enumerate((torch.bfloat16, torch.float16)):
        lo0, lo1, hi0, hi1 = words[4 * which : 4 * which + 4]
        for codes in quads:
            packed = sum(c << (8 * i) for i, c in enumerate(codes))
            operands = [packed] + [lo0] * 4 + [lo1] * 4 + [hi0] * 4 + [hi1] * 4
            out = halves(run_ptx(asm, operands, 2), dtype)
            assert torch.equal(out, centroids[codes]), (dtype, codes)


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_value_ptx_gives_each_code_as_its_number(name: str) -> None:
    asm = (co.VALUE_PTX_BF16 if name == "bf16" else co.VALUE_PTX_FP16).value
    for codes in [[c, 15 - c, (c * 7) % 16, c] for c in range(16)] + [[0, 1, 126, 127]]:
        packed = sum(c << (8 * i) for i, c in enumerate(codes))
        out = halves(run_ptx(asm, [packed], 2), NARROW[name])
        assert out.tolist() == codes


def test_lut_words_rejects_a_codebook_it_cannot_encode() -> None:
    centroids = lloyd_max_codebook(128, 4)[0]
    with pytest.raises(ValueError, match="symmetric"):
        co.lut_words(centroids + 1e-3)
    with pytest.raises(ValueError, match="symmetric"):
        co.lut_words(torch.linspace(-1, 1, 32))
    with pytest.raises(ValueError, match="exact"):
        co.lut_words(centroids * (1 + 2**-12))


@triton.jit
def _lookups(codes_ptr, table_ptr, out_ptr, BITS: tl.constexpr, DOT: tl.constexpr, N: tl.constexpr):
    """Per code: the centroid by ``centroid_operands`` and by the select tree, the value code by
    ``value_code_operands`` and by ``code_floats`` (rows 0-3 of out)."""
    i = tl.arange(0, N)[:, None] * 32 + tl.arange(0, 32)[None, :]
    codes = tl.load(codes_ptr + i)
    tl.store(out_ptr + i, co.centroid_operands(codes, table_ptr, BITS, DOT))
    tl.store(out_ptr + N * 32 + i, co.centroid_values(codes, table_ptr, BITS).to(DOT))
    tl.store(out_ptr + 2 * N * 32 + i, co.value_code_operands(codes, DOT))
    tl.store(out_ptr + 3 * N * 32 + i, co.code_floats(codes).to(DOT))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [3, 4])
def test_gpu_lookups_equal_the_portable_path(bits: int, dtype: torch.dtype) -> None:
    n = 64
    codes = torch.randint(0, 1 << bits, (n * 32,), device="cuda", dtype=torch.int32)
    codes[: 1 << bits] = torch.arange(1 << bits, device="cuda")
    table = _centroid_table(256, bits, torch.float32, torch.device("cuda"))
    out = torch.empty(4, n * 32, device="cuda", dtype=dtype)
    _lookups[(1,)](codes, table, out, bits, tl.float16 if dtype == torch.float16 else tl.bfloat16, n)
    centroids = lloyd_max_codebook(256, bits)[0].cuda()
    assert torch.equal(out[0].view(torch.int16), out[1].view(torch.int16))
    assert torch.equal(out[0].float(), centroids[codes.long()])
    assert torch.equal(out[2].view(torch.int16), out[3].view(torch.int16))
    assert torch.equal(out[2].float(), codes.float())
