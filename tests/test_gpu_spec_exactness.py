"""On CUDA (skipped without it), the GPU proof of issue 13: speculation is exactly lossless in bf16 and fp16.

Every projection, attention row and GDN row gives the same bits whatever other rows share its step
(docs/ARCHITECTURE.md, invariant 4), so greedy tokens may not depend on speculation, on the batch, on graph
padding or on how prompts are chunked. There is no near-tie excuse: every request must be identical.

On the embedded model and its shipped drafters (ngram k=8 drafted on the host and on the device, MTP k=3, EAGLE k=3,
draft_model k=3), over held-out edit / completion / chat prompts of 19..320 tokens, greedy, in bfloat16 and
float16:

- each method against the run without speculation of the same dtype, max_num_seqs (1, 4, 16) and graph mode
  (CUDA graphs, the default; and enforce_eager at max_num_seqs 1 and 16);
- the same with chunked prefill (max_num_batched_tokens 64, longer prompts, more prompts than max_num_seqs), so
  prefill chunks share steps with decodes and verifies; these runs must also equal the unchunked baseline;
- the same with drafting switched off while 9 or more requests run (disable_by_batch_size) and back on as they
  finish: model drafters defer their catch-up over the steps that draft nothing;
- the baselines themselves: the same tokens at max_num_seqs 1, 4 and 16, with CUDA graphs and without.

Each configuration prints one line per run (identical requests, engine steps, forwards, acceptance) before it
asserts; a failure names the first divergent request and position, with the baseline's top-2 log-probability
margin there (from a rerun of the baseline with logprobs=2).
"""

import functools
import gc
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_DIR, DEFAULT_MODEL_DIR
from truespec.core.scheduler_output import SchedulerOutput
from truespec.entrypoints.verify import top2_margin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if os.environ.get("TRUESPEC_BACKEND", "triton") != "triton":  # graphs and the row-invariant kernels need Triton
    pytestmark.append(pytest.mark.skip(reason="TRUESPEC_BACKEND is not triton"))

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
DEVICE = "cuda"
MAX_TOKENS = 80
MAX_MODEL_LEN = 1024  # longest prompt here ~320 tokens + MAX_TOKENS
CHUNK_BUDGET = 64  # max_num_batched_tokens of the chunked-prefill runs: below most prompts, above a k=8 verify (9)
DTYPES = ["bfloat16", "float16"]
METHODS: dict[str, dict] = {
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
    "ngram k=8 on device": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                            "draft_on_device": True},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "eagle k=3": {"method": "eagle", "num_speculative_tokens": 3, "model": str(DEFAULT_EAGLE_DIR)},
    "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(DEFAULT_DRAFT_MODEL_DIR)},
    "draft_model k=3 on the host": {"method": "draft_model", "num_speculative_tokens": 3,
                                    "model": str(DEFAULT_DRAFT_MODEL_DIR), "draft_on_device": False},
}
if os.environ.get("TRUESPEC_GPU_METHODS"):  # e.g. "ngram,mtp": run only these methods (a shorter GPU call)
    METHODS = {name: spec for name, spec in METHODS.items()
               if spec["method"] in os.environ["TRUESPEC_GPU_METHODS"].split(",")}


