"""`python -m truespec.training --out DIR [--seed 0] [--time-budget-s 510] [--device cuda] [--smoke]`."""

import argparse
from pathlib import Path

import torch

from .pipeline import RunConfig, run, smoke_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m truespec.training", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="writes assets, heldout.jsonl and report/ here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget-s", type=float, default=RunConfig.time_budget_s)
    parser.add_argument("--max-steps", type=int, default=RunConfig.max_steps)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a few files (CPU, seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        cfg = smoke_config(args.out, args.seed)
    else:
        cfg = RunConfig(out=args.out, seed=args.seed, device=args.device, time_budget_s=args.time_budget_s,
                        max_steps=args.max_steps)
    run(cfg)


if __name__ == "__main__":
    main()
