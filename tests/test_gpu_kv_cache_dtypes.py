"""On CUDA (skipped without it): compressed KV caches under CUDA graphs keep speculation lossless (issue 14).

vLLM's MTP x TurboQuant x CUDA-graph bug (CONTEXT.md section 2) came from a verify path that could not run inside a
captured graph. Here every compressed ``kv_cache_dtype`` is stored by kernels/kv_store_packed.py and read by
kernels/paged_attention_packed.py inside FULL CUDA graphs, and a verify row is computed as a decode row
(invariant 4), so in bf16 the greedy tokens with MTP (verifies queued ahead) or ngram equal the tokens without
speculation of the same dtype, request for request. A ~30K-token prompt fed in chunks reads its compressed history
through the same kernel without an assert or an allocation.
"""

import gc
import json
from pathlib import Path

import pytest
import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
COMPRESSED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
MTP = {"method": "mtp", "num_speculative_tokens": 3}
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2}


def prompts(n: int) -> list[str]:
    rows = [json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines()]
    return rows[:: max(1, len(rows) // n)][:n]


def run(kv_cache_dtype: str, spec: dict | None, max_num_seqs: int, n: int) -> tuple[list[list[int]], dict]:
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=max_num_seqs,
              kv_cache_dtype=kv_cache_dtype, speculative_config=spec,
              async_scheduling=True if spec is not None else None)
    outs = llm.generate(prompts(n), SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    stats = dict(llm.llm_engine.runner.graphs.stats)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("kv_cache_dtype", COMPRESSED)
def test_mtp_is_lossless_on_compressed_kv_under_cuda_graphs(kv_cache_dtype: str) -> None:
    base, base_stats = run(kv_cache_dtype, None, 16, 16)
    spec, spec_stats = run(kv_cache_dtype, MTP, 16, 16)
    assert base_stats["graph"] > 0 and spec_stats["graph"] > 0, (base_stats, spec_stats)  # the packed path captured
    same = sum(a == b for a, b in zip(base, spec, strict=True))
    assert spec == base, f"{kv_cache_dtype} MTP: {same}/{len(base)} requests identical"


@pytest.mark.parametrize("spec", [NGRAM, MTP], ids=["ngram", "mtp"])
def test_speculation_is_lossless_on_3bit_kv_at_batch_size_1(spec: dict) -> None:
    base, _ = run("turboquant_3bit_nc", None, 1, 4)
    assert run("turboquant_3bit_nc", spec, 1, 4)[0] == base


def test_long_prompt_in_chunks_over_a_compressed_cache() -> None:
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="bfloat16", device="cuda", max_model_len=32768, max_num_seqs=2,
              max_num_batched_tokens=2048, kv_cache_dtype="turboquant_4bit_nc")
    text = "\n".join(json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines())
    ids = llm.get_tokenizer().encode(text * 8)[:30000]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(ids) == 30000 and len(out.outputs[0].token_ids) == 4