@functools.cache
def heldout_prompts() -> tuple[str, ...]:
    """24 held-out prompts, 8 of each kind spread over the file, interleaved (completion, edit, chat, ...) so
    every batch mixes kinds and lengths."""
    rows = [json.loads(line) for line in PROMPTS_FILE.read_text().splitlines()]
    by_kind = [[r["prompt"] for r in rows if r["kind"] == kind] for kind in ("completion", "edit", "chat")]
    spread = [group[:: len(group) // 8][:8] for group in by_kind]
    return tuple(p for triple in zip(*spread, strict=True) for p in triple)


@dataclass(frozen=True)
class Shape:
    """How the engine batches: max_num_seqs, CUDA graphs or eager, chunked prefill or not, prefix caching or not
    (on the hybrid target a prompt's chunks end at its state checkpoints with it, and a model drafter drafts behind
    each chunk on the device, the next chunk riding the verify queued ahead; without it a joining prompt is one
    chunk)."""

    max_num_seqs: int
    graphs: bool = True
    chunked: bool = False
    prefix_caching: bool = True

    @property
    def id(self) -> str:
        return (f"{'graphs' if self.graphs else 'eager'}-bs{self.max_num_seqs}{'-chunked' if self.chunked else ''}"
                f"{'' if self.prefix_caching else '-noprefix'}")

    @property
    def label(self) -> str:
        chunks = f" chunked prefill (max_num_batched_tokens={CHUNK_BUDGET})" if self.chunked else ""
        prefix = "" if self.prefix_caching else " no prefix caching"
        return f"{'graphs' if self.graphs else 'eager'} max_num_seqs={self.max_num_seqs}{chunks}{prefix}"

    def prompts(self) -> list[str]:
        """Batch size 1 runs every request alone, one after another (and eagerly ~10 ms a step): 8 prompts."""
        return list(heldout_prompts()[:8] if self.max_num_seqs == 1 else heldout_prompts())

    def engine_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {"max_num_seqs": self.max_num_seqs, "enforce_eager": not self.graphs}
        if self.chunked:
            kwargs["max_num_batched_tokens"] = CHUNK_BUDGET
        if not self.prefix_caching:
            kwargs["enable_prefix_caching"] = False
        return kwargs


SHAPES = [Shape(1), Shape(4), Shape(4, prefix_caching=False), Shape(16), Shape(1, graphs=False),
          Shape(16, graphs=False)]


@dataclass(frozen=True)
class Run:
    label: str
    token_ids: list[list[int]]
    steps: int  # engine steps
    forwards: dict[str, int]  # the target's "graph" / "eager" forwards
    metrics: dict[str, object]  # speculative-decoding counters (get_metrics())
    mixed_steps: int  # steps holding a prefill chunk beside a decode or verify
    mixed_verify_steps: int  # of them, steps where the decode side verifies drafts
    logprobs: list | None = None  # per request, per position: {token: logprob} (runs with logprobs only)

    def head(self, n: int) -> "Run":
        """The run restricted to its first ``n`` requests."""
        return replace(self, token_ids=self.token_ids[:n], logprobs=self.logprobs and self.logprobs[:n])


def count_mixed_steps(llm: LLM, counts: dict[str, int]) -> None:
    """Wrap the scheduler so ``counts`` records the steps that mix prefill chunks with decodes / verifies."""
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule

    def counting_schedule() -> SchedulerOutput:
        out = schedule()
        prefill = any(r.num_output_tokens == 0 for r in out.scheduled)  # no preemption here: a first prefill
        decoding = [r for r in out.scheduled if r.num_output_tokens > 0]
        if prefill and decoding:
            counts["mixed"] += 1
            counts["mixed_verify"] += any(r.draft_token_ids for r in decoding)
        return out

    scheduler.schedule = counting_schedule


def generate(dtype: str, shape: Shape, method: str | None = None, logprobs: int | None = None,
             spec_extra: dict | None = None) -> Run:
    """One engine for one configuration: greedy-decode the shape's prompts, then free the device."""
    spec = METHODS[method] | (spec_extra or {}) if method is not None else None
    # async_scheduling=True: MTP / EAGLE verifies are queued ahead and drafted on the device (engine/async_scheduler.py)
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, device=DEVICE, max_model_len=MAX_MODEL_LEN,
              speculative_config=spec, async_scheduling=True if spec is not None else None, **shape.engine_kwargs())
    counts = {"mixed": 0, "mixed_verify": 0}
    count_mixed_steps(llm, counts)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=logprobs)
    outs = llm.generate(shape.prompts(), params, use_tqdm=False)
    metrics = llm.get_metrics()
    extra = f" {spec_extra}" if spec_extra else ""
    run = Run(f"{dtype} {shape.label} {method or 'no speculation'}{extra}", [o.outputs[0].token_ids for o in outs],
              metrics["num_steps"], dict(llm.llm_engine.runner.graphs.stats), metrics, counts["mixed"],
              counts["mixed_verify"], [o.outputs[0].logprobs for o in outs] if logprobs is not None else None)
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return run


