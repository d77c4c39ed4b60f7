"""Host time per engine phase of speculative steps: MTP k=3, BS=1, host-planned vs queued ahead
(``async_scheduling=True``). Wraps the engine's phases with wall-clock timers (no profiler), generates 128 greedy
tokens for 8 held-out edit prompts after a warm-up, and prints per configuration the wall time per step and each
phase's total time and call count (nested phases count in their callers too: ``launch`` holds both the
AsyncScheduler's and the runner's, ``launch_next`` the queued step's launch).

    python3 benchmarks/spec_step_phases.py [--configs "queued ahead" host-planned] [--cprofile N]

``--cprofile N``: then one more run of each configuration under cProfile, its N functions with the most own time
(``tottime``) and the N with the most time inside them (``cumtime``): the host's work per step, function by function
(cProfile's own overhead inflates the Python-heavy parts).
"""

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from truespec import LLM, SamplingParams

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout.jsonl"


def timed(obj: object, name: str, acc: defaultdict) -> None:
    real: Callable = getattr(obj, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        out = real(*args, **kwargs)
        acc[name] += time.perf_counter() - start
        acc[name + "#"] += 1
        return out

    setattr(obj, name, wrapper)


CONFIGS = {"queued ahead": {"async_scheduling": True}, "host-planned": {"async_scheduling": False}}


def print_cprofile(llm: LLM, prompts: list[str], params: SamplingParams, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    profiler.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
        print(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--cprofile", type=int, default=0)
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    pool = [r["prompt"] for r in rows if r["kind"] == "edit"]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for label in args.configs:
        kwargs = CONFIGS[label]
        llm = LLM(dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=1,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3}, enable_prefix_caching=False,
                  **kwargs)
        llm.generate(pool[:2], params, use_tqdm=False)
        engine, acc = llm.llm_engine, defaultdict(float)
        phases = [(engine.overlap, ["launch", "launch_next"]), (engine.runner, ["collect", "launch"]),
                  (engine, ["_update", "step"]), (engine.handoff, ["take_device_drafts", "propose"]),
                  (engine.scheduler, ["schedule"]),
                  (engine.proposer, ["draft_on_device"])]
        for obj, names in phases:
            for name in names:
                timed(obj, name, acc)
        before, queued = llm.get_metrics(), engine.overlap.num_async_steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(pool[:8], params, use_tqdm=False)
        torch.cuda.synchronize()
        wall, after = time.perf_counter() - start, llm.get_metrics()
        steps = after["num_steps"] - before["num_steps"]
        print(f"{label}: {1e3 * wall:.0f} ms, {steps} steps ({engine.overlap.num_async_steps - queued} queued ahead), "
              f"{1e3 * wall / steps:.3f} ms / step")
        print("   ", {k: f"{1e3 * v:.1f} ms" if not k.endswith("#") else int(v) for k, v in sorted(acc.items())})
        if args.cprofile:
            print_cprofile(llm, pool[:8], params, args.cprofile)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
