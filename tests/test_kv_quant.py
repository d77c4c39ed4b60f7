"""Compressed KV formats: exact packing, the Lloyd-Max codebooks, error bounds per preset, and bytes per token.

Error bounds are measured on random Gaussian vectors (never zeros) at head_dim 128 and documented here; the
reference numbers are in ops/kv_quant.py's and ops/lloyd_max.py's docstrings.
"""

import math

import pytest
import torch

from truespec.kv_cache.formats import FORMATS, KV_CACHE_DTYPES, bytes_per_token, compressed_layers, kv_format
from truespec.ops import kv_quant as kq
from truespec.ops.lloyd_max import codebook_codes, expected_mse, lloyd_centroids, lloyd_max_codebook

PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
# rms of (score^ - q.k) / (||q|| ||k||) at head_dim 128; measured 0.0023 / 0.0084 / 0.0161 / 0.0161
SCORE_ERROR_BOUND = {"turboquant_k8v4": 0.003, "turboquant_4bit_nc": 0.0095, "turboquant_k3v4_nc": 0.018,
                     "turboquant_3bit_nc": 0.018}
# mean ||k^ - k||^2 / ||k||^2 at head_dim 128; measured 0.0007 / 0.0092 / 0.0337 / 0.0337
KEY_MSE_BOUND = {"turboquant_k8v4": 0.001, "turboquant_4bit_nc": 0.0100, "turboquant_k3v4_nc": 0.036,
                 "turboquant_3bit_nc": 0.036}


