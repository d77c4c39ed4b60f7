"""The attention kernels' tile decoding (kernels/packed_codes.py) reads exactly the packed cache's bits: ``tile_codes``
gives the codes of the torch bit-stream reference (ops/kv_quant.py ``unpack_codes``) for every code width and head
dim the packed formats accept (the byte-plane paths, and the per-code fallback for head dims they cannot cover), 0
in masked lanes; ``load_fp16`` gives the stored fp16 with one 16-bit load or two byte loads; and the kernels take
the 16-bit load only when every fp16 field address of the cache is even.

Tiles are ragged: masked slots point at a slot of 0xFF bytes and every byte past a slot's codes is random, so a
masked or out-of-range load shows as a nonzero code. Without CUDA the kernels run in Triton's interpreter.
"""

import pytest
import torch

from helpers.kernels import DEVICE  # noqa: F401  (before truespec.kernels: sets TRITON_INTERPRET without CUDA)

triton = pytest.importorskip("triton")
tl = triton.language

from truespec.kernels.packed_codes import load_fp16, tile_codes  # noqa: E402
from truespec.kernels.paged_attention_packed import packed_cache_tiles  # noqa: E402
from truespec.kernels.triton_utils import pad_pow2  # noqa: E402
from truespec.kv_cache.formats import FORMATS  # noqa: E402
from truespec.ops.kv_quant import packed_size, unpack_codes  # noqa: E402

BLOCK_N, NUM_SLOTS = 16, 24
PACKED = [name for name, fmt in FORMATS.items() if fmt.key_encoding != "model"]


def code_cases() -> list[tuple[int, int]]:
    """(bits, head_dim) of every packed code field: power-of-two head dims for the rotated formats (4: 3-bit codes
    not a multiple of 8; 8: an odd number of code bytes), any for k8v4's values (odd, not a power of two)."""
    cases = set()
    for fmt in FORMATS.values():
        dims = [4, 8, 32] if fmt.is_rotated else [6, 17, 48]
        for head_dim in dims:
            fmt.check_head_dim(head_dim)
            cases |= {(bits, head_dim) for bits in (fmt.key_bits, fmt.value_bits) if bits}
    return sorted(cases)


@triton.jit
def _tile_kernel(cache_ptr, slot_off_ptr, is_live_ptr, codes_ptr, fields_ptr, field_offset, BITS: tl.constexpr,
                 NUM_BYTES: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK: tl.constexpr,
                 IS_EVEN: tl.constexpr):  # fmt: skip
    n = tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM_PAD)
    n_mask = tl.load(is_live_ptr + n) != 0
    slot_ptr = cache_ptr + tl.load(slot_off_ptr + n)
    kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
    codes = tile_codes(slot_ptr, n_mask, d, kv_mask, BITS, NUM_BYTES, HEAD_DIM)
    tl.store(codes_ptr + n[:, None] * HEAD_DIM_PAD + d[None, :], codes)
    tl.store(fields_ptr + n, load_fp16(slot_ptr + field_offset, n_mask, IS_EVEN))


def run_tile(bits: int, head_dim: int, slot_bytes: int, field_offset: int, is_even: bool, seed: int
             ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A ragged tile of random slots: (codes, fp16 fields) the kernel decodes, then the torch reference's."""
    gen = torch.Generator().manual_seed(seed)
    num_bytes, head_dim_pad = packed_size(head_dim, bits), pad_pow2(head_dim)
    cache = torch.randint(0, 256, (NUM_SLOTS + 1, slot_bytes), dtype=torch.uint8, generator=gen)
    cache[NUM_SLOTS] = 0xFF  # the slot masked lanes point at
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:BLOCK_N]
    is_live = torch.rand(BLOCK_N, generator=gen) < 0.7
    is_live[0] = is_live[-1] = True
    slots[~is_live] = NUM_SLOTS
    codes = torch.full((BLOCK_N, head_dim_pad), -1, dtype=torch.int32)
    fields = torch.full((BLOCK_N,), -1.0)
    _tile_kernel[(1,)](cache.to(DEVICE), (slots * slot_bytes).to(DEVICE), is_live.int().to(DEVICE), codes.to(DEVICE),
                       fields.to(DEVICE), field_offset, bits, num_bytes, head_dim, head_dim_pad, BLOCK_N, is_even)
    ref_codes = torch.zeros_like(codes)
    ref_codes[is_live, :head_dim] = unpack_codes(cache[slots[is_live], :num_bytes], bits, head_dim).int()
    ref_fields = torch.zeros_like(fields)
    halves = cache[slots[is_live], field_offset : field_offset + 2].contiguous().view(torch.float16)
    ref_fields[is_live] = halves[:, 0].float()
    return codes, fields, ref_codes, ref_fields


@pytest.mark.parametrize(("bits", "head_dim"), code_cases())
def test_tile_codes_are_the_bit_stream_codes_and_masked_lanes_zero(bits: int, head_dim: int) -> None:
    num_bytes = packed_size(head_dim, bits)
    for seed, slot_bytes in enumerate([num_bytes + 6, num_bytes + 7]):  # fields and junk past the codes
        codes, _, ref_codes, _ = run_tile(bits, head_dim, slot_bytes, num_bytes, False, seed)
        assert torch.equal(codes.cpu(), ref_codes)


@pytest.mark.parametrize("is_even", [True, False])
def test_load_fp16_reads_the_stored_half_either_way(is_even: bool) -> None:
    slot_bytes, field_offset = (40, 18) if is_even else (41, 17)  # one 16-bit load needs every address even
    _, fields, _, ref_fields = run_tile(4, 32, slot_bytes, field_offset, is_even, seed=3)
    torch.testing.assert_close(fields.cpu(), ref_fields, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("head_dim", [8, 16, 128])
@pytest.mark.parametrize("storage_offset", [0, 1])
def test_fp16_aligned_only_when_every_field_address_is_even(name: str, head_dim: int, storage_offset: int) -> None:
    fmt = FORMATS[name]
    num_blocks, block_size, num_kv_heads, slot_bytes = 3, 4, 2, fmt.bytes_per_token(head_dim)
    storage = torch.zeros(storage_offset + num_blocks * block_size * num_kv_heads * slot_bytes, dtype=torch.uint8)
    kv_cache = storage[storage_offset:].view(num_blocks, block_size, num_kv_heads, slot_bytes)
    q = torch.zeros(1, num_kv_heads, head_dim, dtype=torch.float64)
    fp16_aligned = packed_cache_tiles(q, kv_cache, fmt, head_dim)[1].encoding["FP16_ALIGNED"]
    key_bytes, value_code_bytes = fmt.key_bytes(head_dim), packed_size(head_dim, fmt.value_bits or 8)
    fields = ([packed_size(head_dim, fmt.key_bits)] if fmt.is_rotated else []) + (
        [key_bytes + value_code_bytes, key_bytes + value_code_bytes + 2] if fmt.value_encoding == "uniform" else [])
    slot_starts = torch.arange(kv_cache.numel() // slot_bytes) * slot_bytes + kv_cache.data_ptr()
    is_even = all(bool(((slot_starts + field) % 2 == 0).all()) for field in fields)
    assert fp16_aligned == (is_even and bool(fields))
    if storage_offset == 0 and head_dim >= 16:  # the shapes the engine runs: every preset takes the 16-bit loads
        assert fp16_aligned == bool(fields)
