"""The engine's host time per decode step, without the model: the forward and the logits are replaced by
constant tensors, so what is timed is scheduling, building the step's inputs, sampling bookkeeping and
postprocessing, the part of a step a CUDA graph replay does not remove. Runs on CPU.

    python3 benchmarks/host_overhead.py --model DIR [--batch-sizes 1 8 32] [--steps 300] [--prompt-len 64] [--profile]
        [--ngram K | --mtp K] [--async] [--narrow-logits] [--disable-by-batch-size N]

DIR: any model directory (e.g. ``benchmarks/qwen35_shape.py --tiny``); only its tokenizer and sizes matter.
``--ngram K``: speculative steps, ngram with K drafts (the stubbed logits make every token 0, so after a few steps
every draft is accepted: K + 1 tokens a step, the most host work a verify brings). ``--mtp K``: MTP with K drafts
(the model's MTP layer; its logits stubbed too, so again every draft is accepted; on CPU the drafting runs op by op,
where a GPU replays one captured chain, so this over-states the drafter's share). ``--async``: async scheduling, as
on a GPU (the next decode is planned inside the step; plain decode only: ngram drafts each step).
``--narrow-logits``: the stubbed logits are one column wide (the same token 0), so the argmax over the vocabulary,
device work on a GPU but ~0.5 ms of CPU time at BS=64, is not timed. The time is the median of the steps' chunks
of 30 (the machine is shared: a burst of other work moves one chunk, not the median).
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from truespec import LLM, RequestOutputKind, SamplingParams
from truespec.worker.graph_runner import GraphRunner

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # as LLM.generate: no per-step outputs to build
CHUNK = 30  # steps timed together


def host_ms_per_step(model: str, batch_size: int, steps: int, profile: bool, prompt_len: int = 64,
                     ngram: int = 0, is_async: bool = False, narrow_logits: bool = False,
                     disable_by_batch_size: int | None = None, mtp: int = 0) -> float:  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": ngram} if ngram else None
    spec = {"method": "mtp", "num_speculative_tokens": mtp} if mtp else spec
    if spec is not None and disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = disable_by_batch_size
    max_tokens = (10 + steps + steps // 2) * (1 + max(ngram, mtp)) + 64  # no request finishes while timed or profiled
    llm = LLM(model, dtype="float32", max_model_len=max(4096, prompt_len + max_tokens), max_num_seqs=batch_size,
              speculative_config=spec, async_scheduling=is_async or None)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch_size):
        ids = torch.randint(10, 2000, (prompt_len,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=FINAL_ONLY)
        engine.add_request({"prompt_token_ids": ids}, params)
    while any(s.num_computed_tokens < s.prompt_len for s in engine.seqs.values()):
        engine.step()
    vocab, hidden = engine.runner.model.embed_tokens.weight.shape
    vocab = 1 if narrow_logits else vocab
    real_call = GraphRunner._call
    GraphRunner._call = lambda self, inputs, size, h=None: torch.zeros(inputs.input_ids.shape[0], hidden)
    engine.runner.model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    if mtp:  # the head's logits too: every draft is token 0, as every target token, so all are accepted
        engine.proposer.head.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    try:
        for _ in range(10):
            engine.step()
        chunks = []
        for _ in range(max(1, steps // CHUNK)):
            start = time.perf_counter()
            for _ in range(CHUNK):
                engine.step()
            chunks.append((time.perf_counter() - start) / CHUNK)
        elapsed = statistics.median(chunks)
        if profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [engine.step() for _ in range(steps // 2)])
            sort = "cumulative" if profile == "cumulative" else "tottime"
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(25)
            print(f"### BS={batch_size}\n{text.getvalue()}")
    finally:
        GraphRunner._call = real_call
    return elapsed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--profile", nargs="?", const="tottime", default=None, choices=["tottime", "cumulative"],
                        help="also print a cProfile of each batch size (sorted by own time, or cumulative)")
    parser.add_argument("--ngram", type=int, default=0, help="ngram speculation with this many drafts (0: none)")
    parser.add_argument("--mtp", type=int, default=0, help="MTP speculation with this many drafts (0: none)")
    parser.add_argument("--async", dest="is_async", action="store_true", help="async scheduling (as on a GPU)")
    parser.add_argument("--narrow-logits", action="store_true", help="one-column logits: the argmax is not timed")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="with --ngram: no drafts while this many requests run (1: a speculative engine that never "
                             "drafts, as the governor's 'off')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [(bs, host_ms_per_step(args.model, bs, args.steps, args.profile, args.prompt_len,
                                  args.ngram, args.is_async, args.narrow_logits, args.disable_by_batch_size,
                                  args.mtp))
            for bs in args.batch_sizes]
    print("| BS | host ms per decode step | us per request |\n|---:|---:|---:|")
    for bs, ms in rows:
        print(f"| {bs} | {ms:.3f} | {ms * 1e3 / bs:.1f} |")


if __name__ == "__main__":
    main()
