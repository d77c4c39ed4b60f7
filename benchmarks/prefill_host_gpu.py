"""Host vs GPU time of one long prefill's model forward (issue 17): whether the host's launches or the GPU's kernels
bound it. Each run sends one fresh random prompt (greedy, one output token, prefix caching off) and times the
target's forward as the runner makes it (GraphRunner.run: the step's inputs, then the model eagerly or its graphs'
replays): the host's time to return from it (its launches; no sync after) and the GPU's time between events
around it. Odd runs queue a ~0.3 s sleep kernel first, so the GPU's time is the kernels' alone (no wait for the
host); if the host's time then includes the sleep, the forward waits for the GPU somewhere (a sync, or a copy
from pageable host memory). ``--profile N``: one more GPU-ahead run under cProfile, its N most costly functions by
own time and by cumulative time (where the host's time goes).

    python3 benchmarks/prefill_host_gpu.py --model /tmp/qwen35-0.8b-shape [--length 8192] [--runs 8] [--profile 40]
"""

import argparse
import cProfile
import pstats
import time

import torch
from prefill_ttft import random_prompts

from truespec import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--profile", type=int, default=0, help="then profile one run's forward: print N functions")
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16", device="cuda", max_model_len=args.length + 600, max_num_seqs=9,
              enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    graphs = llm.llm_engine.runner.graphs  # its run: the step's inputs, then the forward, eager or replayed
    forward, state = graphs.run, {"gpu_ahead": False, "marks": [], "profiler": None}

    def timed_forward(*a, **k):  # noqa: ANN002, ANN003, ANN202 - GraphRunner.run's own signature
        torch.cuda.synchronize()
        if state["gpu_ahead"]:
            torch.cuda._sleep(int(6e8))  # ~0.3 s of GPU work queued ahead of the forward's launches
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        if state["profiler"] is not None:
            state["profiler"].enable()
        out = forward(*a, **k)
        if state["profiler"] is not None:
            state["profiler"].disable()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        state["marks"].append((1e3 * (t1 - t0), start.elapsed_time(end)))
        return out

    graphs.run = timed_forward
    print(torch.cuda.get_device_name(), f"{args.length}-token prompts: (host ms, GPU ms) per forward")
    for i in range(args.runs):
        state["gpu_ahead"], state["marks"] = i % 2 == 1, []
        llm.generate(random_prompts(llm.llm_engine.vocab_size, 1, args.length, seed=50 + i), params, use_tqdm=False)
        label = "GPU ahead" if state["gpu_ahead"] else "plain"
        print(f"run {i} {label:9}: " + "; ".join(f"{h:.1f} / {g:.1f}" for h, g in state["marks"]), flush=True)
    if args.profile:
        state["gpu_ahead"], state["profiler"] = True, cProfile.Profile()
        llm.generate(random_prompts(llm.llm_engine.vocab_size, 1, args.length, seed=49), params, use_tqdm=False)
        stats = pstats.Stats(state["profiler"])
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(args.profile)


if __name__ == "__main__":
    main()
