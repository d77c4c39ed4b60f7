"""On the embedded (trained) model, in float64: every speculative method gives the tokens of the run
without speculation, alone and in a mixed batch, and really accepts drafts."""

import json
from pathlib import Path

import pytest

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_DIR, DEFAULT_MODEL_DIR

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
PARAMS = SamplingParams(temperature=0, max_tokens=32)


def methods(k: int) -> dict[str, dict]:
    drafter = {"draft_model": DEFAULT_DRAFT_MODEL_DIR, "eagle": DEFAULT_EAGLE_DIR}
    configs = {m: {"method": m, "num_speculative_tokens": k} for m in ("ngram", "draft_model", "mtp", "eagle")}
    configs["ngram"]["prompt_lookup_min"] = 2
    for m, path in drafter.items():
        configs[m]["model"] = str(path)
    return configs


@pytest.fixture(scope="module")
def reference() -> tuple[list[str], list[list[int]]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    by_kind = {kind: [r["prompt"] for r in rows if r["kind"] == kind][:2] for kind in ("edit", "completion", "chat")}
    prompts = [p for group in by_kind.values() for p in group]
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048)
    return prompts, [o.outputs[0].token_ids for o in base.generate(prompts, PARAMS, use_tqdm=False)]


SHAPES = {"mixed": {"max_num_batched_tokens": 64, "max_model_len": 2048},  # chunks beside verifies and decodes
          # 18 blocks x 16 = 288 tokens: room for the longest request (226 + 32), far less than all six together
          "preempting": {"max_num_batched_tokens": 64, "max_model_len": 272, "num_gpu_blocks_override": 18}}


@pytest.mark.parametrize("k, shape", [(1, "mixed"), (3, "mixed"), (8, "mixed"), (3, "preempting")])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp", "eagle"])
def test_embedded_model_speculation_is_lossless(reference: tuple, method: str, k: int, shape: str) -> None:
    prompts, ref = reference
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", speculative_config=methods(k)[method],
              **SHAPES[shape])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == ref
    assert llm.generate(prompts[0], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == ref[0]  # batch size 1
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    if shape == "preempting":
        assert llm.llm_engine.scheduler.num_preemptions > 0