@functools.cache
def baseline(dtype: str, shape: Shape) -> Run:
    """The run without speculation (async scheduling on, as by default on CUDA), shared by the tests."""
    return generate(dtype, shape)


@functools.cache
def baseline_with_logprobs(dtype: str, shape: Shape) -> Run:
    """The same baseline with logprobs=2 (only built to explain a failure: it turns async scheduling off)."""
    return generate(dtype, shape, logprobs=2)


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """The first output position where the two differ (one may have stopped first); None if identical."""
    if reference == other:
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b),
                min(len(reference), len(other)))


def num_identical(reference: Run, run: Run) -> int:
    return sum(a == b for a, b in zip(reference.token_ids, run.token_ids, strict=False))


def describe_divergence(reference: Run, run: Run, margins_from: Run | None = None) -> str | None:
    """The first divergent request of ``run`` against ``reference``: request, position, both tokens and the
    reference's top-2 log-probability margin there (from ``margins_from``, a logprobs run of the reference)."""
    for i, (a, b) in enumerate(zip(reference.token_ids, run.token_ids, strict=False)):
        pos = first_divergence(a, b)
        if pos is None:
            continue
        token_a = a[pos] if pos < len(a) else "<end>"
        token_b = b[pos] if pos < len(b) else "<end>"
        margin = ""
        if margins_from is not None and margins_from.logprobs is not None:
            if margins_from.token_ids[i] != a:
                margin = " (the logprobs rerun of the reference gives other tokens for this request itself)"
            elif a:
                top2 = top2_margin(margins_from.logprobs[i][min(pos, len(a) - 1)])
                margin = f" (reference top-2 logprob margin there {top2:.4g})"
        same = num_identical(reference, run)
        return (f"{run.label}: {same}/{len(reference.token_ids)} identical to {reference.label}; first divergence: "
                f"request {i} at output position {pos}: {token_a} in the reference, {token_b} here{margin}")
    return None


def summary(reference: Run, run: Run) -> str:
    m = run.metrics
    accept = (f", {m['num_draft_tokens'] / m['num_drafts']:.2f} drafts per verify, mean acceptance length "
              f"{m['mean_acceptance_length']:.2f}") if m["num_drafts"] else ""
    mixed = f", mixed prefill+decode steps {run.mixed_steps} (with verifies {run.mixed_verify_steps})" \
        if run.mixed_steps else ""
    return (f"{run.label}: identical {num_identical(reference, run)}/{len(reference.token_ids)}, steps {run.steps} "
            f"(baseline {reference.steps}), forwards {run.forwards}{accept}{mixed}")


def check_graph_use(run: Run, shape: Shape) -> None:
    """The run used CUDA graphs exactly when the shape asks for them (else the test proves less than it says)."""
    if shape.graphs:
        assert run.forwards.get("graph", 0) > 0, f"{run.label}: no step replayed a CUDA graph ({run.forwards})"
    else:
        assert run.forwards.get("graph", 0) == 0, f"{run.label}: enforce_eager replayed graphs ({run.forwards})"


def assert_identical(dtype: str, shape: Shape, reference: Run, runs: list[Run]) -> None:
    """Every run's every request equals ``reference``; the message explains the first failure."""
    failures = [run for run in runs if run.token_ids != reference.token_ids]
    if failures:
        margins = baseline_with_logprobs(dtype, shape)
        details = [describe_divergence(reference, run, margins) for run in failures]
        pytest.fail("speculation changed tokens:\n" + "\n".join(d for d in details if d))


