"""Random sampling in the engine (engine/model_runner.py ``_queue_tokens``): every random request's draws are
made on the device with its own generator, and a step reads its tokens back in one host transfer. A seeded
request's tokens depend on nothing else in the batch (invariant 1), and the host reads of a step do not grow
with the number of random requests."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from helpers.engine import generate, spec_llm
from truespec import LLM, SamplingParams

HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def repetitive_prompts(lengths: list[int], seed: int) -> list[dict]:
    """Prompts that repeat a short pattern: ngram drafts 0..k tokens, a different count at each step."""
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": (torch.randint(1, 300, (max(2, n // 3),), generator=g).tolist() * 4)[:n]}
            for n in lengths]


def mixed_params(num: int) -> list[SamplingParams]:
    """Seeded random requests with every filter, and greedy ones between them."""
    params = []
    for i in range(num):
        if i % 3 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.7 + 0.2 * (i % 2), top_k=40 * (i % 2), min_p=0.02 * (i % 2),
                                         top_p=0.9 + 0.05 * (i % 3), seed=500 + i, max_tokens=14, ignore_eos=True))
    return params


def test_seeded_random_request_is_independent_of_batch_and_order(tiny_models: dict[str, Path]) -> None:
    prompts = repetitive_prompts([5, 31, 12, 44, 20, 9], seed=23)
    params = mixed_params(len(prompts))
    llm = spec_llm(tiny_models["hybrid"], 3, max_num_batched_tokens=24)
    together = generate(llm, prompts, params)
    order = [3, 0, 5, 1, 4, 2]
    reordered = generate(llm, [prompts[i] for i in order], [params[i] for i in order])
    solo = [generate(llm, [p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    assert together == solo
    assert [reordered[order.index(i)] for i in range(len(prompts))] == solo
    assert llm.get_metrics()["num_drafts"] > 0
    assert len({tuple(t) for t in together}) == len(prompts)
    greedy_solo = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    assert [together[i] for i in greedy] == generate(greedy_solo, [prompts[i] for i in greedy],
                                                      [params[i] for i in greedy])  # speculation stays lossless


@contextmanager
def counting_host_reads(counts: list[int]) -> Iterator[None]:
    """Count calls of the tensor methods that read a value back to the host (each a sync on a GPU)."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(original: Callable) -> Callable:
        def wrapper(*args: object, **kwargs: object) -> object:
            counts[0] += 1
            return original(*args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def host_reads_per_step(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[tuple[int, int]]:
    """Per step: the host reads in ``ModelRunner.launch`` (forward, logits, draws) and in ``collect``."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    reads: list[tuple[int, int]] = []
    launch, collect = runner.launch, runner.collect

    def launch_counted(*args: object, **kwargs: object) -> object:
        counts = [0]
        with counting_host_reads(counts):
            step = launch(*args, **kwargs)
        reads.append((counts[0], 0))
        return step

    def collect_counted(step: object) -> object:
        counts = [0]
        with counting_host_reads(counts):
            out = collect(step)
        reads[-1] = (reads[-1][0], counts[0])
        return out

    runner.launch, runner.collect = launch_counted, collect_counted
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    return reads


@pytest.mark.parametrize("method", ["ngram", "none"])
def test_random_sampling_reads_the_host_once_per_step(tiny_models: dict[str, Path], method: str) -> None:
    kw = {"max_num_batched_tokens": 256}
    prompts = repetitive_prompts([6, 14, 9, 21, 12, 17, 8, 11, 15], seed=29)
    per_step = {}
    for num_random in (1, 8):
        llm = spec_llm(tiny_models["hybrid"], 3, **kw) if method == "ngram" else \
            LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400, **kw)
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True)
                  for i in range(num_random)] + [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
        per_step[num_random] = host_reads_per_step(llm, prompts[:num_random + 1], params)
        if method == "ngram":
            assert llm.get_metrics()["num_drafts"] > 0
    print(per_step)
    assert {c for _, c in per_step[1] + per_step[8]} == {1}, per_step  # collect: one .tolist() of all the tokens
    assert max(per_step[8]) == max(per_step[1]), per_step  # launch: none per random request


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_random_sampling_with_graphs_is_seeded_and_reads_the_host_once_per_step() -> None:
    """On CUDA (device generators, graphs FULL, float32 with TF32 off, ngram k=3): seeded random requests mixed
    with greedy ones give the same tokens in another order, and ``collect`` reads the host once per step."""
    torch.backends.cuda.matmul.allow_tf32 = False
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(dtype="float32", device="cuda", max_model_len=512, speculative_config=config,
              compilation_config={"cudagraph_mode": "FULL"})
    prompts = repetitive_prompts([5, 31, 12, 44, 20, 9, 27, 16], seed=31)
    params = mixed_params(len(prompts))
    together = generate(llm, prompts, params)
    order = [3, 0, 5, 1, 7, 4, 2, 6]
    reordered = generate(llm, [prompts[i] for i in order], [params[i] for i in order])
    assert [reordered[order.index(i)] for i in range(len(prompts))] == together
    assert llm.get_metrics()["num_drafts"] > 0 and len({tuple(t) for t in together}) == len(prompts)
    reads = host_reads_per_step(llm, prompts, params)
    assert {c for _, c in reads} == {1}, reads
