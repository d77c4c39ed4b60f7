"""On CUDA (skipped without it): prefix caching is exact in bf16 with CUDA graphs, as in float64 on CPU
(tests/test_prefix_caching.py). The embedded hybrid model, held-out prompts and the same prompts extended (a shared
prefix of every length, the next turn of a chat), one at a time (each reuses what the others left) and all
together, without speculation and with MTP k=3 (verifies queued ahead): every request's greedy tokens equal those
of the engine without the cache, and the cache was used."""

import gc
import json
from pathlib import Path

import pytest
import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.tokenizer import load_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def prompts() -> list[dict]:
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines()]
    tok = load_tokenizer(str(DEFAULT_MODEL_DIR))
    base = [tok.encode(r["prompt"]) for r in rows[::40]][:6]
    out = [{"prompt_token_ids": ids} for ids in base]
    for ids in base[:3]:  # a prefix of it, and it with more after it
        out += [{"prompt_token_ids": ids[:max(1, 2 * len(ids) // 3)]}, {"prompt_token_ids": ids + base[-1][:40]}]
    return out


def run(enable: bool, spec: dict | None, batch: list[dict]) -> tuple[list[list[int]], list[int]]:
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=16,
              speculative_config=spec, enable_prefix_caching=enable, async_scheduling=True)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in batch]
    outs += llm.generate(batch, GREEDY, use_tqdm=False)
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens or 0 for o in outs]


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 3}])
def test_prefix_caching_is_exact_in_bf16_with_graphs(spec: dict | None) -> None:
    batch = prompts()
    base, _ = run(False, spec, batch)
    tokens, cached = run(True, spec, batch)
    diverged = [i for i, (a, b) in enumerate(zip(base, tokens, strict=True)) if a != b]
    print(f"prefix caching, spec={spec}: {len(base) - len(diverged)}/{len(base)} identical, "
          f"cached tokens {sum(cached)}")
    assert not diverged, f"requests {diverged} differ (cached tokens {[cached[i] for i in diverged]})"
    assert sum(cached) > 0