def run_methods(dtype: str, shape: Shape, spec_extra: dict | None = None) -> tuple[Run, list[Run]]:
    """The baseline and every method in ``shape``, one summary line each; checks graph use and acceptance."""
    reference = baseline(dtype, shape)
    check_graph_use(reference, shape)
    print(f"\n{reference.label}: steps {reference.steps}, forwards {reference.forwards}")
    runs = []
    for method in METHODS:
        run = generate(dtype, shape, method, spec_extra=spec_extra)
        print(summary(reference, run))
        runs.append(run)
    for run in runs:
        check_graph_use(run, shape)
        assert run.metrics["num_accepted_tokens"] > 0, f"{run.label}: no draft was accepted"
    return reference, runs


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_speculation_is_lossless_at_every_batch_size(dtype: str, shape: Shape) -> None:
    reference, runs = run_methods(dtype, shape)
    assert_identical(dtype, shape, reference, runs)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_speculation_is_lossless_with_prefill_chunks_beside_decodes(dtype: str, graphs: bool) -> None:
    """24 prompts (most longer than the 64-token budget) into 16 sequences: the later ones are admitted while
    the first decode, so their prefill chunks share steps with decodes and verifies, and speculation changes how
    the budget splits each prompt. The chunked runs must also equal the unchunked baseline."""
    shape = Shape(16, graphs=graphs, chunked=True)
    reference, runs = run_methods(dtype, shape)
    unchunked = baseline(dtype, Shape(16, graphs=graphs))
    print(summary(unchunked, reference))
    assert reference.mixed_steps > 0, f"{reference.label}: no step mixed a prefill chunk with decodes"
    for run in runs:
        assert run.mixed_verify_steps > 0, f"{run.label}: no step mixed a prefill chunk with a verify"
    assert_identical(dtype, shape, reference, runs)
    divergence = describe_divergence(unchunked, reference)
    assert divergence is None, f"chunked prefill changed tokens: {divergence}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_speculation_is_lossless_while_drafting_turns_off_and_on(dtype: str) -> None:
    """disable_by_batch_size 9 with 24 prompts into 16 sequences: nobody drafts while 9 or more run (the steps go
    queued ahead as plain decodes, a model drafter's catch-up deferred), then drafting resumes as requests finish
    (the drafter first catches up on the deferred positions)."""
    shape = Shape(16)
    reference, runs = run_methods(dtype, shape, spec_extra={"disable_by_batch_size": 9})
    for run in runs:
        assert run.metrics["num_steps_without_drafts"] >= 0.3 * run.steps, run.metrics
    assert_identical(dtype, shape, reference, runs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_baseline_is_batch_invariant(dtype: str) -> None:
    """Without speculation: max_num_seqs 1, 4 and 16 give the same tokens (in each graph mode)."""
    problems = []
    for graphs in (True, False):
        sizes = (1, 4, 16) if graphs else (1, 16)
        full = baseline(dtype, Shape(16, graphs=graphs))
        for size in sizes[:-1]:
            run = baseline(dtype, Shape(size, graphs=graphs))
            head = full.head(len(run.token_ids))
            print(summary(head, run))
            if (divergence := describe_divergence(head, run)) is not None:
                problems.append(divergence)
    assert not problems, "the batch changed tokens:\n" + "\n".join(problems)


@pytest.mark.parametrize("dtype", DTYPES)
def test_graphs_change_no_tokens(dtype: str) -> None:
    """Without speculation: CUDA graph replay (steps padded to capture sizes) gives the eager tokens."""
    problems = []
    for size in (1, 16):
        eager, graphs = baseline(dtype, Shape(size, graphs=False)), baseline(dtype, Shape(size))
        print(summary(eager, graphs))
        if (divergence := describe_divergence(eager, graphs)) is not None:
            problems.append(divergence)
    assert not problems, "CUDA graphs changed tokens:\n" + "\n".join(problems)
