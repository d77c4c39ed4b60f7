"""Where a speculative engine's time goes, by kind of engine step: one configuration per process, the workload of
``spec_vs_none.py`` at one batch size (``2 b`` held-out edit prompts, ``max_num_seqs = b``, so requests join as
others finish), every ``LLMEngine.step`` timed and sorted by what it launched: a prompt chunk (a prefill or a
request joining), or only decodes / verifies.

    python3 benchmarks/step_kinds.py --config "mtp k=3" --batch-size 64 [--max-tokens 128] [--json out.json]
        [--cprofile N] [--varied-lengths]

Prints per kind the steps and their total and median wall time; the totals of several
configurations (one process each) show which kind of step a method loses its time in. ``--cprofile N`` runs each
step of the timed pass under cProfile and prints, per kind of step, its N functions of most cumulative host time
(the wall times then include the profiler's overhead).
"""

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from spec_vs_none import ENGINE_KWARGS, METHODS, PROMPTS, varied_max_tokens

from truespec import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, choices=list(METHODS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--varied-lengths", action="store_true", help="as spec_vs_none.py's")
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [r["prompt"] for r in rows if r["kind"] == "edit"][:max(2 * args.batch_size, 24)]
    llm = LLM(dtype="bfloat16", device="cuda", max_model_len=2048, max_num_seqs=args.batch_size,
              speculative_config=METHODS[args.config], **ENGINE_KWARGS.get(args.config, {}))
    engine = llm.llm_engine
    lengths = [varied_max_tokens(i, args.max_tokens) if args.varied_lengths else args.max_tokens
               for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    launched_prompt = [False]
    launch, step = engine.runner.launch, engine.step

    def logged_launch(sched, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        launched_prompt[0] |= not sched.is_decode_only
        return launch(sched, *a, **kw)

    steps: list[tuple[bool, float]] = []
    profiles: dict[bool, pstats.Stats] = {}  # by kind: whether the step launched a prompt chunk

    def timed_step():  # noqa: ANN202
        launched_prompt[0] = False
        profiler = cProfile.Profile() if args.cprofile else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        out = step()
        if profiler is not None:
            profiler.disable()
        steps.append((launched_prompt[0], 1e3 * (time.perf_counter() - start)))
        if profiler is not None:
            kind = launched_prompt[0]
            profiles[kind] = profiles[kind].add(profiler) if kind in profiles else pstats.Stats(profiler)
        return out
    engine.runner.launch, engine.step = logged_launch, timed_step
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    report = {"config": args.config, "batch_size": args.batch_size, "device": torch.cuda.get_device_name(),
              "tok_s": tokens / wall, "wall_ms": 1e3 * wall, "kinds": {}}
    print(f"{args.config} BS={args.batch_size}: {tokens / wall:,.0f} tok/s, {1e3 * wall:.1f} ms, {len(steps)} steps")
    for kind, name in ((True, "with a prompt chunk"), (False, "decodes / verifies only")):
        ms = [t for p, t in steps if p == kind]
        if ms:
            report["kinds"][name] = k = {"steps": len(ms), "total_ms": sum(ms), "median_ms": statistics.median(ms)}
            print(f"  {name}: {k['steps']} steps, {k['total_ms']:.1f} ms, median {k['median_ms']:.3f} ms")
    for kind, stats in sorted(profiles.items()):
        print(f"\n=== cProfile of the steps {'with a prompt chunk' if kind else 'with decodes / verifies only'}")
        stats.sort_stats("cumulative").print_stats(args.cprofile)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
