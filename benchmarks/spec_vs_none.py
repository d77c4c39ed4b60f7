"""Speculation vs none at several concurrencies, on held-out prompts of one kind (edits by default): output tok/s,
TTFT, TPOT and the mean acceptance length per method and batch size, with the speedup over no speculation measured
in the same process on the same card.

    python3 benchmarks/spec_vs_none.py [--batch-sizes 1 4 16 64] [--kind edit] [--max-tokens 128]
        [--methods none "ngram k=8" "mtp k=3" "mtp k=3 host-planned" "mtp k=3 no drafts" ...] [--json FILE]
        [--no-batch-invariant]
        [--governors default auto off] [--interleave R] [--varied-lengths]

At batch size b the engine runs ``max(2 b, --min-prompts)`` prompts with ``max_num_seqs = b`` (so b requests
decode together, new ones joining as others finish); greedy, ignore_eos. One engine per method (and per
``--governors`` value: the speculation governor, spec_decode/governor.py; "default" leaves the key out); each
(method, b) first runs all its prompts once untimed (the governor measures in that run too). With ``--interleave R``
all engines are built first and measured in turn, R rounds per batch size, each reporting its median run: the host's
speed drifts between runs and processes (session 16: "none" alone 12,990 tok/s at BS 16, after another engine in one
process 20,999), and alternating cancels slow drift; ``x_none_paired`` (printed as "paired") is the median over
rounds of each run over the same round's "none" run. With a governor ("auto" methods), each JSON row also has
``governor_steps``: per mode, the steps the governor counted and those it did not (prefill chunks, mode switches),
with their request-seconds and tokens per request-second, to check its estimates against where the time went.
``--varied-lengths``: request i generates ``varied_max_tokens(i, --max-tokens)`` tokens (from half to 1.5x
``--max-tokens``, the same for every method) instead of all ``--max-tokens``: without speculation a batch then no
longer finishes in one step (with it, requests finish one by one anyway, as their acceptance differs), so both sides
pay for requests joining (BENCHMARKS.md, session 18: with equal lengths MTP at BS 64 spent 59% of its time in the
steps where a request joins, "none" admitted its prompts in 4 steps).
Prints a markdown table last.
"""

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_DIR

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout.jsonl"
METHODS = {
    "none": None,
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "eagle k=3": {"method": "eagle", "num_speculative_tokens": 3, "model": str(DEFAULT_EAGLE_DIR)},
    "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(DEFAULT_DRAFT_MODEL_DIR)},
}
# MTP / EAGLE verifies are queued ahead and drafted on the device by default; "host-planned": each step planned
# after the previous one's read (async_scheduling=False, as every speculative step was before session 15)
METHODS |= {f"{name} host-planned": METHODS[name] for name in ("mtp k=3", "eagle k=3")}
ENGINE_KWARGS = {f"{name} host-planned": {"async_scheduling": False} for name in ("mtp k=3", "eagle k=3")}
# speculative_config key draft_on_device: "ngram k=8 on device" drafts on the device behind each step, its verifies
# queued ahead (ngram's default drafts on the host after each step's read); "draft_model k=3 on the host" drafts on
# the host (a draft model's default, since session 19, drafts on the device)
METHODS["ngram k=8 on device"] = METHODS["ngram k=8"] | {"draft_on_device": True}
METHODS["draft_model k=3 on the host"] = METHODS["draft_model k=3"] | {"draft_on_device": False}
# "no drafts": disable_by_batch_size 1, so no step drafts: what a step the governor turns off costs each method;
# "auto": the speculation governor on (spec_decode/governor.py)
METHODS |= {f"{name} {variant}": METHODS[name] | extra for name in ("ngram k=8", "mtp k=3", "eagle k=3",
                                                                       "draft_model k=3")
            for variant, extra in (("no drafts", {"disable_by_batch_size": 1}), ("auto", {"governor": "auto"}))}


