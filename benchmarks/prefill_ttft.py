"""Time to first token of long prompts, and what a long prompt does to the requests already decoding (issue 17).

    python3 benchmarks/prefill_ttft.py --model /tmp/qwen35-0.8b-shape [--prompts 512 8192 32768] [--batch-sizes 1 8]
        [--stall 32768] [--json FILE]

TTFT: per (prompt length, batch size), ``batch size`` distinct random-id prompts sent at once, one output token each
(greedy, prefix caching off, the engine's default chunk budget; ``--warmups`` untimed runs, then ``--repeats`` timed
ones, the median by wall time reported); the mean TTFT of the batch, the batch's wall time
and the prefill FLOP/s it achieved (2 x non-embedding parameters per prompt token, the lm_head once per request,
plus 2 x 2 x heads x head_dim x L^2 / 2 per attention layer: causal QK^T and PV).

Stall (``--stall L``): 8 requests decode (64-token prompts, 512 tokens each); once each has 32 tokens an L-token
prompt arrives. Reported: the decoding requests' inter-token gaps before it arrived and while it was prefilled
(p50 / p99 / max ms), and its TTFT; ``--stall-runs N`` repeats it (each run reported). ``--log-compiles``: the Triton
kernels compiled (or loaded from the disk cache) in each phase, with the seconds each took: a kernel first compiled
inside a measured phase is a stall a user meets too. Markdown tables last.
"""

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from truespec import LLM, SamplingParams


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(100, vocab_size - 100, (length,), generator=gen).tolist()}
            for _ in range(n)]  # fmt: skip


def prefill_flops(llm: LLM, length: int) -> float:
    """FLOPs of one prompt's prefill (the module docstring's count)."""
    model = llm.llm_engine.runner.model
    cfg = getattr(llm.llm_engine.hf_config, "text_config", llm.llm_engine.hf_config)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
    lm_head = cfg.vocab_size * cfg.hidden_size
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    num_attn = sum(t == "full_attention" for t in layer_types)
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    return 2 * params * length + 2 * lm_head + num_attn * 2 * cfg.num_attention_heads * head_dim * length * length


class CompileLog:
    """Triton's JIT hooks: (kernel name, seconds) per phase for every kernel specialisation compiled in-process."""

    def __init__(self) -> None:
        from triton import knobs

        self.phase, self.started, self.by_phase = "start-up", {}, defaultdict(list)
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *, fn, **_: object) -> None:  # returns None: Triton goes on to compile
        self.started[fn.name] = time.perf_counter()

    def _after(self, *, fn, **_: object) -> None:
        now = time.perf_counter()
        self.by_phase[self.phase].append((fn.name, now - self.started.pop(fn.name, now)))

    def report(self) -> str:
        if not self.by_phase:
            return "no Triton kernel compiled after start-up"
        return "\n".join(f"compiled during {phase}: " + ", ".join(f"{n} {t:.2f} s" for n, t in items)
                         for phase, items in self.by_phase.items())  # fmt: skip


