"""On CUDA with fla-core (skipped otherwise): with a GdnPrefillRule (core/gdn_prefill_rule.py) a long prompt's GDN
prefill gives the same bits however it is chunked, so greedy tokens do not depend on the token budget,
long_prefill_token_threshold, prefix caching or speculation.

The embedded hybrid model in bf16 (default CUDA graphs), prompts of 1100-2500 tokens cut from the held-out code (and
two short ones beside them), 32 greedy tokens each: (a) max_num_batched_tokens 8192 vs 300 vs
long_prefill_token_threshold 128; (b) prefix caching on vs off, with prompts sharing prefixes and a next turn;
(c) ngram k=8 vs no speculation, in bf16 and fp16; (d) MTP k=3 vs none, requests joining others' verifies. Every
run must have sent prompt chunks to fla's chunk kernel (counted).
"""

import gc
import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from helpers.engine import fla_runs
from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.tokenizer import load_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_runs(), reason="needs CUDA and fla-core")]
PROMPTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
# logprobs: the first check is bitwise (the top-5 logprobs of every output position equal as floats), tokens the second
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
LENGTHS = [1100, 2500, 1537, 2047, 1301, 1800]  # long prompts (>= 1024 tokens), cut anywhere by the budgets
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def held_out_ids() -> list[int]:
    text = "\n\n".join(json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines())
    return load_tokenizer(str(DEFAULT_MODEL_DIR)).encode(text)


def long_prompts() -> list[list[int]]:
    ids = held_out_ids()
    step = (len(ids) - max(LENGTHS)) // len(LENGTHS)
    out = [ids[i * step:i * step + n] for i, n in enumerate(LENGTHS)]
    return out + [ids[-300:], ids[-700:]]  # short prompts beside them: the token loop


@contextmanager
def counting_fla_calls() -> Iterator[Counter[str]]:
    """Count the calls of fla's chunk kernel (kernels/gdn_chunked.py) while the block runs."""
    from truespec.kernels import gdn_chunked

    real, counts = gdn_chunked._chunk_kernel, Counter()

    def counting() -> Callable | None:
        kernel = real()
        if kernel is None:
            return None

        def call(*args: object, **kwargs: object) -> object:
            counts["fla"] += 1
            return kernel(*args, **kwargs)
        return call

    gdn_chunked._chunk_kernel = counting
    try:
        yield counts
    finally:
        gdn_chunked._chunk_kernel = real


def generate(batches: list[list[list[int]]], dtype: str = "bfloat16", params: SamplingParams = GREEDY,
             **kwargs: object) -> list[tuple[list[int], list]]:  # fmt: skip
    """(greedy tokens, their top-5 logprobs) of each batch in turn (one engine: a later batch may reuse what an
    earlier one cached)."""
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, device="cuda", max_model_len=4096, max_num_seqs=4, **kwargs)
    assert llm.llm_engine.gdn_rule is not None and llm.llm_engine.gdn_rule.min_prompt_len == 1024
    tokens = []
    with counting_fla_calls() as counts:
        for batch in batches:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            tokens += [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert counts["fla"] > 0, "no prompt chunk went through fla's chunk kernel"
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def assert_same(expected: list[tuple], actual: list[tuple], what: str) -> None:
    """Same tokens and bitwise the same logprobs (a chunking-dependent GDN state would show in the bits first)."""
    diverged = [i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a[0] != b[0]]
    bits = [i for i, (a, b) in enumerate(zip(expected, actual, strict=True)) if a[1] != b[1]]
    print(f"{what}: {len(expected) - len(diverged)}/{len(expected)} identical tokens, {len(bits)} with other logprobs")
    assert not diverged and not bits, f"{what}: requests {diverged} differ in tokens, {bits} in logprob bits"


def test_long_prompt_tokens_do_not_depend_on_the_budget_or_the_prefill_cap() -> None:
    batch = long_prompts()
    whole = generate([batch], max_num_batched_tokens=8192, enable_prefix_caching=False)
    assert_same(whole, generate([batch], max_num_batched_tokens=300, enable_prefix_caching=False), "budget 300")
    assert_same(whole, generate([batch], max_num_batched_tokens=8192, long_prefill_token_threshold=128,
                                enable_prefix_caching=False), "long_prefill_token_threshold 128")


def test_long_prompt_tokens_do_not_depend_on_prefix_caching() -> None:
    """Shared prefixes (a prompt, it extended, a prefix of it with another tail, a short prompt sharing its start)
    and a next turn (the first prompt, its answer, more text), one batch after another."""
    base = long_prompts()
    first = [base[0] + base[2][:200], base[0], base[0][:1200] + base[3][:150], base[0][:900], base[1]]
    turn1 = generate([first], enable_prefix_caching=False)
    second = [base[0] + turn1[1][0] + base[4][:100], base[1] + turn1[4][0] + base[5][:64], base[1][:1500]]
    off = generate([first, second], enable_prefix_caching=False, max_num_batched_tokens=512)
    on = generate([first, second], enable_prefix_caching=True, max_num_batched_tokens=512)
    assert_same(off, on, "prefix caching on vs off")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])  # fla takes q / k / v in the model's dtype
