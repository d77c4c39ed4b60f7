"""Rotary position embedding (neox / rotate-half style, optionally partial) built from an HF config, and its
application to q and k (with the optional q/k norm: one kernel on CUDA, ``ops/rotary.py`` elsewhere).

The inverse-frequency table comes from transformers' own RoPE init functions (``ROPE_INIT_FUNCTIONS``),
so every static scaling variant (linear, llama3, yarn, ...) is exactly transformers'. The table is
float32, as transformers computes it (it is a model constant); angles ``position * inv_freq`` and
their cos/sin are computed in the compute dtype (float64 for float64 models), then cast to the
model dtype before rotating q/k, as transformers does.
"""

from typing import Any

import torch
from torch import nn

from truespec.cpu_kernels import rotary as cpu_rotary
from truespec.layers.backend import kernels, use_kernels
from truespec.layers.norm import RMSNorm
from truespec.ops.precision import compute_dtype
from truespec.ops.rotary import qk_norm_rope_ref

# "dynamic" and "longrope" change inv_freq with the longest sequence in the *batch* in transformers:
# batch-dependent math that a paged KV cache (and invariant 1) cannot honour.
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
TABLE_CHUNK = 16384  # positions a fixed table is built from at a time


def _default_inv_freq(rope_theta: float, rotary_dim: int) -> torch.Tensor:
    # [rotary_dim // 2] float32, the formula of transformers' compute_default_rope_parameters.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (rope_theta**exponents)


