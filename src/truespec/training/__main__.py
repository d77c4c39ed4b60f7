"""`python -m truespec.training --out DIR [--seed 0] [--time-budget-s 510] [--device cuda] [--smoke]`."""

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from .models import DRAFT_SIZES, TARGET_SIZES
from .pipeline import RunConfig, run, smoke_config


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """The run the command line asks for (``--smoke``: the CPU smoke run with the given options)."""
    parser = argparse.ArgumentParser(prog="python -m truespec.training", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="writes assets, heldout.jsonl and report/ here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget-s", type=float, default=RunConfig.time_budget_s)
    parser.add_argument("--max-steps", type=int, default=RunConfig.max_steps,
                        help="a cap: the step count is fitted to --time-budget-s, so it depends on the card "
                             "(the shipped run: 1,860 steps on an H200; an H100 gets ~1,300 and a worse model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mask-edit-prompts", action=argparse.BooleanOptionalAction,
                        default=RunConfig.mask_edit_prompts,
                        help="no loss on the original code and instruction of edit tasks")
    parser.add_argument("--keep", choices=("last", "best"), default=RunConfig.keep,
                        help="ship the final weights or those of the best validation pass")
    parser.add_argument("--edit-weight", type=float, default=dict(RunConfig.weights)["edit"],
                        help="share of edit-task rows (plain gets 0.9 minus this, chat 0.1)")
    parser.add_argument("--num-edits", type=int, default=RunConfig.num_edits)
    parser.add_argument("--edit-point-boost", type=float, default=RunConfig.edit_point_boost,
                        help="loss weight of the edit points of edit tasks (the words that do not copy)")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a few files (CPU, seconds)")
    parser.add_argument("--target-layers", type=int, default=TARGET_SIZES.num_layers,
                        help="target decoder layers; every 4th is full attention (12: three attention layers)")
    parser.add_argument("--target-intermediate-size", type=int, default=TARGET_SIZES.intermediate_size,
                        help="target (and MTP layer) MLP width")
    parser.add_argument("--draft-intermediate-size", type=int, default=DRAFT_SIZES.intermediate_size)
    args = parser.parse_args(argv)
    if args.target_layers < 4 or args.target_intermediate_size < 1 or args.draft_intermediate_size < 1:
        parser.error("--target-layers must be >= 4 (one attention layer) and MLP widths positive")
    target_sizes = replace(TARGET_SIZES, num_layers=args.target_layers,
                           intermediate_size=args.target_intermediate_size)
    draft_sizes = replace(DRAFT_SIZES, intermediate_size=args.draft_intermediate_size)
    weights = (("plain", round(0.9 - args.edit_weight, 6)), ("edit", args.edit_weight), ("chat", 0.10))
    if args.smoke:
        return replace(smoke_config(args.out, args.seed), mask_edit_prompts=args.mask_edit_prompts, weights=weights,
                       keep=args.keep, edit_point_boost=args.edit_point_boost)
    return RunConfig(out=args.out, seed=args.seed, device=args.device, time_budget_s=args.time_budget_s,
                     max_steps=args.max_steps, mask_edit_prompts=args.mask_edit_prompts, weights=weights,
                     keep=args.keep, num_edits=args.num_edits, edit_point_boost=args.edit_point_boost,
                     target_sizes=target_sizes, draft_sizes=draft_sizes)


def main(argv: list[str] | None = None) -> None:
    run(parse_config(argv))


if __name__ == "__main__":
    main()
