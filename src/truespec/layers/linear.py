"""Linear projections: ``linear`` / ``Linear`` (batch-invariant on CUDA) and merged projections: several linear
layers that read the same input run as one GEMM (one kernel launch).

``linear(x, weight, bias)`` is ``F.linear``, except on CUDA for bf16 / fp16 / fp32, where it runs
``kernels/row_invariant_matmul.py``: each row's result is bitwise the same whatever else shares the step (a
decode row alone, inside a verify of 1 + k rows, among other requests, beside a prefill chunk), so speculation
cannot change a token by rounding (docs/ARCHITECTURE.md, invariant 4). ``batch_invariant=False`` (the engine's
``batch_invariant`` setting, through ``set_batch_invariant``) keeps the earlier path instead: one-row 16-bit
steps through the skinny matrix-vector kernel (kernels/skinny_matmul.py), everything else through cuBLAS, which
picks its algorithm by row count. On the CPU, float32 / float64 rows go through cpu_kernels/linear.py (a compiled
kernel over a packed weight, each row's bits its own) where it is built; otherwise, and for fp64 on CUDA, torch (on
the CPU with the rows padded to a multiple of 4, which makes each row's bits independent of the others there:
``_padded_linear``).

``linear(gate_up, weight, bias, input_act=act)`` is ``linear(act_and_mul(gate_up, act), weight, bias)``, the
down projection of a gated MLP: where the kernels run, act(gate) * up is computed as the input is loaded (one
launch, bitwise the two steps); elsewhere it is those two steps.

``MergedLinear`` is an ``nn.Linear`` whose weight rows are the row-concatenation of the checkpoint's
projections, in order: e.g. ``gate_up_proj.weight = cat([gate_proj.weight, up_proj.weight])``, so its
output is ``cat([gate_proj(x), up_proj(x)], dim=-1)`` and ``split(y)`` gives the pieces back as views.

Checkpoints keep the HF names. A module that owns merged children calls ``use_checkpoint_names(self)``;
from then on its ``state_dict()`` names each projection as the checkpoint does (``<parent>.gate_proj.weight``,
a row-slice *view* of the merged weight, so ``state_dict()[name].copy_(tensor)`` loads it in place, which is
how the loader and the draft-head loaders fill a model) and ``load_state_dict`` accepts those names.
``named_parameters()`` shows the merged parameter (``<parent>.gate_up_proj.weight``); ``shard_rows`` tells
which rows hold which projection.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from truespec.cpu_kernels import linear as cpu_linear
from truespec.layers.activation import act_and_mul, can_use_act_mul_kernel
from truespec.layers.backend import kernels, use_kernels
from truespec.ops.linear import CPU_ROW_MULTIPLE, padded_rows

_SUFFIXES = ("weight", "bias")
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)
_INVARIANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, input_act: str | None = None,
           batch_invariant: bool = True) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [T, in_features]. With ``input_act``, ``x`` is a merged gate/up output
    [T, 2 * in_features] and the input is ``act_and_mul(x, input_act)`` (a gated MLP's down projection)."""
    if batch_invariant and _is_invariant(x, weight):
        if input_act is not None and not can_use_act_mul_kernel(*x.chunk(2, dim=-1), input_act):
            x, input_act = act_and_mul(x, input_act), None
        return kernels().row_invariant_matmul(x, weight, bias, input_act=input_act)
    if input_act is not None:
        return _act_and_linear(x, weight, bias, input_act, batch_invariant)
    if batch_invariant and cpu_linear.can_run(x, weight):  # every row count: a row's bits stay its own
        return cpu_linear.linear(x, weight, bias)
    if _is_skinny(x, weight):
        return kernels().skinny_matmul(x, weight, bias)
    if batch_invariant and x.dim() == 2 and x.shape[0] % CPU_ROW_MULTIPLE and x.device.type == "cpu":
        return _padded_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of ``x``'s rows computed among a multiple of CPU_ROW_MULTIPLE rows (``ops.linear.padded_rows``
    says why): a lone decode row and the same row in a verify, or at another place in the batch, get the same bits."""
    return F.linear(padded_rows(x), weight, bias)[:x.shape[0]]


def _is_invariant(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows on CUDA in a dtype the row-invariant kernel takes."""
    return x.dim() == 2 and x.dtype in _INVARIANT_DTYPES and weight.dtype == x.dtype and use_kernels(x)


