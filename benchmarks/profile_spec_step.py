"""Where a speculative step's time goes: one greedy request (or a batch), MTP / EAGLE with each step planned on the
host after the previous one's read or queued ahead (``async_scheduling=True``), under torch.profiler; prints per
configuration the wall time, GPU kernel time and GPU kernel count per step and the ops that took the most host (or, with
``--sort self_cuda_time_total``, GPU) time.

    python3 benchmarks/profile_spec_step.py [--batch-size 1] [--max-tokens 64] [--top 18] [--sort KEY]
        [--max-num-seqs N]

Run one configuration per process for host timings: after a first profiled run, CUDA calls of the same process
were measured ~2x slower (cudaGraphLaunch 127 -> 293 us), so only the first configuration's wall time is clean.

``--max-num-seqs`` builds the engine for N requests and lowers the scheduler's limit to the batch size, as
spec_vs_none.py does (its graphs, drafter chain and caches are then sized for N).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_DIR

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout.jsonl"
CONFIGS = {
    "none": (None, {}),
    "mtp k=3": ({"method": "mtp", "num_speculative_tokens": 3}, {"async_scheduling": False}),
    "mtp k=3 ahead": ({"method": "mtp", "num_speculative_tokens": 3}, {"async_scheduling": True}),
    "mtp k=3 no drafts": ({"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 1},
                         {"async_scheduling": True}),
    "ngram k=8": ({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
                  {"async_scheduling": True}),
    "ngram k=8 on device": ({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                             "draft_on_device": True}, {"async_scheduling": True}),
    "eagle k=3": ({"method": "eagle", "num_speculative_tokens": 3, "model": str(DEFAULT_EAGLE_DIR)},
                  {"async_scheduling": False}),
    "eagle k=3 ahead": ({"method": "eagle", "num_speculative_tokens": 3, "model": str(DEFAULT_EAGLE_DIR)},
                        {"async_scheduling": True}),
    "draft_model k=3": ({"method": "draft_model", "num_speculative_tokens": 3, "model": str(DEFAULT_DRAFT_MODEL_DIR)},
                        {"async_scheduling": True}),  # on the device (the default since session 19)
    "draft_model k=3 on the host": ({"method": "draft_model", "num_speculative_tokens": 3,
                                     "model": str(DEFAULT_DRAFT_MODEL_DIR), "draft_on_device": False},
                                    {"async_scheduling": True}),
}


def timed_steps(llm: LLM) -> list[float]:
    """Time each ``engine.step`` of ``llm`` (ms) into the returned list, until ``del llm.llm_engine.step``."""
    engine, times = llm.llm_engine, []
    step = engine.step

    def timed() -> object:
        start = time.perf_counter()
        out = step()
        times.append(1e3 * (time.perf_counter() - start))
        return out
    engine.step = timed
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--sort", default="self_cpu_time_total", help="or self_cuda_time_total (GPU kernels)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine size (default: the batch size)")
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [r["prompt"] for r in rows if r["kind"] == "edit"][:args.batch_size]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for name in args.configs:
        spec, kwargs = CONFIGS[name]
        llm = LLM(dtype="bfloat16", device="cuda", max_model_len=2048,
                  max_num_seqs=args.max_num_seqs or args.batch_size, speculative_config=spec,
                  enable_prefix_caching=False, **kwargs)
        llm.llm_engine.scheduler.max_num_seqs = args.batch_size  # a benchmark-only knob, as spec_vs_none.py
        llm.generate(prompts, params, use_tqdm=False)
        steps_before = llm.get_metrics().get("num_steps", 0)
        step_ms = timed_steps(llm)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        del llm.llm_engine.step  # the engine's own step again
        steps = llm.get_metrics().get("num_steps", 0) - steps_before
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        print(f"\n=== {name}: {1e3 * wall:.1f} ms for {args.max_tokens} tokens x {args.batch_size}, {steps} steps "
              f"({1e3 * wall / max(steps, 1):.3f} ms / step), async steps "
              f"{llm.llm_engine.overlap.num_async_steps}")
        print(f"step ms: median {statistics.median(step_ms):.3f}, slowest "
              + " ".join(f"{t:.2f}" for t in sorted(step_ms)[-8:]) + f", sum {sum(step_ms):.1f}")
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        kernels = sum(e.count for e in events if e.self_device_time_total > 0 and e.self_cpu_time_total == 0)
        print(f"GPU kernel time {gpu_us / 1e3:.1f} ms ({gpu_us / 1e3 / max(steps, 1):.3f} ms / step), "
              f"{kernels / max(steps, 1):.1f} GPU ops (kernels, copies) / step")
        print(events.table(sort_by=args.sort, row_limit=args.top, max_name_column_width=48))
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
