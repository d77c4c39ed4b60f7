"""On CUDA (skipped without it): prompt rows run in the prefill kernel and greedy tokens do not depend on chunking.

With the routing of kernels/step_attention.py (docs/ARCHITECTURE.md, "Attention rows") a prompt position's
attention comes from the prefill kernel whatever chunk it is in (a 1-token last chunk included), and every decode /
verify row from the split-KV kernel as before. So on the embedded model in bf16, FULL CUDA graphs on, the greedy
tokens with chunked prefill at an odd budget (chunks cut anywhere, sharing steps with decodes and with ngram
verifies) equal those of the unchunked run, with and without ngram speculation, over the model-dtype cache and a
packed one; steps with prompt rows replay the graphs that hold the prefill launch.
"""

import gc
import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.worker.graph_runner import GraphRunner
from truespec.worker.input_builder import ContextRow

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if os.environ.get("TRUESPEC_BACKEND", "triton") != "triton":  # the routing is the Triton path's
    pytestmark.append(pytest.mark.skip(reason="TRUESPEC_BACKEND is not triton"))

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2}
ODD_BUDGET = 37  # max_num_batched_tokens of the chunked runs: prompts cut at odd places, 1-token last chunks
WHOLE_BUDGET = 2048  # every prompt in one chunk


def prompts(n: int) -> list[str]:
    rows = [json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines()]
    return rows[:: max(1, len(rows) // n)][:n]


def count_prompt_forwards(graphs: GraphRunner, counts: Counter[str]) -> None:
    """Wrap the target's forwards so ``counts`` records those with prompt rows that replayed a graph, and those
    mixing prompt rows with verify rows."""
    graph_run = graphs.run

    def counting_run(rows: list[ContextRow], *args: object, **kwargs: object) -> tuple:
        before = graphs.stats["graph"]
        out = graph_run(rows, *args, **kwargs)
        prompt = any(row.num_prompt_rows for row in rows)
        counts["prompt_graph"] += int(prompt and graphs.stats["graph"] > before)
        counts["prompt_and_verify"] += int(prompt and any(row.query_len > 1 and not row.num_prompt_rows
                                                          for row in rows))  # fmt: skip
        return out

    graphs.run = counting_run


def run(budget: int, spec: dict | None, kv_cache_dtype: str) -> tuple[list[list[int]], Counter[str]]:
    """Greedy tokens of 12 prompts at max_num_seqs 4 (arrivals join running decodes / verifies), and the counts of
    ``count_prompt_forwards``."""
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=4,
              max_num_batched_tokens=budget, kv_cache_dtype=kv_cache_dtype, speculative_config=spec)
    counts: Counter[str] = Counter()
    # FULL mode: graphs with and without the prefill launch
    assert {True, False} <= {has for _, has in llm.llm_engine.runner.graphs.graphs}
    count_prompt_forwards(llm.llm_engine.runner.graphs, counts)
    outs = llm.generate(prompts(12), SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], counts


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_4bit_nc"])
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_chunked_prefill_gives_the_unchunked_tokens(spec: dict | None, kv_cache_dtype: str) -> None:
    whole, _ = run(WHOLE_BUDGET, None, kv_cache_dtype)
    chunked, counts = run(ODD_BUDGET, spec, kv_cache_dtype)
    assert counts["prompt_graph"] > 0, counts  # prompt rows ran inside the graphs that hold the prefill kernel
    if spec is not None:
        assert counts["prompt_and_verify"] > 0, counts  # prompt chunks shared steps with verifies
    same = sum(a == b for a, b in zip(whole, chunked, strict=True))
    assert chunked == whole, f"{same}/{len(whole)} requests identical"