def _is_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A one-row 16-bit step on CUDA (a batch-size-1 decode): the skinny kernel's."""
    return x.dim() == 2 and x.shape[0] == 1 and x.dtype in _SKINNY_DTYPES and weight.dtype == x.dtype and use_kernels(x)


def _act_and_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str,
                    batch_invariant: bool) -> torch.Tensor:
    """``linear(act_and_mul(gate_up, act), weight, bias)`` off the invariant path. Where those two steps would be
    the act_mul kernel and the skinny kernel, one skinny launch computes act(gate) * up as it reads the row."""
    if _is_skinny(gate_up, weight) and can_use_act_mul_kernel(*gate_up.chunk(2, dim=-1), act):
        return kernels().skinny_matmul(gate_up, weight, bias, input_act=act)
    return linear(act_and_mul(gate_up, act), weight, bias, batch_invariant=batch_invariant)


def set_batch_invariant(module: nn.Module, enabled: bool) -> None:
    """Route every ``Linear`` in ``module`` (and the logits of a model with ``batch_invariant``) through the
    row-invariant kernel (True) or the earlier skinny / cuBLAS path (False)."""
    for m in module.modules():
        if isinstance(m, Linear) or hasattr(m, "batch_invariant"):
            m.batch_invariant = enabled


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` (same parameters and state dict)."""

    batch_invariant = True  # set_batch_invariant changes it per module

    def forward(self, x: torch.Tensor, input_act: str | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, input_act, self.batch_invariant)


class MergedLinear(Linear):
    """One ``Linear`` standing for the projections ``output_sizes`` ({checkpoint name: out_features})."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias=bias)
        self.output_sizes = dict(output_sizes)

    def shard_rows(self) -> dict[str, slice]:
        """Checkpoint name -> the rows of ``weight`` (and entries of ``bias``) that hold it."""
        rows, start = {}, 0
        for name, size in self.output_sizes.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., out_features] -> one view per projection, in ``output_sizes`` order."""
        return y.split(list(self.output_sizes.values()), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shards={self.output_sizes}"


def use_checkpoint_names(module: nn.Module) -> None:
    """Make ``module``'s state dict speak the checkpoint names of its ``MergedLinear`` children (see above)."""
    module.register_state_dict_post_hook(_split_merged)
    module.register_load_state_dict_pre_hook(_merge_shards)


def _merged_children(module: nn.Module) -> list[tuple[str, MergedLinear]]:
    return [(name, child) for name, child in module.named_children() if isinstance(child, MergedLinear)]


def _split_merged(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: ``<prefix><merged>.weight`` -> ``<prefix><shard>.weight`` row views, in place
    of the merged entry (``module``'s entries are re-inserted in order, so the shards keep their rank)."""
    merged = {
        f"{prefix}{name}.{suffix}": (child, suffix) for name, child in _merged_children(module) for suffix in _SUFFIXES
    }
    own = [(key, state_dict.pop(key)) for key in [k for k in state_dict if k.startswith(prefix)]]
    for key, tensor in own:
        if key not in merged:
            state_dict[key] = tensor
            continue
        child, suffix = merged[key]
        for shard, rows in child.shard_rows().items():
            state_dict[f"{prefix}{shard}.{suffix}"] = tensor[rows]


def _merge_shards(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: the checkpoint's ``<prefix><shard>.weight`` tensors -> one merged tensor.
    Runs before the children are loaded, so they see the merged key; with any shard absent nothing is
    merged and load_state_dict reports the shards as unexpected and the merged key as missing."""
    for name, child in _merged_children(module):
        for suffix in _SUFFIXES:
            keys = [f"{prefix}{shard}.{suffix}" for shard in child.output_sizes]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{name}.{suffix}"] = torch.cat([state_dict.pop(k) for k in keys])
