"""What the kernel probes (lloyd_max_scoring_probe.py, uniform_values_probe.py) share: run one variant, time it."""

from collections.abc import Callable

import torch
import triton


def time_variant(call: Callable[[], None], out: torch.Tensor, check: bool, label: str) -> float | None:
    """Run ``call`` once. Under ``check`` (the interpreter) return the sum of |out| (it ran); else us per call
    (``do_bench_cudagraph``: replays of a captured graph). A variant that fails to compile is reported and gives
    None, so that the others still run."""
    try:
        call()
        if check:
            return float(out.abs().sum())
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(call, rep=50) * 1e3
    except Exception as error:
        print(f"{label} failed: {type(error).__name__}: {str(error)[:160]}", flush=True)
        return None
