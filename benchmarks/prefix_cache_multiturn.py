"""Prefix caching on a multi-turn chat workload (issue 16, "Measure"): hit rate, TTFT, output tok/s and TPOT with and
without the cache, the state checkpoints' memory, and the hit rate at several checkpoint intervals, all measured in
this one process on one card.

    python3 benchmarks/prefix_cache_multiturn.py --model /tmp/qwen35-0.8b-shape [--conversations 32] [--turns 6]
        [--system-len 2048] [--user-len 136] [--max-tokens 64] [--intervals 512 1024] [--json FILE]
    python3 benchmarks/prefix_cache_multiturn.py --device cpu --conversations 2 --turns 3 --system-len 64 \\
        --user-len 16 --max-tokens 8 --intervals 16 32   # a quick check with the embedded model

Workload: every conversation starts with the same ``--system-len`` random-id system prompt; turn t's prompt is the
previous turn's prompt, its output, and ``--user-len`` new random ids (so a turn adds ``--user-len + --max-tokens``
tokens: ~200 by default). Turns are replayed in rounds: round t sends turn t of every conversation at once (greedy,
ignore_eos), so TTFT includes queueing behind the round's other prompts, with and without the cache alike.
*Cacheable* tokens of a request are those an earlier request (an earlier round, or earlier in its round) computed:
the previous turn's prompt and output but its last token, or the system prompt. Reported per run: hit rate over all
prompt tokens and over the cacheable ones, mean / p99 TTFT (all turns and the last turn), output tok/s (all rounds'
output tokens over their wall time), mean TPOT, whether every output equals the run without the cache, and the
checkpoint pool (slots, bytes, checkpoints held at the end). One engine per run, one after the other.
"""

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from truespec import LLM, SamplingParams
from truespec.entrypoints.bench import device_name


def conversation_ids(vocab_size: int, special: list[int], n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in special if 0 <= i < vocab_size]] = False
    ids = allowed.nonzero().squeeze(1)
    return ids[torch.randint(len(ids), (n,), generator=gen)].tolist()