def ttft(llm: LLM, length: int, batch_size: int, vocab_size: int, repeats: int = 1, warmups: int = 1
         ) -> dict[str, float]:  # fmt: skip
    """The run with the median batch wall time of ``repeats`` (distinct prompts each), after ``warmups`` runs."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(warmups):
        llm.generate(random_prompts(vocab_size, batch_size, length, seed=1 + i), params, use_tqdm=False)
    runs = []
    for i in range(repeats):
        prompts = random_prompts(vocab_size, batch_size, length, seed=length + batch_size + 1000 * i)
        sync()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync()
        runs.append((time.perf_counter() - start, statistics.mean(o.metrics.time_to_first_token for o in outs)))
    wall, first = sorted(runs)[len(runs) // 2]
    flops = batch_size * prefill_flops(llm, length)
    return {"ttft_ms": 1e3 * first, "wall_ms": 1e3 * wall, "prefill_tok_s": batch_size * length / wall,
            "tflops": flops / wall / 1e12, "all_wall_ms": [round(1e3 * w, 2) for w, _ in runs]}  # fmt: skip


def stall(llm: LLM, length: int, vocab_size: int) -> dict[str, float]:
    engine = llm.llm_engine
    decode = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    ids = [engine.add_request(p, decode) for p in random_prompts(vocab_size, 8, 64, seed=7)]
    times: dict[str, list[float]] = {i: [] for i in ids}
    arrival = first = None
    long_id = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in times:
                times[out.request_id] = list(out.metrics.token_times)
            elif out.request_id == long_id and first is None and out.outputs[0].token_ids:
                first = time.monotonic()
        if long_id is None and min(len(t) for t in times.values()) >= 32:
            arrival = time.monotonic()
            long_id = engine.add_request(random_prompts(vocab_size, 1, length, seed=9)[0],
                                         SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))  # fmt: skip
        if first is not None:
            for i in ids:
                engine.abort_request(i)
    before, during = [], []
    for t in times.values():
        for a, b in zip(t, t[1:], strict=False):
            (during if arrival <= b <= first else before if b < arrival else []).append(1e3 * (b - a))

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    return {"ttft_ms": 1e3 * (first - arrival), "before_p50": q(before, 0.5), "before_p99": q(before, 0.99),
            "during_p50": q(during, 0.5), "during_p99": q(during, 0.99), "during_max": max(during, default=0.0),
            "num_during": len(during)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 8192, 32768])
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per row (the median is reported)")
    parser.add_argument("--warmups", type=int, default=4, help="untimed runs per row first (a process's first "
                        "long prefills ran up to 2x slower on the H200 for 4-6 runs: BENCHMARKS.md, session 25)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--stall", type=int, default=None, help="prompt length that arrives while 8 requests decode")
    parser.add_argument("--stall-runs", type=int, default=1, help="times the stall runs (each reported)")
    parser.add_argument("--log-compiles", action="store_true", help="list Triton kernels compiled in each phase")
    parser.add_argument("--label", default="")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None,
                        help="the engine setting (default: the engine's; 0 = never cap a prompt's chunk)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    max_model_len = max(args.prompts + [args.stall or 0]) + 600
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=max_model_len,
              max_num_seqs=max(args.batch_sizes + [9]), enable_prefix_caching=False,
              long_prefill_token_threshold=args.long_prefill_token_threshold)  # fmt: skip
    vocab = llm.llm_engine.vocab_size
    log = CompileLog() if args.log_compiles else None
    rows = {}
    for p in args.prompts:
        for b in args.batch_sizes:
            if log:
                log.phase = f"TTFT {p}/{b}"
            rows[f"{p}/{b}"] = ttft(llm, p, b, vocab, args.repeats, args.warmups)
    stalls = []
    for i in range(args.stall_runs if args.stall else 0):
        if log:
            log.phase = f"stall run {i + 1}"
        stalls.append(stall(llm, args.stall, vocab))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{device} {args.label}: TTFT of random prompts ({args.dtype}, prefix caching off)")
    print("| prompt | BS | TTFT ms | batch wall ms | prefill tok/s | TFLOP/s |\n|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        p, b = key.split("/")
        print(f"| {p} | {b} | {r['ttft_ms']:.1f} | {r['wall_ms']:.1f} | {r['prefill_tok_s']:,.0f} | "
              f"{r['tflops']:.1f} |")
    for i, st in enumerate(stalls):
        print(f"\n{args.stall}-token prompt arriving while 8 requests decode (run {i + 1}): its TTFT "
              f"{st['ttft_ms']:.0f} ms; decode gaps before p50/p99 {st['before_p50']:.2f}/{st['before_p99']:.2f} ms, "
              f"during p50/p99/max {st['during_p50']:.2f}/{st['during_p99']:.2f}/{st['during_max']:.2f} ms")
    if log:
        print("\n" + log.report())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "label": args.label, "ttft": rows, "stall": stalls}, f, indent=2)


if __name__ == "__main__":
    main()
