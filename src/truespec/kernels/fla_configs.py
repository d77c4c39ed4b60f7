"""Launch configs for fla-core's GDN prefill kernels, fixed per GPU instead of tuned in each process.

fla autotunes each kernel of ``chunk_gated_delta_rule`` at its first call in a process, on a key without the
sequence length, over a few candidates. The candidates give the same bits (every one that compiles, for the four
kernels below; benchmarks/fla_kernel_configs.py checks), but not the same time, and a tuning run disturbed by
other work can keep a slow one (session 24, H200: the state kernel's pick took 0.52 to 1.08 ms per 8K call,
depending on the process). ``pin`` replaces each kernel's candidate list by the one config measured fastest on that GPU
(benchmarks/fla_kernel_configs.py, Qwen3.5 GDN shape, 8K and 32K tokens, chosen on fp32 inputs in session 25 and
re-checked on the bf16 inputs the engine feeds: same bits as fla's tuning, 8K call 0.517 vs 0.604 ms tuned, H200,
session 29), so every process runs the same launches and skips tuning (fla's gates cumsum kernel excepted: still
tuned, its candidates give the same bits). Unlisted GPUs keep fla's own tuning.

H200 (BENCHMARKS.md, session 25): the chunk state kernel's 16-column value blocks are outside fla's candidates
(twice the programs of its smallest: one sequence of 16 heads otherwise fills 32-64 of 132 SMs); one 8K call of
the whole rule 1.245 (tuned) -> ~1.05 ms.
"""

import importlib

import torch

# (module, kernel): its config, as keyword arguments of triton.Config, per CUDA compute capability.
_PINNED: dict[tuple[int, int], dict[tuple[str, str], tuple[dict, int, int]]] = {
    (9, 0): {  # H100 / H200: (meta-parameters, num_warps, num_stages)
        ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"): ({"BV": 16}, 4, 3),
        ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"): ({"BK": 32, "BV": 32}, 2, 3),
        ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel"): ({}, 8, 1),
        ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel"): ({"BK": 32}, 1, 2),
    },
}


def autotuner(module: str, name: str):  # noqa: ANN201 - a triton Autotuner (triton is imported lazily)
    """The autotuner under fla's decorators of ``module.name``."""
    kernel = getattr(importlib.import_module(module), name)
    while not hasattr(kernel, "configs"):
        kernel = kernel.fn
    return kernel


_fla_candidates: dict[tuple[str, str], list] = {}  # fla's own candidate lists of the kernels pinned


def pin() -> list[str]:
    """Fix the configs of fla's kernels on this GPU (current CUDA device) where measured; returns the kernels
    pinned. Call after importing fla, before its first launch."""
    import triton

    pinned = _PINNED.get(torch.cuda.get_device_capability(), {})
    for key, (meta, warps, stages) in pinned.items():
        tuner = autotuner(*key)
        _fla_candidates.setdefault(key, tuner.configs)
        tuner.configs, tuner.cache = [triton.Config(meta, num_warps=warps, num_stages=stages)], {}
    return [name for _, name in pinned]


def unpin() -> None:
    """Give the pinned kernels fla's own candidates back (tuned afresh at their next launch)."""
    for key, configs in _fla_candidates.items():
        tuner = autotuner(*key)
        tuner.configs, tuner.cache = configs, {}