def replay(llm: LLM, args: argparse.Namespace) -> dict[str, object]:
    """The workload's rounds on ``llm``; per-request measurements and the engine's counters."""
    vocab, special = llm.llm_engine.vocab_size, llm.get_tokenizer().all_special_ids
    system = conversation_ids(vocab, special, args.system_len, args.seed)
    users = [[conversation_ids(vocab, special, args.user_len, args.seed + 1 + c * args.turns + t)
              for t in range(args.turns)] for c in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": conversation_ids(vocab, special, 32, 99)}], params, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    history = [list(system) for _ in range(args.conversations)]  # each conversation's tokens so far
    seen: list[list[int]] = []  # tokens earlier requests computed
    before = llm.get_metrics()
    rows, elapsed, outputs = [], 0.0, []
    for t in range(args.turns):
        prompts = [history[c] + users[c][t] for c in range(args.conversations)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        for c, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            tokens = out.outputs[0].token_ids
            cacheable = max((_common_prefix(prompt, s) for s in seen), default=0)
            rows.append({"turn": t + 1, "conversation": c, "prompt_len": len(prompt), "cacheable": min(
                cacheable, len(prompt) - 1), "cached": out.num_cached_tokens, "ttft": out.metrics.time_to_first_token,
                "tpot": out.metrics.time_per_output_token, "output_len": len(tokens)})
            seen.append(prompt + tokens[:-1])
            history[c] = prompt + tokens
            outputs.append(tokens)
    after = llm.get_metrics()
    return {"rows": rows, "elapsed": elapsed, "outputs": outputs,
            "queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
            "hits": after["prefix_cache_hits"] - before["prefix_cache_hits"], "cache_info": llm.cache_info()}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def summarize(name: str, run: dict, baseline: dict | None) -> dict[str, object]:
    rows, info = run["rows"], run["cache_info"]
    last = [r for r in rows if r["turn"] == max(r["turn"] for r in rows)]
    ttfts, last_ttfts = [r["ttft"] for r in rows], [r["ttft"] for r in last]
    tpots = [r["tpot"] for r in rows if r["tpot"] is not None]
    cacheable = sum(r["cacheable"] for r in rows)
    return {
        "run": name, "hit_rate": run["hits"] / run["queries"] if run["queries"] else 0.0,
        "hit_rate_of_cacheable": sum(r["cached"] for r in rows) / cacheable if cacheable else 0.0,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "ttft_p99_ms": 1e3 * _p99(ttfts),
        "ttft_last_turn_mean_ms": 1e3 * statistics.fmean(last_ttfts),
        "output_tok_s": sum(r["output_len"] for r in rows) / run["elapsed"],
        "tpot_mean_ms": 1e3 * statistics.fmean(tpots) if tpots else None,
        "identical_to_no_cache": None if baseline is None else run["outputs"] == baseline["outputs"],
        "checkpoint_slots": info["num_prefix_state_slots"], "checkpoints_held": info["num_prefix_state_checkpoints"],
        "checkpoint_mib": info["num_prefix_state_slots"] * info["state_bytes_per_slot"] / 2**20,
        "state_mib_per_checkpoint": info["state_bytes_per_slot"] / 2**20,
        "kv_pool_mib": info["num_blocks"] * info["block_size"] * info["kv_bytes_per_token"] / 2**20,
        "interval": run.get("interval"),
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run_engine(args: argparse.Namespace, **kwargs: object) -> dict:
    max_model_len = args.system_len + args.turns * (args.user_len + args.max_tokens) + 16
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=max_model_len,
              max_num_seqs=args.conversations, **kwargs)
    run = replay(llm, args)
    run["interval"] = llm.llm_engine.kv.prefix.checkpoint_interval if llm.llm_engine.kv.prefix else None
    run["device"] = device_name(llm.llm_engine.device)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return run


def format_table(results: list[dict]) -> str:
    head = ("| run | interval | hit rate | of cacheable | TTFT mean ms | TTFT p99 ms | TTFT last turn ms "
            "| output tok/s | TPOT ms | same tokens | checkpoint slots | held | checkpoint MiB | KV pool MiB |")
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for r in results:
        tpot = f"{r['tpot_mean_ms']:.2f}" if r["tpot_mean_ms"] is not None else "-"
        lines.append(f"| {r['run']} | {r['interval'] or '-'} | {r['hit_rate']:.3f} | {r['hit_rate_of_cacheable']:.3f} "
                     f"| {r['ttft_mean_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['ttft_last_turn_mean_ms']:.1f} | "
                     f"{r['output_tok_s']:.1f} | {tpot} | {r['identical_to_no_cache']} | {r['checkpoint_slots']} | "
                     f"{r['checkpoints_held']} | {r['checkpoint_mib']:.1f} | {r['kv_pool_mib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--user-len", type=int, default=136, help="new user tokens per turn")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per turn")
    parser.add_argument("--intervals", type=int, nargs="*", default=[512, 1024],
                        help="more prefix_state_interval settings for the hit-rate sweep (hybrid models; the default "
                             "run's interval, 2048 on the 0.8B shape, is the third)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        from truespec.assets import DEFAULT_MODEL_DIR

        args.model = str(DEFAULT_MODEL_DIR)
    baseline = run_engine(args, enable_prefix_caching=False)
    results = [summarize("no cache", baseline, None)]
    cached = run_engine(args, enable_prefix_caching=True)
    results.append(summarize("cache (default interval)", cached, baseline))
    for interval in [i for i in args.intervals if i != cached["interval"]] if cached["interval"] is not None else []:
        run = run_engine(args, enable_prefix_caching=True, prefix_state_interval=interval)
        results.append(summarize(f"cache, interval {interval}", run, baseline))
    speedup = results[0]["ttft_last_turn_mean_ms"] / results[1]["ttft_last_turn_mean_ms"]
    tpot = (results[1]["tpot_mean_ms"] / results[0]["tpot_mean_ms"] - 1) if results[0]["tpot_mean_ms"] else None
    print(f"device: {baseline['device']}; {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system_len}, +{args.user_len} user +{args.max_tokens} output tokens per turn")
    print(format_table(results))
    print(f"last-turn TTFT speedup {speedup:.2f}x; TPOT change {100 * tpot:+.1f}%" if tpot is not None else "")
    if args.json is not None:
        report = {"device": baseline["device"], "args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                  "per_request": {"no cache": baseline["rows"], "cache": cached["rows"]}}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
