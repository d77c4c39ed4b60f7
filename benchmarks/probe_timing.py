"""What the kernel probes (lloyd_max_scoring_probe.py, uniform_values_probe.py) share: run one variant, time it."""

import argparse
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


def probe_args(doc: str) -> tuple[argparse.Namespace, str]:
    """(the probe's ``--keys`` / ``--check`` arguments, its device: cpu under ``--check``, else cuda)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--check", action="store_true", help="run each variant once (TRITON_INTERPRET=1 on CPU)")
    args = parser.parse_args()
    return args, "cpu" if args.check else "cuda"