def test_long_prompt_tokens_do_not_depend_on_speculation(dtype: str) -> None:
    batch = long_prompts()
    plain = generate([batch], dtype, max_num_batched_tokens=300)
    assert_same(plain, generate([batch], dtype, max_num_batched_tokens=300, speculative_config=NGRAM), "ngram k=8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_long_prompts_joining_a_model_drafters_batch_keep_their_tokens(dtype: str) -> None:
    """MTP k=3 vs no speculation, greedy without logprobs (so waiting requests may join verifies queued ahead), 8
    prompts through 4 request slots: the requests that join while others verify get the same tokens (a long prompt
    joins only a step planned on the host, engine/verify_plan.py: in a moved step its chunk would miss fla)."""
    batch = long_prompts()
    tokens_only = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = generate([batch], dtype, tokens_only, enable_prefix_caching=False)
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, device="cuda", max_model_len=4096, max_num_seqs=4,
              speculative_config=MTP, enable_prefix_caching=False)  # fmt: skip
    try:
        with counting_fla_calls() as counts:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], tokens_only, use_tqdm=False)
        assert_same(plain, [(o.outputs[0].token_ids, None) for o in outs], "mtp k=3")
        assert counts["fla"] > 0, "no prompt chunk went through fla's chunk kernel"
        # without prefix caching's checkpoint cuts the short prompts join verifies queued ahead whole (on an H200 at
        # least; the joins depend on the accepted counts), the long ones steps planned on the host: the 700-token
        # one makes a moved step of ~712 tokens, through the piecewise graphs
        stats = llm.llm_engine.runner.graphs.stats
        assert llm.llm_engine.overlap.num_admitted_ahead > 0 and stats["piecewise_ahead"] > 0, stats
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_piecewise_graphs_give_the_eager_prefill_steps_tokens() -> None:
    """Steps with fla's chunk kernel replay piecewise graphs in FULL mode (worker/piecewise_graphs.py: padded to a
    bucket, decodes beside a prompt chunk) and run eagerly in FULL_DECODE_ONLY: the same tokens and logprob bits."""
    batch, runs = long_prompts(), {}
    for mode in ("FULL", "FULL_DECODE_ONLY"):
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="bfloat16", device="cuda", max_model_len=4096, max_num_seqs=4,
                  max_num_batched_tokens=1536, enable_prefix_caching=False,
                  compilation_config={"cudagraph_mode": mode})  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        runs[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        stats = llm.llm_engine.runner.graphs.stats
        assert (stats["piecewise"] > 0) == (mode == "FULL"), stats
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert_same(runs["FULL_DECODE_ONLY"], runs["FULL"], "piecewise graphs vs eager prefill steps")
