"""Where a speculative engine's time goes, by kind of engine step: one configuration per process, the workload of
``spec_vs_none.py`` at one batch size (``2 b`` held-out edit prompts, ``max_num_seqs = b``, so requests join as
others finish), every ``LLMEngine.step`` timed and sorted by what it launched: a prompt chunk (a prefill or a
request joining), or only decodes / verifies.

    python3 benchmarks/step_kinds.py --config "mtp k=3" --batch-size 64 [--max-tokens 128] [--json out.json]
        [--cprofile N] [--sort cumulative|tottime] [--varied-lengths] [--plans] [--no-prefix-caching]

Prints per kind the steps and their total and median wall time; the totals of several
configurations (one process each) show which kind of step a method loses its time in. ``--cprofile N`` runs each
step of the timed pass under cProfile and prints, per kind of step, its N functions of most cumulative host time
(``--sort tottime``: of most own time; the wall times then include the profiler's overhead). ``--plans`` also
groups the steps by how they were planned: queued ahead (Q) or on the host (H); the requests computing an earlier
chunk of their prompt and their last one; whether the drafter drafted behind the step on the device; what
``launch_next`` queued after it; and the host time the proposer drafted in after it (engine/async_scheduler.py,
engine/verify_plan.py). ``--no-prefix-caching``: a joining prompt is then one chunk (with prefix caching a hybrid
target's chunks end at its state checkpoints).
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
    parser.add_argument("--sort", default="cumulative", choices=["cumulative", "tottime"])
    parser.add_argument("--varied-lengths", action="store_true", help="as spec_vs_none.py's")
    parser.add_argument("--plans", action="store_true", help="group the steps by how they were planned")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: float32, async scheduling on (a smoke test)")
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [r["prompt"] for r in rows if r["kind"] == "edit"][:max(2 * args.batch_size, 24)]
    on_cpu = args.device == "cpu"
    sync = (lambda: None) if on_cpu else torch.cuda.synchronize
    extra = {"async_scheduling": True} if on_cpu else {}
    llm = LLM(dtype="float32" if on_cpu else "bfloat16", device=args.device, max_model_len=2048,
              max_num_seqs=args.batch_size, **extra,
              speculative_config=METHODS[args.config], enable_prefix_caching=not args.no_prefix_caching,
              **ENGINE_KWARGS.get(args.config, {}))
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
    plans = PlanLog(engine) if args.plans else None
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    report = {"config": args.config, "batch_size": args.batch_size,
              "device": "cpu" if on_cpu else torch.cuda.get_device_name(), "tok_s": tokens / wall,
              "wall_ms": 1e3 * wall, "kinds": {}}
    print(f"{args.config} BS={args.batch_size}: {tokens / wall:,.0f} tok/s, {1e3 * wall:.1f} ms, {len(steps)} steps")
    for kind, name in ((True, "with a prompt chunk"), (False, "decodes / verifies only")):
        ms = [t for p, t in steps if p == kind]
        if ms:
            report["kinds"][name] = k = {"steps": len(ms), "total_ms": sum(ms), "median_ms": statistics.median(ms)}
            print(f"  {name}: {k['steps']} steps, {k['total_ms']:.1f} ms, median {k['median_ms']:.3f} ms")
    if plans is not None:
        report["plans"] = plans.print()
    for kind, stats in sorted(profiles.items()):
        print(f"\n=== cProfile of the steps {'with a prompt chunk' if kind else 'with decodes / verifies only'}")
        stats.sort_stats(args.sort).print_stats(args.cprofile)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


class PlanLog:
    """Each engine step's plan (see the module docstring), wall time and host drafting time, grouped on ``print``."""

    def __init__(self, engine: object) -> None:
        self.steps: list[dict] = []
        overlap, handoff, runner = engine.overlap, engine.handoff, engine.runner
        step, launch, launch_next, propose = engine.step, runner.launch, overlap.launch_next, handoff.propose
        current: dict = {}

        def count_chunks(sched):  # noqa: ANN001, ANN202
            # the step's own launch is the first; a later one queues the next step (counted when that one runs)
            current.setdefault("earlier", sum(not r.is_last_chunk for r in sched.scheduled))
            current.setdefault("last", sum(r.is_last_chunk and r.num_prompt_rows > 0 for r in sched.scheduled))

        def launched(sched, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            count_chunks(sched)
            return launch(sched, *a, **kw)

        def planned_next(step_launched):  # noqa: ANN001, ANN202
            current["ahead"] = launch_next(step_launched)
            current["drafted"] = step_launched.device_drafts is not None
            return current["ahead"]

        def drafting(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = propose(*a, **kw)
            current["propose_ms"] = 1e3 * (time.perf_counter() - start)
            return out

        def planned_step():  # noqa: ANN202
            queued = overlap.inflight  # a step queued ahead: launched (its chunks counted) by the step before
            current.clear()
            if queued is not None:
                count_chunks(queued.sched)
            start = time.perf_counter()
            out = step()
            if "ahead" in current:  # the step ran (an idle one launches nothing)
                self.steps.append({"queued": queued is not None, "ms": 1e3 * (time.perf_counter() - start),
                                   **current})
            return out

        runner.launch, overlap.launch_next, handoff.propose = launched, planned_next, drafting
        engine.step = planned_step

    def print(self) -> dict[str, dict]:
        groups: dict[str, list[dict]] = {}
        for e in self.steps:
            key = (f"{'Q' if e['queued'] else 'H'} earlier chunks {min(e['earlier'], 2)} last chunks "
                   f"{min(e['last'], 2)} drafted behind {'yes' if e['drafted'] else 'no'}, then {e['ahead']}")
            groups.setdefault(key, []).append(e)
        print("\n  by plan (Q: queued ahead, H: planned on the host; chunk counts capped at 2):")
        report = {}
        for key, es in sorted(groups.items(), key=lambda kv: -sum(e["ms"] for e in kv[1])):
            ms, host = [e["ms"] for e in es], sum(e.get("propose_ms", 0.0) for e in es)
            report[key] = {"steps": len(es), "total_ms": sum(ms), "median_ms": statistics.median(ms),
                           "host_drafting_ms": host}
            print(f"    {key}: {len(es)} steps, {sum(ms):.1f} ms, median {statistics.median(ms):.2f} ms, "
                  f"host drafting {host:.1f} ms")
        return report


if __name__ == "__main__":
    main()