class StepLog:
    """Every step the governor hears of in the timed run, by its mode (drafting or not) and whether the governor
    counted it as a decode / verify sample (steps beside a mode switch or in another bucket are not; steps with a
    prompt chunk show as uncounted here, though the governor counts them apart, as joins): request-seconds, tokens
    and steps. Tells whether a mode's counted rate is its real one (session 16: MTP's drafting estimate was
    3.3x too high at BS 64)."""

    def __init__(self, llm: LLM) -> None:
        self.governor = governor = llm.llm_engine.governor
        self.totals: dict[str, list[float]] = {}
        self.learned = False
        observe, learn = governor.observe_step, governor._learn

        def logged_learn(*args: object) -> None:
            self.learned = True
            learn(*args)

        def logged_observe(num_tokens: int, num_requests: int, is_decode_only: bool) -> None:
            last, cur, self.learned = governor._last_end, governor._cur, False
            observe(num_tokens, num_requests, is_decode_only)
            # a step whose interval began before the timed run (the gap since the previous run) is left out
            if self.enabled and last is not None and last >= self.start and cur is not None:
                key = f"{'drafting' if cur[1] else 'not_drafting'} {'counted' if self.learned else 'uncounted'}"
                row = self.totals.setdefault(key, [0.0, 0, 0])
                row[0] += num_requests * (governor._last_end - last)
                row[1] += num_tokens
                row[2] += 1

        governor._learn, governor.observe_step = logged_learn, logged_observe
        self.enabled, self.start = False, 0.0

    def summary(self) -> dict[str, dict[str, float]]:
        return {key: {"steps": n, "tokens_per_request_s": tokens / seconds if seconds else None,
                      "request_seconds": seconds} for key, (seconds, tokens, n) in sorted(self.totals.items())}


_step_logs: dict[int, StepLog] = {}


def step_log(llm: LLM) -> StepLog | None:
    """The engine's StepLog (one per engine: it wraps the governor's methods once); None without a governor."""
    if llm.llm_engine.governor is None:
        return None
    if id(llm) not in _step_logs:
        _step_logs[id(llm)] = StepLog(llm)
    return _step_logs[id(llm)]


class GCTimer:
    """Time spent in Python's cyclic garbage collector (every generation) since ``reset``."""

    def __init__(self) -> None:
        self.ms, self.runs, self._start = 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._on_gc)

    def reset(self) -> None:
        self.ms, self.runs = 0.0, [0, 0, 0]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += 1e3 * (time.perf_counter() - self._start)
            self.runs[info["generation"]] += 1


gc_timer = GCTimer()


def varied_max_tokens(i: int, max_tokens: int) -> int:
    """Request i's output length with ``--varied-lengths``: spread over [max_tokens / 2, 3 max_tokens / 2] by a fixed
    stride (37 of 101 steps), so that neighbours in the prompt list differ and the mean stays ~``max_tokens``."""
    return max_tokens // 2 + (i * 37 % 101) * max_tokens // 100