def gaussian(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def stored_keys(name: str, k: torch.Tensor, norm_correction: bool | None = None) -> torch.Tensor:
    """Keys [T, H, D] as a preset reads them back, in the original basis."""
    fmt = kv_format(name)
    if fmt.key_encoding == "fp8":
        return kq.fp8_load(kq.fp8_store(k), dtype=k.dtype)
    nc = fmt.norm_correction if norm_correction is None else norm_correction
    return kq.dequantize_keys(kq.quantize_keys(k, fmt.key_bits, norm_correction=nc), k.dtype)


def bit_stream_reference(codes: list[int], bits: int) -> list[int]:
    """The packing layout bit by bit: code j at stream bits j*bits.., stream bit i = bit i % 8 of byte i // 8."""
    out = [0] * ((len(codes) * bits + 7) // 8)
    for j, code in enumerate(codes):
        for b in range(bits):
            i = j * bits + b
            out[i // 8] |= ((code >> b) & 1) << (i % 8)
    return out


@pytest.mark.parametrize("bits", [3, 4])
def test_bit_packing_round_trips_exactly_at_ragged_lengths(bits: int) -> None:
    for n in (1, 2, 3, 5, 7, 8, 9, 13, 16, 63, 127, 128, 129, 256):
        codes = torch.randint(0, 1 << bits, (3, 2, n), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
        packed = kq.pack_codes(codes, bits)
        assert packed.dtype == torch.uint8 and packed.shape == (3, 2, math.ceil(n * bits / 8))
        assert torch.equal(kq.unpack_codes(packed, bits, n), codes)
        assert packed[1, 0].tolist() == bit_stream_reference(codes[1, 0].tolist(), bits)
    with pytest.raises(ValueError, match="do not hold"):
        kq.unpack_codes(packed, bits, 300)


def test_hadamard_is_symmetric_orthonormal_and_its_own_inverse() -> None:
    for d in (1, 2, 4, 64, 128, 256):
        h = kq.hadamard(d, torch.float64)
        assert torch.equal(h, h.t()) and bool((h.abs() == 1 / math.sqrt(d)).all())
        torch.testing.assert_close(h @ h, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-14)
    x = gaussian(5, 2, 128)
    torch.testing.assert_close(kq.rotate(kq.rotate(x)), x, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="power of two"):
        kq.hadamard(96)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_lloyd_max_codebook_is_sorted_symmetric_with_midpoint_boundaries(head_dim: int, bits: int) -> None:
    centroids, boundaries = lloyd_max_codebook(head_dim, bits)
    assert centroids.dtype == boundaries.dtype == torch.float32
    assert centroids.shape == (1 << bits,) and boundaries.shape == ((1 << bits) - 1,)
    assert bool((centroids.diff() > 0).all()) and torch.equal(centroids, -centroids.flip(0))
    assert torch.equal(boundaries, (centroids[1:] + centroids[:-1]) / 2) and boundaries[len(boundaries) // 2] == 0
    assert bool((centroids.abs() < 1).all())


def test_lloyd_max_codebook_tends_to_the_gaussian_one() -> None:
    # Lloyd-Max centroids of N(0, 1) (Max 1960), positive half; the unit-vector coordinate is ~N(0, 1/D)
    gaussian_centroids = {3: [0.2451, 0.7560, 1.3440, 2.1520],
                          4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326]}
    for bits, expected in gaussian_centroids.items():
        exact = lloyd_centroids(256, bits)  # float64, before the codebook's rounding to bf16
        scaled = exact[1 << (bits - 1):] * 16
        torch.testing.assert_close(scaled, torch.tensor(expected, dtype=torch.float64), rtol=0.01, atol=0)
        assert torch.equal(lloyd_max_codebook(256, bits)[0], exact.to(torch.bfloat16).float())


@pytest.mark.parametrize("bits", [3, 4])
def test_lloyd_max_beats_the_best_uniform_quantiser_on_random_unit_vectors(bits: int) -> None:
    d = 128
    u = gaussian(2048, d, seed=1)
    u = kq.rotate(u / u.norm(dim=-1, keepdim=True))  # the coordinates the codebook quantises
    centroids, boundaries = lloyd_max_codebook(d, bits)
    lloyd_mse = ((u - centroids.double()[codebook_codes(u, boundaries).long()]) ** 2).mean().item()
    levels = 1 << bits
    uniform_mse = math.inf
    for step in torch.linspace(0.1, 1.5, 71, dtype=torch.float64) / d**0.5:  # the best uniform step for this data
        index = torch.floor(u / step).clamp(-levels // 2, levels // 2 - 1)
        uniform_mse = min(uniform_mse, ((u - (index + 0.5) * step) ** 2).mean().item())
    assert lloyd_mse < 0.95 * uniform_mse
    assert lloyd_mse * d == pytest.approx(expected_mse(d, bits), rel=0.02)


@pytest.mark.parametrize("bits", [3, 4])
def test_centroids_are_exact_16_bit_operands_and_their_norms_sum_exactly(bits: int) -> None:
    """The kernels multiply centroids as bf16 / fp16 tensor-core operands with no rounding, and the store kernel's
    ||c||^2 (float64, its own summation order) equals the reference's bit for bit: every partial sum is exact."""
    for head_dim in [2**i for i in range(2, 13)]:
        centroids, _ = lloyd_max_codebook(head_dim, bits)
        for narrow in (torch.bfloat16, torch.float16):
            assert torch.equal(centroids.to(narrow).float(), centroids)
        squares = centroids.double() ** 2
        _, low_exponent = torch.frexp(squares.min())
        _, high_exponent = torch.frexp(squares.max() * head_dim)
        assert 16 + int(high_exponent - low_exponent) < 53, head_dim  # the bits any partial sum can need
    gen = torch.Generator().manual_seed(13)
    c = lloyd_max_codebook(256, bits)[0][torch.randint(0, 1 << bits, (64, 256), generator=gen)]
    shuffled = c[:, torch.randperm(256, generator=gen)]
    orders = [kq.centroid_norms(c), kq.centroid_norms(c.flip(-1)), kq.centroid_norms(shuffled)]
    exact = torch.tensor([math.fsum(float(x) ** 2 for x in row) for row in c.double()], dtype=torch.float64).sqrt()
    assert all(torch.equal(exact, order) for order in orders)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_key_round_trip_mse_on_unit_vectors_within_the_paper_bound(head_dim: int, bits: int) -> None:
    # the paper proves D_mse <= sqrt(3) pi / 2 * 4^-b (0.0425 at 3 bits, 0.0106 at 4); Lloyd-Max reaches about
    # 0.034 / 0.0093 (the paper rounds these to 0.03 / 0.009)
    u = gaussian(2048, 1, head_dim, seed=2)
    u = u / u.norm(dim=-1, keepdim=True)
    paper_bound = math.sqrt(3) * math.pi / 2 * 4.0**-bits
    for nc in (False, True):
        u_hat = kq.dequantize_keys(kq.quantize_keys(u, bits, norm_correction=nc), torch.float64)
        mse = ((u_hat - u) ** 2).sum(-1).mean().item()
        assert mse <= min(paper_bound, 1.04 * expected_mse(head_dim, bits))


@pytest.mark.parametrize("name", PRESETS)
def test_key_dequantisation_and_score_errors_within_documented_bounds(name: str) -> None:
    k, q = gaussian(1024, 2, 128, seed=3), gaussian(1024, 2, 128, seed=4)
    k_hat = stored_keys(name, k)
    key_mse = (((k_hat - k) ** 2).sum(-1) / (k * k).sum(-1)).mean().item()
    score_error = ((q * (k_hat - k)).sum(-1) / (q.norm(dim=-1) * k.norm(dim=-1))).pow(2).mean().sqrt().item()
    assert key_mse <= KEY_MSE_BOUND[name]
    assert score_error <= SCORE_ERROR_BOUND[name]


@pytest.mark.parametrize("bits", [3, 4])
def test_norm_correction_is_no_worse_on_average(bits: int) -> None:
    k, noise = gaussian(2048, 2, 128, seed=5), gaussian(2048, 2, 128, seed=6)
    plain = kq.dequantize_keys(kq.quantize_keys(k, bits, norm_correction=False), torch.float64)
    nc = kq.dequantize_keys(kq.quantize_keys(k, bits, norm_correction=True), torch.float64)

    def mean_square(x: torch.Tensor) -> float:
        return x.pow(2).mean().item()

    # a query that attends to a key points along it: plain codes shrink that score by ~(1 - D_mse), nc by about half
    q = k + 0.5 * noise
    scale = q.norm(dim=-1) * k.norm(dim=-1)
    aligned_error = [mean_square((q * (k_hat - k)).sum(-1) / scale) for k_hat in (plain, nc)]
    assert aligned_error[1] < 0.5 * aligned_error[0]
    # the stored norm is kept (up to fp16); plain codes lose ~1-2% of it
    norm_error = [mean_square(k_hat.norm(dim=-1) / k.norm(dim=-1) - 1) for k_hat in (plain, nc)]
    assert norm_error[1] < 1e-6 < 1e-4 < norm_error[0]
    # in random directions the two are equal to within sampling noise
    random_error = [mean_square((noise * (k_hat - k)).sum(-1)) for k_hat in (plain, nc)]
    key_error = [mean_square(k_hat - k) for k_hat in (plain, nc)]
    assert random_error[1] <= 1.01 * random_error[0] and key_error[1] <= 1.01 * key_error[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bits", [3, 4])
def test_key_scores_need_no_inverse_rotation(dtype: torch.dtype, bits: int) -> None:
    q, k = gaussian(3, 4, 128, seed=7, dtype=dtype), gaussian(37, 2, 128, seed=8, dtype=dtype)  # GQA: 2 q heads / kv
    keys = kq.quantize_keys(k, bits, norm_correction=True)
    scores = kq.key_scores(kq.rotate(q), keys)  # [4, 3, 37]
    k_hat = kq.dequantize_keys(keys, dtype).repeat_interleave(2, dim=1)  # [37, 4, 128]
    expected = torch.einsum("lhd,shd->hls", q, k_hat)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(scores, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("bits", [3, 4])
def test_value_error_within_bounds(bits: int) -> None:
    # mean relative error on Gaussian vectors at head_dim 128: measured 0.099 (4 bits) / 0.213 (3 bits)
    v = gaussian(1024, 2, 128, seed=9)
    stored = kq.quantize_values(v, bits)
    v_hat = kq.dequantize_values(stored, torch.float64)
    relative = ((v_hat - v).norm(dim=-1) / v.norm(dim=-1)).mean().item()
    assert relative <= {4: 0.11, 3: 0.23}[bits]
    scale, zero = stored.scales.double().unsqueeze(-1), stored.zeros.double().unsqueeze(-1)
    max_code = (1 << bits) - 1
    assert bool(((v_hat - v).abs() <= 0.5 * scale + 2**-10 * (zero.abs() + max_code * scale)).all())


def test_fp8_saturates_and_round_trips() -> None:
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[~finite.isnan()]  # the 254 finite e4m3fn values
    assert torch.equal(kq.fp8_load(kq.fp8_store(finite)), finite)
    big = torch.tensor([448.0, 449.0, 1e6, math.inf, -500.0, -math.inf])
    assert kq.fp8_load(kq.fp8_store(big)).tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, -448.0]
    x = gaussian(4096, seed=10, dtype=torch.float32) * 10
    x_hat = kq.fp8_load(kq.fp8_store(x, scale=0.5), scale=0.5)
    is_normal = x.abs() / 0.5 >= 2**-6
    assert bool(((x_hat - x).abs() <= 2**-4 * x.abs())[is_normal].all())  # 3 mantissa bits, nearest
    assert bool(((x_hat - x).abs() <= 2**-10 * 0.5)[~is_normal].all())  # half a subnormal step
    assert torch.equal(kq.fp8_store(x, scale=0.5).view(torch.uint8), kq.fp8_store(2 * x).view(torch.uint8))


def test_float64_keys_code_like_float32_except_at_boundaries() -> None:
    k = gaussian(512, 2, 128, seed=11)
    wide, narrow = (kq.quantize_keys(x, 4, norm_correction=True) for x in (k, k.float()))
    codes = [kq.unpack_codes(x.codes, 4, 128).int() for x in (wide, narrow)]
    assert (codes[0] != codes[1]).float().mean().item() < 1e-3
    assert (codes[0] - codes[1]).abs().max().item() <= 1
    assert (wide.scales != narrow.scales).float().mean().item() < 1e-2


def test_zero_key_and_constant_value_read_back_exactly() -> None:
    zeros = torch.zeros(1, 1, 128, dtype=torch.float64)
    assert torch.equal(kq.dequantize_keys(kq.quantize_keys(zeros, 3, norm_correction=True), torch.float64), zeros)
    constant = torch.full((1, 1, 128), -1.5, dtype=torch.float64)
    assert torch.equal(kq.dequantize_values(kq.quantize_values(constant, 4), torch.float64), constant)


def test_bytes_per_token_match_the_vllm_presets() -> None:
    assert tuple(FORMATS) == KV_CACHE_DTYPES
    assert [bytes_per_token(name, 128) for name in PRESETS] == [196, 134, 118, 102]
    at_256 = [bytes_per_token(name, 256) for name in PRESETS]
    assert all(b <= bound for b, bound in zip(at_256, [388, 262, 230, 198], strict=True))
    assert bytes_per_token("auto", 128) == 512 and bytes_per_token("auto", 256) == 1024
    assert bytes_per_token("auto", 128, model_dtype_bytes=8) == 2048 and bytes_per_token("fp8", 128) == 256
    assert not kv_format("auto").is_lossy and all(kv_format(name).is_lossy for name in KV_CACHE_DTYPES[1:])


@pytest.mark.parametrize("name", PRESETS)
def test_bytes_per_token_count_what_the_quantisers_store(name: str) -> None:
    fmt, k = kv_format(name), gaussian(1, 1, 256, seed=12)

    def nbytes(*tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    if fmt.key_encoding == "fp8":
        key_bytes = nbytes(kq.fp8_store(k))
    else:
        keys = kq.quantize_keys(k, fmt.key_bits, norm_correction=True)
        key_bytes = nbytes(keys.codes, keys.scales)
    values = kq.quantize_values(k, fmt.value_bits)
    assert key_bytes + nbytes(values.codes, values.scales, values.zeros) == fmt.bytes_per_token(256)


def test_compressed_layers_keep_dense_boundaries_and_every_hybrid_attention_layer() -> None:
    qwen3_5 = ["linear_attention"] * 3 + ["full_attention"]
    qwen3_5 = qwen3_5 * 6  # 24 layers, attention at 3, 7, ..., 23
    assert compressed_layers(qwen3_5, is_hybrid=True) == (3, 7, 11, 15, 19, 23)
    assert compressed_layers(28, is_hybrid=False) == tuple(range(2, 26))
    assert compressed_layers(["full_attention"] * 8, is_hybrid=False, skip_first=1, skip_last=3) == (1, 2, 3, 4)
    assert compressed_layers(qwen3_5, is_hybrid=False) == (11, 15)
    assert compressed_layers(3, is_hybrid=False) == () and compressed_layers(10, False, 0, 12) == ()
    assert compressed_layers(6, is_hybrid=True) == tuple(range(6))
    with pytest.raises(ValueError, match="skip_last"):
        compressed_layers(8, is_hybrid=False, skip_last=-1)


def test_unknown_kv_cache_dtype_is_an_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype .*'turboquant_2bit'"):
        kv_format("turboquant_2bit")
    with pytest.raises(ValueError, match="kv_cache_dtype 'turboquant_4bit_nc' needs a power-of-two head_dim"):
        kv_format("turboquant_4bit_nc").check_head_dim(96)
    kv_format("turboquant_k8v4").check_head_dim(96)  # fp8 keys are never rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_row_is_bitwise_same_alone_and_in_batches_on_cpu(dtype: torch.dtype) -> None:
    """A key rotated at store (a decode's one token, a verify's 1 + k, a prefill chunk) or back at read: the same
    bits whatever rows share the call (invariant 4; the CPU BLAS rounds by row count unless the rows are padded)."""
    from truespec.ops.kv_quant import rotate

    gen = torch.Generator().manual_seed(3)
    for head_dim in (64, 128, 256):
        x = torch.randn(75, 2, head_dim, generator=gen, dtype=dtype)  # [T, H, D]
        full = rotate(x)
        for num_tokens in (1, 2, 3, 4, 5, 9, 33):
            for start in (0, 75 - num_tokens, 6):
                assert torch.equal(rotate(x[start:start + num_tokens]), full[start:start + num_tokens]), \
                    (head_dim, num_tokens, start)
