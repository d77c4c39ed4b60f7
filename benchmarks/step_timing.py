"""Where a graph-replayed decode step's wall time goes: the GPU (replaying the captured graph alone) vs the host
(scheduling, packing inputs, logits, sampling, postprocessing), with a cProfile of the host side; the wall time
with async scheduling off (host and device take turns) and on (the host prepares step N+1 while N runs).

    python3 benchmarks/step_timing.py --model DIR [--batch-sizes 1 32] [--input-len 512] [--steps 64]

Every request's prefill finishes before anything is timed, so only decode steps are measured.
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

from truespec import LLM, RequestOutputKind, SamplingParams

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # as LLM.generate: no per-step outputs to build


def _decode_ready(llm: LLM, batch_size: int, input_len: int, max_tokens: int) -> None:
    """Add ``batch_size`` random-id requests and step until every prompt is computed."""
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch_size):
        ids = torch.randint(10, 2000, (input_len,), generator=gen).tolist()
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                      ignore_eos=True, output_kind=FINAL_ONLY))
    while any(s.num_computed_tokens < s.prompt_len for s in engine.seqs.values()):
        engine.step()
    torch.cuda.synchronize()


def measure(llm: LLM, batch_size: int, input_len: int, steps: int) -> dict[str, float]:
    engine = llm.llm_engine
    _decode_ready(llm, batch_size, input_len, 4 * steps + 8)
    wall = {}
    for overlap in (False, True):
        engine.overlap.enabled = overlap  # a benchmark-only switch of the engine's async_scheduling
        engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall[overlap] = (time.perf_counter() - start) / steps
    runner = engine.runner.graphs
    size = next(s for s in runner.sizes if s >= batch_size)
    graph, _ = runner.graphs[size]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - start) / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    while engine.has_unfinished_requests():
        engine.step()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print(f"\n### BS={batch_size} host profile (tottime, {steps} steps)\n{text.getvalue()}")
    return {"sync_ms": wall[False] * 1e3, "async_ms": wall[True] * 1e3, "replay_ms": replay * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, device="cuda", max_model_len=4096, max_num_seqs=max(args.batch_sizes),
              batch_invariant=args.batch_invariant, enable_prefix_caching=False)
    rows = [(bs, measure(llm, bs, args.input_len, args.steps)) for bs in args.batch_sizes]
    print(f"\n{torch.cuda.get_device_name()}, decode steps after a {args.input_len}-token prompt, CUDA graphs, "
          f"batch_invariant={args.batch_invariant}")
    print("| BS | graph replay alone (ms) | wall per step, sync (ms) | wall per step, async (ms) "
          "| host not overlapped, sync / async (ms) | output tok/s, async |")
    print("|---:|---:|---:|---:|---:|---:|")
    for bs, r in rows:
        print(f"| {bs} | {r['replay_ms']:.3f} | {r['sync_ms']:.3f} | {r['async_ms']:.3f} "
              f"| {r['sync_ms'] - r['replay_ms']:.3f} / {r['async_ms'] - r['replay_ms']:.3f} "
              f"| {bs / r['async_ms'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