def measure(llm: LLM, prompts: list[str], batch_size: int, max_tokens: int,
            warm_up: bool = True, varied: bool = False) -> dict[str, float | None]:
    engine = llm.llm_engine
    engine.scheduler.max_num_seqs = batch_size  # a benchmark-only knob: the concurrency of this run
    lengths = [varied_max_tokens(i, max_tokens) if varied else max_tokens for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    # warm-up: every prompt once, so that no kernel specialisation for a new length compiles inside the timed run
    # (a warm-up of one prompt left the first engine's BS 1 run at 1,029 vs 2,151 tok/s in two calls: session 12)
    if warm_up:
        llm.generate(prompts, params, use_tqdm=False)
    before = llm.get_metrics()
    llm.reset_prefix_cache()  # the warm-up's prompts would skip their prefill
    log = step_log(llm)
    if log is not None:
        log.totals, log.enabled = {}, True
    torch.cuda.synchronize()
    gc_timer.reset()
    start = time.perf_counter()
    if log is not None:
        log.start = start
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    gc_ms, gc_runs = gc_timer.ms, gc_timer.runs
    if log is not None:
        log.enabled = False
    after = llm.get_metrics()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    tpots = [o.metrics.time_per_output_token for o in outs if o.metrics.time_per_output_token is not None]
    steps = after["num_steps"] - before["num_steps"]
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "ttft_ms": 1e3 * sum(o.metrics.time_to_first_token for o in outs) / len(outs),
            "tpot_ms": 1e3 * sum(tpots) / len(tpots), "accept_len": 1 + accepted / drafts if drafts else None,
            "steps_without_drafts": (after["num_steps_without_drafts"] - before["num_steps_without_drafts"]) / steps
            if steps else None,
            "steps_drafting_off": (after["num_steps_drafting_off"] - before["num_steps_drafting_off"]) / steps
            if steps else None, "governor_drafting": after["governor_drafting"],
            "governor_rates": after["governor_rates"], "gc_ms": gc_ms, "gc_runs": gc_runs,
            "governor_steps": log.summary() if log is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--kind", default="edit")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-prompts", type=int, default=24)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--governors", nargs="+", default=["default"], choices=["default", "auto", "off"])
    parser.add_argument("--interleave", type=int, default=0, metavar="R",
                        help="build every engine first, then measure them in turn R times per batch size and report "
                             "each one's median run (the host's speed drifts between runs: session 16)")
    parser.add_argument("--varied-lengths", action="store_true",
                        help="output lengths from half to 1.5x --max-tokens per request (requests finish one by one)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once the engines are built: the collector no longer walks their objects")
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    pool = [r["prompt"] for r in rows if r["kind"] == args.kind]
    results: dict[str, dict[int, dict]] = {}
    runs = [(name, g) for name in args.methods for g in (args.governors if METHODS[name] else ["default"])]

    def make(method: str, governor: str) -> tuple[str, LLM]:
        spec = METHODS[method] if governor == "default" else METHODS[method] | {"governor": governor}
        name = method if governor == "default" else f"{method} governor={governor}"
        # interleaved engines live side by side: a fixed pool (each request's 2048 positions, every sequence)
        blocks = {"num_gpu_blocks_override": max(args.batch_sizes) * 130} if args.interleave else {}
        llm = LLM(dtype=args.dtype, device="cuda", max_model_len=2048, max_num_seqs=max(args.batch_sizes),
                  speculative_config=spec, batch_invariant=args.batch_invariant, **ENGINE_KWARGS.get(method, {}),
                  **blocks)
        return name, llm

    if args.interleave:
        engines = dict(make(method, governor) for method, governor in runs)
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        for b in args.batch_sizes:
            prompts = pool[:max(2 * b, args.min_prompts)]
            samples: dict[str, list[dict]] = {name: [] for name in engines}
            for rep in range(args.interleave):
                for name, llm in engines.items():
                    samples[name].append(measure(llm, prompts, b, args.max_tokens, warm_up=rep == 0,
                                                 varied=args.varied_lengths))
            for name, runs_of in samples.items():
                ranked = sorted(runs_of, key=lambda r: r["tok_s"])
                results.setdefault(name, {})[b] = r = ranked[len(ranked) // 2] | {
                    "tok_s_runs": [x["tok_s"] for x in runs_of], "gc_ms_runs": [x["gc_ms"] for x in runs_of]}
                if "none" in samples:  # each round's run over that round's "none" (the rounds' drift cancels)
                    paired = [x["tok_s"] / n["tok_s"] for x, n in zip(runs_of, samples["none"], strict=True)]
                    r["x_none_paired"] = sorted(paired)[len(paired) // 2]
                print(f"{name} BS={b}: {r}", flush=True)
    for method, governor in runs if not args.interleave else []:
        name, llm = make(method, governor)
        results[name] = {}
        for b in args.batch_sizes:
            results[name][b] = r = measure(llm, pool[:max(2 * b, args.min_prompts)], b, args.max_tokens,
                                           varied=args.varied_lengths)
            print(f"{name} BS={b}: {r}", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, embedded model, {args.dtype}, CUDA graphs, {args.kind} prompts, "
          f"{args.max_tokens} tokens{' (varied lengths)' if args.varied_lengths else ''}, "
          f"batch_invariant={args.batch_invariant}; tok/s (x none) [accept len] "
          "TTFT / TPOT ms")
    print("| method | " + " | ".join(f"BS={b}" for b in args.batch_sizes) + " |")
    print("|---|" + "---:|" * len(args.batch_sizes))
    for name, by_bs in results.items():
        cells = []
        for b, r in by_bs.items():
            base = results.get("none", {}).get(b)
            paired = f", paired {r['x_none_paired']:.2f}x" if "x_none_paired" in r else ""
            ratio = f" ({r['tok_s'] / base['tok_s']:.2f}x{paired})" if base else ""
            acc = f" [{r['accept_len']:.2f}]" if r["accept_len"] else ""
            cells.append(f"{r['tok_s']:,.0f}{ratio}{acc} {r['ttft_ms']:.1f} / {r['tpot_ms']:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(args) | {"json": None},
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
