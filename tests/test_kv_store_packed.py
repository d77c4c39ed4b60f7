"""The fused packed-cache store (kernels/kv_store_packed.py) against ``store_packed_ref(fmt.encode(k, v), ...)``:
every compressed ``kv_cache_dtype``, model dtypes fp32 / bf16 / fp64, padded slot mappings (slot -1 writes nothing,
rows past the mapping are ignored, other slots keep their bytes), and the rounding corner cases (fp8 ties and
subnormals, saturation, uniform codes at exact .5, a rotated coordinate exactly on the middle boundary, zero keys
and constant values).

Codes must equal the reference's exactly. The kernel sums x^2 and the rotation in another order than torch, so in
principle a key code may differ where a rotated coordinate sits within a few fp32 ulps of a decision boundary, and
an fp16 scale by one ulp (kernels/kv_store_packed.py); ``compare_slots`` accepts only those differences and the
interpreter tests assert there are none. Without CUDA the kernel runs in Triton's interpreter: small shapes.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.kernels import DEVICE, gpu, i64, needs_cuda, randn  # noqa: E402
from truespec.kernels.kv_store_packed import store_packed  # noqa: E402
from truespec.kv_cache.formats import FORMATS, KVFormat  # noqa: E402
from truespec.ops.attention import store_packed_ref  # noqa: E402
from truespec.ops.kv_quant import centroid_norms, hadamard, packed_size, unpack_codes  # noqa: E402
from truespec.ops.lloyd_max import lloyd_max_codebook  # noqa: E402

PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
SENTINEL = 0xA5  # the bytes of slots nobody writes


def store_both(fmt: KVFormat, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, num_blocks: int,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(kernel cache, reference cache), both starting as SENTINEL bytes."""
    shape = (num_blocks, block_size, k.shape[1], fmt.bytes_per_token(k.shape[2]))
    ours = torch.full(shape, SENTINEL, dtype=torch.uint8, device=DEVICE)
    ref = ours.clone()
    store_packed(k, v, ours, slot_mapping, fmt)
    store_packed_ref(fmt.encode(k, v), ref, slot_mapping)
    return ours, ref


