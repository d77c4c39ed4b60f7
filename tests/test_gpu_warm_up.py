"""On CUDA with fla-core (skipped otherwise): the engine's start-up compiles every Triton kernel variant that its
steps launch, so no request waits for a compile. Measured before the fix: the first step in which a long prompt's
chunk (fla) joined running decodes compiled the token loop's variant with gates as tensors, and every running
request waited ~1.1 s for it (BENCHMARKS.md, session 27).
"""

import pytest
import torch

from helpers.engine import fla_runs
from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_runs(), reason="needs CUDA and fla-core")]


def test_no_kernel_compiles_when_a_long_prompt_joins_running_decodes() -> None:
    from triton import knobs

    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="bfloat16", device="cuda", max_model_len=4096, max_num_seqs=9,
              enable_prefix_caching=False)
    engine, gen = llm.llm_engine, torch.Generator().manual_seed(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": torch.randint(10, engine.vocab_size - 10, (n,), generator=gen).tolist()}

    compiled: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: compiled.append(fn.name)
    try:
        decodes = [engine.add_request(prompt(40 + i), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
                   for i in range(8)]  # fmt: skip
        for _ in range(6):
            engine.step()
        long_id = engine.add_request(prompt(3000), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        finished = set()
        while engine.has_unfinished_requests():
            finished |= {out.request_id for out in engine.step() if out.finished}
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert finished >= {long_id, *decodes}
    assert compiled == [], f"compiled after start-up: {compiled}"
