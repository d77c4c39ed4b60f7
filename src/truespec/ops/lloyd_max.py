"""Lloyd-Max scalar codebooks for one coordinate of a rotated unit key (TurboQuant's "MSE" key codes).

After a key is normalised and rotated by the Hadamard matrix, each coordinate is modelled as one coordinate of a
uniformly random unit vector in R^D. Its exact density is the symmetric Beta-type law

    f_D(x) = Gamma(D/2) / (sqrt(pi) Gamma((D-1)/2)) * (1 - x^2)^((D-3)/2),   -1 <= x <= 1,

which tends to N(0, 1/D) as D grows. We run Lloyd's iteration on this exact density rather than on the Gaussian:
it is what is actually quantised, it costs the same, and for small head dims (64) the Gaussian puts mass outside
[-1, 1] and has heavier tails than the truth. At D = 128 the outermost centroid sits 1% inside the Gaussian
one (2.131 vs 2.152, in units of 1/sqrt(D), at 3 bits), the inner ones closer still.

The numerics are deterministic: the density is tabulated on a fixed grid in float64, its cumulative mass and first
moment are integrated by the trapezoid rule (sequential cumsum), and Lloyd's iteration runs from quantile
initial points, symmetrised every step, to a fixed tolerance. The result is rounded to bfloat16 once (8 significant
bits: a relative change below 2^-9, which adds under 1e-5 of the unit-vector MSE) so that every centroid is exact as
a bf16 or fp16 tensor-core operand: the attention kernels score the 16-bit centroids directly, with no hi / lo
split (kernels/kv_tiles.py). The decision boundaries are the float32 midpoints of neighbouring centroids, so a
Triton kernel handed these two tables classifies a float32 coordinate exactly as the reference does
(``codebook_codes``).
"""

from functools import cache

import torch

_GRID_POINTS = 1 << 17  # intervals over [-1, 1]: ~4000 per standard deviation at D = 256
_MAX_ITERS = 20_000
_TOL = 1e-14  # max centroid change (unit-vector scale, ~1e-1 / sqrt(D))


def coordinate_density(head_dim: int, x: torch.Tensor) -> torch.Tensor:
    """Unnormalised density (1 - x^2)^((D-3)/2) of one coordinate of a uniform unit vector in R^D, at x."""
    exponent = (head_dim - 3) / 2
    return torch.exp(exponent * torch.log1p(-(x * x).clamp(max=1.0)))


@cache
def _tables(head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grid x, cumulative mass F(x) (normalised to 1) and cumulative first moment G(x), all float64 [N + 1]."""
    x = torch.linspace(-1.0, 1.0, _GRID_POINTS + 1, dtype=torch.float64)
    f = coordinate_density(head_dim, x)
    h = 2.0 / _GRID_POINTS
    mass = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum((f[1:] + f[:-1]) * (h / 2), 0)])
    xf = x * f
    moment = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum((xf[1:] + xf[:-1]) * (h / 2), 0)])
    total = mass[-1].item()
    return x, mass / total, moment / total


def _interp(x: torch.Tensor, table: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of ``table`` (sampled at the sorted grid ``x``) at the points ``at``."""
    hi = torch.searchsorted(x, at).clamp(1, x.numel() - 1)
    t = (at - x[hi - 1]) / (x[hi] - x[hi - 1])
    return table[hi - 1] + t * (table[hi] - table[hi - 1])


def lloyd_centroids(head_dim: int, bits: int) -> torch.Tensor:
    """Float64 Lloyd-Max centroids [2^bits], sorted and exactly symmetric about 0 (``lloyd_max_codebook`` rounds
    them to bf16 numbers)."""
    x, mass, moment = _tables(head_dim)
    levels = 1 << bits
    # start at the quantiles of the cell midpoints: already close to the optimum
    targets = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    centroids = x[torch.searchsorted(mass, targets).clamp(0, x.numel() - 1)]
    one = torch.ones(1, dtype=torch.float64)
    for _ in range(_MAX_ITERS):
        edges = torch.cat([-one, (centroids[1:] + centroids[:-1]) / 2, one])  # [levels + 1]
        cell_mass = _interp(x, mass, edges).diff()
        cell_moment = _interp(x, moment, edges).diff()
        updated = cell_moment / cell_mass
        updated = (updated - updated.flip(0)) / 2  # the density is even: keep the codebook exactly symmetric
        change = (updated - centroids).abs().max().item()
        centroids = updated
        if change < _TOL:
            break
    return centroids


@cache
def lloyd_max_codebook(head_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids [2^bits] (bf16-exact values) and decision boundaries [2^bits - 1], float32 on CPU, for one
    coordinate of a unit vector.

    Cached per (head_dim, bits); callers move them to their device. Boundaries are the float32 midpoints of
    neighbouring centroids (the nearest-centroid rule); the middle boundary is exactly 0.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if head_dim < 4:
        raise ValueError(f"head_dim must be >= 4 for a Lloyd-Max key codebook, got {head_dim}")
    centroids = lloyd_centroids(head_dim, bits).to(torch.bfloat16).to(torch.float32)  # exact in bf16, fp16 and fp32
    boundaries = (centroids[1:] + centroids[:-1]) / 2  # float32 arithmetic, as a kernel would do it
    return centroids, boundaries


def codebook_codes(x: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """Code of each element of x: the number of boundaries strictly below it (a tie goes to the lower code).

    x is float32 or float64; the float32 boundaries are compared exactly (upcast when x is float64). uint8 out.
    """
    return torch.bucketize(x, boundaries.to(device=x.device, dtype=x.dtype), right=False).to(torch.uint8)


def expected_mse(head_dim: int, bits: int) -> float:
    """Expected squared error of one coordinate under the codebook, times D: the unit-vector MSE (no nc)."""
    x, _, _ = _tables(head_dim)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits)
    f = coordinate_density(head_dim, x)
    codes = codebook_codes(x, boundaries).long()
    err = (x - centroids.double()[codes]) ** 2 * f
    return (head_dim * err.sum() / f.sum()).item()
