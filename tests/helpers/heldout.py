"""Helpers for tests on the embedded model with held-out prompts: four prompts and their greedy reference tokens
without speculation, and a governor whose decisions flip on a fixed schedule."""

import json
from pathlib import Path

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.spec_decode.governor import SpeculationGovernor

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "heldout.jsonl"


def heldout_reference(params: SamplingParams) -> tuple[list[str], list[list[int]]]:
    """Four held-out prompts (two edits, two chats) and the embedded model's tokens for each (float64, CPU),
    without speculation."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [p for kind in ("edit", "chat") for p in [r["prompt"] for r in rows if r["kind"] == kind][:2]]
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048)
    return prompts, [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]


def flip_every(governor: SpeculationGovernor, n: int) -> None:
    """Make the governor's decisions alternate every ``n`` steps (as it decides: the same until a step ends)."""
    observed = [0]
    observe_step = governor.observe_step

    def counting(*args: object) -> None:
        observed[0] += 1
        observe_step(*args)

    governor.observe_step = counting
    governor.is_drafting = lambda num_running: observed[0] // n % 2 == 0