def rope_from_config(config: Any, head_dim: int) -> "RotaryEmbedding":
    """RotaryEmbedding for an HF text config (reads ``config.rope_parameters``)."""
    params: dict[str, Any] = dict(config.rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if rope_type in _BATCH_DEPENDENT_ROPE:
        raise ValueError(f"rope_type {rope_type!r} is not supported (its frequencies depend on the batch)")
    # Built on the host even when the model is constructed on the meta device.
    with torch.device("cpu"):
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(float(params["rope_theta"]), rotary_dim), 1.0
        else:  # transformers is imported only for the scaled variants
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                supported = ["default", *sorted(set(ROPE_INIT_FUNCTIONS) - set(_BATCH_DEPENDENT_ROPE))]
                raise ValueError(f"unknown rope_type {rope_type!r}; supported: {supported}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if 2 * inv_freq.numel() != rotary_dim:
        raise ValueError(f"rope_type {rope_type!r} gave {inv_freq.numel()} frequencies for rotary dim {rotary_dim}")
    return RotaryEmbedding(head_dim, rotary_dim, inv_freq.float(), float(scaling))


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) for a step's positions once; ``apply_qk_norm_rotary`` uses them in every layer. On the
    CPU they are rows of a table of every position so far (computed once, grown by doubling)."""

    def __init__(self, head_dim: int, rotary_dim: int, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.attention_scaling = attention_scaling
        self._inv_freq_host = inv_freq  # [rotary_dim // 2] float32 on CPU, survives to_empty()
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # the CPU's cos / sin by dtype
        self.fixed_table: torch.Tensor | None = None  # [P, 2 rotary_dim]: cos | sin of positions 0 .. P - 1
        self._fixed_dtype: torch.dtype | None = None

    def init_buffers(self, device: torch.device) -> None:
        """Re-create ``inv_freq`` on ``device`` (after the model was materialised from the meta device)."""
        self.inv_freq = self._inv_freq_host.to(device)
        self._tables, self.fixed_table, self._fixed_dtype = {}, None, None

    def init_fixed_table(self, num_positions: int, dtype: torch.dtype, table: torch.Tensor | None = None) -> None:
        """(cos, sin) of positions 0 .. ``num_positions`` - 1 in ``dtype``, one [P, 2 rotary_dim] table on
        ``inv_freq``'s device, computed by the same ops as a step's positions (so each row has the bits those give):
        a step then gathers its rows (2 launches) instead of computing them (7). Built before any CUDA graph is
        captured (a captured gather reads it in place, so it never grows). ``table``: one built by another
        RotaryEmbedding with the same frequencies (``share_fixed_tables``)."""
        if table is None:  # in chunks: the temporaries stay small (the engine sizes its KV pool after this)
            device, r = self.inv_freq.device, self.rotary_dim
            table = torch.empty(num_positions, 2 * r, dtype=dtype, device=device)
            for start in range(0, num_positions, TABLE_CHUNK):
                cos, sin = self._angles(torch.arange(start, min(start + TABLE_CHUNK, num_positions), device=device),
                                        dtype)
                table[start:start + len(cos), :r], table[start:start + len(cos), r:] = cos, sin
        self.fixed_table, self._fixed_dtype = table, dtype

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] int64 -> cos, sin: [num_tokens, rotary_dim] in ``dtype``.
        if self.fixed_table is not None and dtype == self._fixed_dtype:
            # a position past the table reads its last row instead of faulting: the engine sizes it to every position
            # a live request reaches (max_model_len + k); the warm-up's prompts (up to max_num_batched_tokens) and the
            # discarded rows of a request that finished while its next step was queued may pass it
            rows = self.fixed_table.index_select(0, positions.clamp(max=self.fixed_table.shape[0] - 1))
            return rows[:, :self.rotary_dim], rows[:, self.rotary_dim:]  # views with a row stride of 2 rotary_dim
        if positions.device.type == "cpu" and positions.numel():  # rows of a table: ~6 small ops fewer a step
            cos, sin = self._table(int(positions.max()) + 1, dtype)
            return cos[positions], sin[positions]
        return self._angles(positions, dtype)

    def _table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions 0 .. n - 1 for some n >= length (a power of two, grown as positions grow),
        computed by the same ops as a step's positions: a position's values are the same whichever step holds it."""
        kept = self._tables.get(dtype)
        if kept is None or kept[0].shape[0] < length:
            n = max(256, 1 << (length - 1).bit_length())
            kept = self._tables[dtype] = self._angles(torch.arange(n, device=self.inv_freq.device), dtype)
        return kept

    def _angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cdt = compute_dtype(dtype)
        freqs = positions.to(cdt)[:, None] * self.inv_freq.to(cdt)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # x * 1.0 == x exactly: skip two kernels in the common case
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, scaling={self.attention_scaling}"


def share_fixed_tables(models: list[nn.Module], num_positions: int, dtype: torch.dtype) -> None:
    """Give every RotaryEmbedding of ``models`` (a target and its drafter) a fixed table of ``num_positions`` rows
    (``init_fixed_table``), one table per distinct set of frequencies: an MTP / EAGLE head's RoPE is its target's."""
    tables: dict[tuple, torch.Tensor] = {}
    for rope in (m for model in models for m in model.modules() if isinstance(m, RotaryEmbedding)):
        key = (rope.rotary_dim, rope.attention_scaling, tuple(rope._inv_freq_host.tolist()), rope.inv_freq.device)
        rope.init_fixed_table(num_positions, dtype, tables.get(key))
        tables[key] = rope.fixed_table


def apply_qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None = None,
    k_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, HK, D] (views of the qkv projection) -> optional q/k norm, then RoPE.
    One Triton kernel for both on CUDA (instead of 2 norms + 6 elementwise ops per tensor)."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    q_weight, k_weight, eps, unit_offset = None, None, 0.0, False
    if q_norm is not None and k_norm is not None:
        if (q_norm.eps, q_norm.unit_offset) != (k_norm.eps, k_norm.unit_offset):
            raise ValueError("q_norm and k_norm must share eps and unit_offset")
        q_weight, k_weight, eps, unit_offset = q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset
    if use_kernels(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        return kernels().qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, unit_offset)
    if cpu_rotary.can_run(q, k, cos, q_weight, k_weight):  # one compiled call instead of ~25 torch ops
        return cpu_rotary.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, unit_offset)
    return qk_norm_rope_ref(q, k, cos, sin, q_weight, k_weight, eps, unit_offset)