def compare_slots(fmt: KVFormat, ours: torch.Tensor, ref: torch.Tensor, k: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[int, int]:  # fmt: skip
    """Assert the caches agree but for the documented differences; return (differing key codes, differing scales of
    keys whose codes all agree).

    Allowed only for Lloyd-Max keys: a code one step from the reference's where the key's float64 rotated
    coordinate lies within 1e-6 of the boundary between the two codes, and an fp16 scale one ulp away (from the
    reference's, or where a code differs, from ||k|| / ||c|| of the kernel's own codes)."""
    head_dim = k.shape[2]
    if not fmt.is_rotated:
        assert torch.equal(ours, ref)
        return 0, 0
    code_bytes, key_bytes = packed_size(head_dim, fmt.key_bits), fmt.key_bytes(head_dim)
    ours, ref = ours.view(-1, *ours.shape[2:]), ref.view(-1, *ref.shape[2:])  # [slots, H, bytes]
    assert torch.equal(ours[..., key_bytes:], ref[..., key_bytes:])  # values: exact
    written = torch.zeros(ours.shape[0], dtype=torch.bool, device=ours.device)
    written[slot_mapping[slot_mapping >= 0]] = True
    assert torch.equal(ours[~written], ref[~written])  # untouched slots keep their bytes
    rows = torch.nonzero(slot_mapping >= 0).flatten()
    slots = slot_mapping[rows]
    ours_codes = unpack_codes(ours[slots, :, :code_bytes], fmt.key_bits, head_dim).long()
    ref_codes = unpack_codes(ref[slots, :, :code_bytes], fmt.key_bits, head_dim).long()
    differ = ours_codes != ref_codes  # [rows, H, D]
    if differ.any():
        x = k[rows].double()
        rot = (x / x.norm(dim=-1, keepdim=True)) @ hadamard(head_dim, torch.float64, x.device)
        boundaries = lloyd_max_codebook(head_dim, fmt.key_bits)[1].double().to(x.device)
        assert ((ours_codes - ref_codes).abs()[differ] == 1).all()
        between = boundaries[torch.minimum(ours_codes, ref_codes)[differ]]
        assert ((rot[differ] - between).abs() < 1e-6).all(), "a key code differs away from a decision boundary"
    scales = ours[slots, :, code_bytes:key_bytes].contiguous().view(torch.int16).long().squeeze(-1)  # [rows, H]
    ref_scales = ref[slots, :, code_bytes:key_bytes].contiguous().view(torch.int16).long().squeeze(-1)
    same_codes = ~differ.any(-1)  # [rows, H]
    assert ((scales - ref_scales).abs() <= 1)[same_codes].all()  # one fp16 ulp at most (scales are >= 0)
    if not same_codes.all():  # ||c|| follows our codes: the scale is ||k|| / ||c|| of those, to an ulp
        centroids = lloyd_max_codebook(head_dim, fmt.key_bits)[0].to(ours.device)
        expected = (k[rows].double().norm(dim=-1) / centroid_norms(centroids[ours_codes])).float().half()
        expected = expected.view(torch.int16).long()
        assert ((scales - expected).abs() <= 1)[~same_codes].all()
    return int(differ.sum()), int((scales != ref_scales)[same_codes].sum())


def random_rows(num_rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    return (randn(num_rows, num_kv_heads, head_dim, dtype=dtype, gen=gen),
            randn(num_rows, num_kv_heads, head_dim, dtype=dtype, gen=gen) * 3)  # fmt: skip


def padded_slots(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    """Distinct random slots for ``num_tokens`` rows, every third row padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_store_equals_reference_encode(name: str, dtype: torch.dtype) -> None:
    """Random normal K/V, 3 seeds, head dims 16 and 32 (one chunk of value codes; 24 too, padded lanes, where nothing
    is rotated), a slot mapping shorter than k / v with padding rows: every byte equal, no code or scale differs."""
    fmt = FORMATS[name]
    for seed, head_dim in [(0, 16), (1, 32), (2, 32)] + ([] if fmt.is_rotated else [(3, 24)]):
        k, v = random_rows(14, 2, head_dim, dtype, seed)
        slot_mapping = padded_slots(12, 6 * 4, seed)  # rows 12, 13 of k / v are past the mapping
        ours, ref = store_both(fmt, k, v, slot_mapping, num_blocks=6, block_size=4)
        assert compare_slots(fmt, ours, ref, k, slot_mapping) == (0, 0)
        assert torch.equal(ours, ref)


def test_store_without_norm_correction_stores_the_norm() -> None:
    """A Lloyd-Max format without norm correction (no preset is one: the store kernel's other branch): every byte
    equals the reference's, whose key scale is fp16(||k||)."""
    fmt = dataclasses.replace(FORMATS["turboquant_4bit_nc"], norm_correction=False)
    k, v = random_rows(14, 2, 32, torch.float32, seed=4)
    slot_mapping = padded_slots(12, 6 * 4, seed=4)
    ours, ref = store_both(fmt, k, v, slot_mapping, num_blocks=6, block_size=4)
    assert torch.equal(ours, ref)
    rows = torch.nonzero(slot_mapping >= 0).flatten()
    slots = ours.view(-1, 2, fmt.bytes_per_token(32))[slot_mapping[rows]]
    scales = slots[..., 16:18].contiguous().view(torch.float16).squeeze(-1)  # after 16 code bytes
    assert torch.equal(scales, k[rows].norm(dim=-1).half())


@pytest.mark.parametrize("name", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_store_codes_equal_on_more_seeds(name: str) -> None:
    """64-dim keys (8 groups of 8 codes; values in two chunks of 32), 5 more seeds: 0 differing codes."""
    fmt = FORMATS[name]
    for seed in range(10, 15):
        k, v = random_rows(16, 2, 64, torch.float32, seed)
        slot_mapping = torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:16].to(DEVICE)
        ours, ref = store_both(fmt, k, v, slot_mapping, num_blocks=4, block_size=8)
        assert torch.equal(ours, ref), f"seed {seed}"


@pytest.mark.parametrize("name", PACKED)
def test_store_rounding_corner_cases(name: str) -> None:
    """fp8 ties (1 + 2^-4 -> 1, 1 + 3 * 2^-4 -> 1.25), subnormal ties (2^-10 -> 0, 3 * 2^-10 -> 2^-8), +-0,
    saturation (+-448 and beyond); uniform codes at exact .5 (ties to even) and a constant row (scale 0); a zero
    key (norm 0) and a key whose rotated coordinates are exactly 0 (the middle boundary: the lower code)."""
    fmt = FORMATS[name]
    head_dim = 16
    k = torch.zeros(5, 1, head_dim, dtype=torch.float32)
    k[0, 0] = torch.tensor([1 + 2**-4, 1 + 3 * 2**-4, 2**-10, 3 * 2**-10, -0.0, 0.0, 448, 460, 1e6, -1e6,
                            -(1 + 2**-4), 2**-9, 0.5, 2**-7 + 2**-11, 300, -3.5])  # fmt: skip
    k[1, 0, :2] = 1.0  # e0 + e1: half of its rotated coordinates are exactly 0
    k[3, 0] = torch.linspace(-2, 2, head_dim)
    k[4, 0] = 70000.0  # fp16 scale saturates at 65504
    v = torch.zeros_like(k)
    v[0, 0] = torch.tensor([0, 15] + [i + 0.5 for i in range(14)])  # scale 1, zero 0: codes at exact .5
    v[1, 0] = 2.5  # constant: scale 0, codes 0
    v[2, 0] = torch.linspace(-1e5, 1e5, head_dim)  # scale saturates
    v[3, 0] = k[0, 0].clamp(-500, 500)
    v[4, 0] = torch.linspace(-3, 7, head_dim)
    k, v = k.to(DEVICE), v.to(DEVICE)
    slot_mapping = i64([3, 0, 5, -1, 6])
    ours, ref = store_both(fmt, k, v, slot_mapping, num_blocks=2, block_size=4)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("name, head_dim", [("turboquant_4bit_nc", 64), ("turboquant_3bit_nc", 64),
                                            ("turboquant_3bit_nc", 4), ("turboquant_k8v4", 24)])
def test_store_launch_knobs_keep_the_bytes(name: str, head_dim: int) -> None:
    """``code_block`` (the value codes rounded and packed at a time: 8, 16, 64; at head dim 24 the last chunk's lanes
    past the head masked) and 1 or 4 warps write the default's bytes, which are the reference's; head dim 4 (its
    knobs all one chunk) packs its keys' codes without whole 8-code groups (``_store_all_codes``' other path)."""
    fmt = FORMATS[name]
    k, v = random_rows(10, 2, head_dim, torch.float32, seed=7)
    slot_mapping = padded_slots(9, 4 * 8, seed=7)
    ours, ref = store_both(fmt, k, v, slot_mapping, num_blocks=4, block_size=8)
    assert torch.equal(ours, ref)
    for code_block, num_warps in [(8, 4), (16, 4), (64, 1), (64, 4)]:
        other = torch.full_like(ours, SENTINEL)
        store_packed(k, v, other, slot_mapping, fmt, code_block=code_block, num_warps=num_warps)
        assert torch.equal(other, ours), (code_block, num_warps)
    with pytest.raises(ValueError, match="code_block 12"):
        store_packed(k, v, other, slot_mapping, fmt, code_block=12)


def test_store_rejects_a_mismatched_cache() -> None:
    k, v = random_rows(3, 2, 16, torch.float32, seed=3)
    cache = torch.zeros(2, 4, 2, FORMATS["turboquant_4bit_nc"].bytes_per_token(16), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="not a contiguous-slot uint8 cache"):
        store_packed(k, v, cache, i64([0, 1, 2]), FORMATS["turboquant_3bit_nc"])
    with pytest.raises(ValueError, match="not a packed format"):
        store_packed(k, v, cache, i64([0, 1, 2]), FORMATS["auto"])
    with pytest.raises(ValueError, match="do not fit"):
        store_packed(k[:, :1], v[:, :1], cache, i64([0, 1, 2]), FORMATS["turboquant_4bit_nc"])


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
@gpu
@needs_cuda
@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_store_equals_reference_encode(name: str, dtype: torch.dtype) -> None:
    """4096 rows of 2 kv heads of 256 (2M key codes) against torch's encode on the same GPU: values, fp8 bytes and
    untouched slots exact; key codes and scales only as documented (expected: a handful of codes at most)."""
    fmt = FORMATS[name]
    k, v = random_rows(4096 + 7, 2, 256, dtype, seed=5)
    slot_mapping = padded_slots(4096, 300 * 16, seed=5)
    ours, ref = store_both(fmt, k, v, slot_mapping, num_blocks=300, block_size=16)
    num_codes, num_scales = compare_slots(fmt, ours, ref, k, slot_mapping)
    assert num_codes <= 8 and num_scales <= 8


@gpu
@needs_cuda
def test_gpu_store_in_cuda_graph_follows_new_contents() -> None:
    """Captured once after a warm-up call, replayed with new rows and slots (padding included): equal to eager."""
    fmt = FORMATS["turboquant_k3v4_nc"]
    k, v = random_rows(9, 2, 256, torch.bfloat16, seed=6)
    slot_mapping = padded_slots(9, 64, seed=6)
    cache = torch.zeros(4, 16, 2, fmt.bytes_per_token(256), dtype=torch.uint8, device=DEVICE)
    store_packed(k, v, cache, slot_mapping, fmt)  # compile and cache the tables outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_packed(k, v, cache, slot_mapping, fmt)
    for seed in (7, 8):
        new_k, new_v = random_rows(9, 2, 256, torch.bfloat16, seed)
        k.copy_(new_k)
        v.copy_(new_v)
        slot_mapping.copy_(padded_slots(9, 64, seed))
        expected = cache.clone()
        store_packed(k, v, expected, slot_mapping, fmt)
        graph.replay()
        assert torch.equal(cache, expected)
