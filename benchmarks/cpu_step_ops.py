"""Where a CPU decode step goes: torch ops (and their CPU time) per engine phase and per layer type, from
torch.profiler over decode steps of the embedded model (float32, one thread).

    python3 benchmarks/cpu_step_ops.py [--batch-size 1] [--input-len 32] [--steps 16] [--top 15]

Phases: ``schedule`` (Scheduler), ``inputs`` (the step's tensors and ForwardContext), ``forward`` (the model, split
into ``embed+rope``, each layer type's layers and the final norm), ``logits`` (the lm_head and everything the runner
queues after it: argmax, the copy to the host), ``collect`` and ``outputs`` (the engine's bookkeeping). An op counts
once, at the top level (an op called inside another op is the caller's cost).
"""

import argparse
import functools
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from truespec import LLM, RequestOutputKind, SamplingParams

PHASES = ("schedule", "inputs", "forward", "logits", "collect", "outputs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(dtype=args.dtype, device="cpu", max_num_seqs=args.batch_size, enable_prefix_caching=False)
    torch.set_num_threads(1)
    engine = llm.llm_engine
    label_phases(engine)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(2):  # the first round warms up
        for _ in range(args.batch_size):
            engine.add_request({"prompt_token_ids": torch.randint(16, 2000, (args.input_len,), generator=gen).tolist()},
                               params)
        engine.step()  # the prefill
        engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    report(prof, args)


def label_phases(engine: object) -> None:
    """Wrap the step's phases and every decoder layer in record_function regions."""
    runner = engine.runner
    model = runner.model
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(runner, "collect", "collect")
    wrap(engine, "_update", "outputs")
    graphs = runner.graphs
    wrap(graphs, "run", "inputs+forward")
    import truespec.worker.graph_runner as gr

    gr.build_step = labelled(gr.build_step, "inputs")
    wrap(model, "forward", "forward")
    wrap(model, "compute_logits", "logits")
    for layer in model.model.layers:
        wrap(layer, "forward", f"layer:{layer.layer_type}")
    wrap(model.model.norm, "add_norm", "final norm")


def wrap(obj: object, name: str, label: str) -> None:
    setattr(obj, name, labelled(getattr(obj, name), label))


def labelled(fn: object, label: str) -> object:
    @functools.wraps(fn)
    def run(*a: object, **k: object) -> object:
        with record_function(f"## {label}"):
            return fn(*a, **k)
    return run


def report(prof: profile, args: argparse.Namespace) -> None:
    events = prof.events()
    by_region: Counter[str] = Counter()
    us_region: Counter[str] = Counter()
    by_op: dict[str, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e.name.startswith("## "):
            continue
        parent, regions = e.cpu_parent, []
        is_top = True
        while parent is not None:
            if parent.name.startswith("## "):
                regions.append(parent.name[3:])
            else:
                is_top = False
            parent = parent.cpu_parent
        if not is_top:
            continue
        region = regions[0] if regions else "other"
        by_region[region] += 1
        us_region[region] += e.cpu_time_total
        by_op[region][e.name] += 1
    steps = args.steps
    print(f"BS {args.batch_size}, {args.input_len}-token prompts, {steps} decode steps: top-level ops per step "
          f"{sum(by_region.values()) / steps:.0f}\n")
    print("| region | ops per step | op CPU us per step |\n|---|---:|---:|")
    for region, n in sorted(by_region.items(), key=lambda x: -x[1]):
        print(f"| {region} | {n / steps:.1f} | {us_region[region] / steps:.0f} |")
    for region in sorted(by_op, key=lambda r: -by_region[r]):
        top = ", ".join(f"{op} {n / steps:.1f}" for op, n in by_op[region].most_common(args.top))
        print(f"\n{region}: {top}")
    total = [e for e in events if e.name.startswith("## ") and e.name[3:] in ("schedule", "inputs+forward", "logits",
                                                                                "collect", "outputs")]
    wall = Counter()
    for e in total:
        wall[e.name[3:]] += e.cpu_time_total
    print("\nphase CPU time per step (us, profiler overhead included):",
          ", ".join(f"{k} {v / steps:.0f}" for k, v in wall.items()))


if __name__ == "__main__":
    main()
