"""``truespec bench``: offline throughput and per-step latency of one engine configuration (vLLM's
``bench throughput`` and ``bench latency`` in one command).

One ``LLM`` serves every batch size. Per batch size: the batch (random prompt token ids, or the first prompts
of ``--prompts-file``), one warm-up ``generate``, then ``--num-iters`` timed ones, greedy with ``ignore_eos``
so every request decodes exactly ``--output-len`` tokens. Reported: output tokens/s, time per output step
(wall time / output length: the batch advances one step per output token without speculation), the mean time to
first token (TTFT: from the request's arrival, so it includes the batch's prefill) and time per output token after
the first (TPOT), from each request's timestamps, and, when speculating, the mean acceptance length. A markdown
table comes last; ``--json`` writes every number.

    truespec bench --model DIR --dtype bfloat16 --batch-sizes 1 8 64 --input-len 512 --output-len 256
    python3 -m truespec.entrypoints.bench ...   (the same, without the CLI)
"""

import argparse
import gc
import json
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from truespec.config import CUDAGRAPH_MODES, DTYPES
from truespec.entrypoints.arg_types import (
    add_prefix_caching_args,
    add_sparse_v_args,
    at_least,
    prefix_caching_kwargs,
    sparse_v_kwargs,
    writable_path,
)
from truespec.entrypoints.errors import run_command
from truespec.entrypoints.prompts_file import PROMPT_KEYS, load_rows
from truespec.entrypoints.verify import json_object
from truespec.llm import LLM
from truespec.sampling_params import SamplingParams

PROMPT_KINDS = ("edit", "completion", "chat")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="output tokens/s and time per step at several batch sizes")
    add_bench_args(parser)
    parser.set_defaults(run=main)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=at_least(1), default=128, help="prompt length (random prompts)")
    parser.add_argument("--output-len", type=at_least(1), default=64)
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help='JSON Lines with a "prompt" (or "prompt_token_ids") key: real prompts instead of '
                             "random token ids")
    parser.add_argument("--kind", choices=PROMPT_KINDS, default=None, help="only --prompts-file rows of this kind")
    parser.add_argument("--speculative-config", type=_json_arg, default=None,
                        help='as JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--compare-no-spec", action="store_true",
                        help="also run the same batches without speculation (a second engine, after the first) and "
                             "print both side by side")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache storage (default auto: the model dtype)")
    add_sparse_v_args(parser)
    add_prefix_caching_args(parser)
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="cuBLAS / skinny projections instead of the batch-invariant kernel (to measure its cost)")
    parser.add_argument("--num-iters", type=at_least(1), default=1, help="timed generate calls per batch size")
    parser.add_argument("--warmup", type=at_least(0), default=1, help="untimed generate calls per batch size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt ids")
    parser.add_argument("--json", type=writable_path, default=None, help="write the results here")


def main(args: argparse.Namespace) -> int:
    if args.compare_no_spec and args.speculative_config is None:
        raise ValueError("--compare-no-spec needs --speculative-config (the configuration to compare)")
    file_prompts = None if args.prompts_file is None else load_file_prompts(args.prompts_file, args.kind)
    rows, device = run_engine(args, engine_kwargs(args), file_prompts)
    print(format_table(rows, args.speculative_config is not None))  # first: the JSON may fail
    report = {"device": device, "torch": torch.__version__, "args": _jsonable(vars(args)), "results": rows}
    if args.compare_no_spec:
        report["no_spec_results"], _ = run_engine(args, engine_kwargs(args) | {"speculative_config": None},
                                                  file_prompts)
        print("\nwithout speculation:\n" + format_table(report["no_spec_results"], False))
        print("\n" + format_comparison(rows, report["no_spec_results"]))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run_engine(args: argparse.Namespace, kwargs: dict[str, object],
               file_prompts: list[dict] | None) -> tuple[list[dict], str]:
    """One engine's rows for every batch size, and its device's name; the engine is gone when this returns."""
    llm = LLM(**kwargs)
    rows = [bench_batch(llm, batch_prompts(llm, args, n, file_prompts), args) for n in args.batch_sizes]
    device = device_name(llm.llm_engine.device)
    del llm
    gc.collect()  # its KV pool, before another engine takes the device
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, device


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    kwargs: dict[str, object] = dict(model=args.model, dtype=args.dtype, device=args.device,
                                     max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     speculative_config=args.speculative_config)
    if args.enforce_eager:  # only when asked, so the command runs on engines without the knob
        kwargs["enforce_eager"] = True
    if not args.batch_invariant:  # only when asked, as enforce_eager
        kwargs["batch_invariant"] = False
    if args.cudagraph_mode is not None:
        kwargs["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    if args.kv_cache_dtype != "auto":  # only when asked, as enforce_eager
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    return kwargs | sparse_v_kwargs(args) | prefix_caching_kwargs(args)


def batch_prompts(llm: LLM, args: argparse.Namespace, batch_size: int,
                  file_prompts: list[dict] | None = None) -> list[dict]:
    if file_prompts is None:
        special = llm.get_tokenizer().all_special_ids
        return random_prompts(llm.llm_engine.hf_config.vocab_size, special, batch_size, args.input_len, args.seed)
    return [file_prompts[i % len(file_prompts)] for i in range(batch_size)]  # repeats when the file is short


def load_file_prompts(path: Path, kind: str | None) -> list[dict]:
    """The prompts of ``path`` (of ``kind`` if given), before the engine loads, so a bad file fails fast."""
    rows = [r for r in load_rows(path) if kind is None or r.get("kind") == kind]
    if not rows:
        raise ValueError(f"no prompts{'' if kind is None else f' of kind {kind!r}'} in {path}")
    return [{k: v for k, v in r.items() if k in PROMPT_KEYS} for r in rows]


def random_prompts(vocab_size: int, special_ids: Iterable[int], batch_size: int, input_len: int,
                   seed: int) -> list[dict]:
    """``batch_size`` prompts of ``input_len`` ids drawn uniformly from the vocabulary without special ids;
    the same seed gives the same prompts in every engine."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in special_ids if 0 <= i < vocab_size]] = False
    ids = allowed.nonzero().squeeze(1)
    gen = torch.Generator().manual_seed(seed)
    picks = ids[torch.randint(len(ids), (batch_size, input_len), generator=gen)]  # [batch_size, input_len]
    return [{"prompt_token_ids": row.tolist()} for row in picks]


def bench_batch(llm: LLM, prompts: list[dict], args: argparse.Namespace) -> dict[str, object]:
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for _ in range(args.warmup):
        llm.generate(prompts, params, use_tqdm=False)
    before = llm.get_metrics()
    times, ttfts, tpots, num_output_tokens, num_prompt_tokens = [], [], [], 0, 0
    for _ in range(args.num_iters):
        outputs, elapsed = timed_generate(llm, prompts, params)
        times.append(elapsed)
        ttfts += [o.metrics.time_to_first_token for o in outputs]
        tpots += [o.metrics.time_per_output_token for o in outputs if o.metrics.time_per_output_token is not None]
        num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    elapsed = sum(times) / len(times)
    row = {"batch_size": len(prompts), "num_prompt_tokens": num_prompt_tokens,
           "num_output_tokens": num_output_tokens, "output_len": args.output_len, "elapsed_s": elapsed,
           "times_s": times, "output_tok_per_s": num_output_tokens / elapsed,
           "total_tok_per_s": (num_output_tokens + num_prompt_tokens) / elapsed,
           "step_ms": 1000 * elapsed / args.output_len, "ttft_ms": 1000 * sum(ttfts) / len(ttfts),
           "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None}
    row["mean_acceptance_length"] = mean_acceptance_length(before, llm.get_metrics())
    return row


def timed_generate(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams]) -> tuple[list, float]:
    """``llm.generate`` and its wall time, the device synchronised on both sides. It starts with an empty prefix
    cache: a benchmark repeats its prompts, which would otherwise skip their prefill."""
    llm.reset_prefix_cache()
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize()
    return outputs, time.perf_counter() - start


def synchronize() -> None:
    """Wait for the device (a no-op on CPU, and before CUDA is used)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def mean_acceptance_length(before: dict[str, object], after: dict[str, object]) -> float | None:
    """1 + accepted / drafts between two ``get_metrics()`` snapshots; None when nothing was drafted."""
    drafts = after["num_drafts"] - before["num_drafts"]
    return 1 + (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / drafts if drafts else None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def format_table(rows: list[dict], is_speculative: bool) -> str:
    head = "| batch | prompt tokens | output tokens | output tok/s | ms / output step | TTFT ms | TPOT ms |"
    head += " accept len |" if is_speculative else ""
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in rows:
        tpot = f"{r['tpot_ms']:.2f}" if r["tpot_ms"] is not None else "-"
        line = (f"| {r['batch_size']} | {r['num_prompt_tokens']} | {r['num_output_tokens']} | "
                f"{r['output_tok_per_s']:.1f} | {r['step_ms']:.2f} | {r['ttft_ms']:.2f} | {tpot} |")
        if is_speculative:
            m = r["mean_acceptance_length"]
            line += f" {m:.2f} |" if m is not None else " - |"
        lines.append(line)
    return "\n".join(lines)


def format_comparison(spec: list[dict], none: list[dict]) -> str:
    lines = ["| batch | output tok/s, spec | output tok/s, none | speedup | TPOT ms, spec | TPOT ms, none |",
             "|---:|---:|---:|---:|---:|---:|"]
    for s, n in zip(spec, none, strict=True):
        tpots = [f"{r['tpot_ms']:.2f}" if r["tpot_ms"] is not None else "-" for r in (s, n)]
        lines.append(f"| {s['batch_size']} | {s['output_tok_per_s']:.1f} | {n['output_tok_per_s']:.1f} | "
                     f"{s['output_tok_per_s'] / n['output_tok_per_s']:.2f}x | {tpots[0]} | {tpots[1]} |")
    return "\n".join(lines)


def _json_arg(text: str) -> dict:
    try:
        return json_object(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _jsonable(d: dict[str, object]) -> dict[str, object]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items() if not callable(v)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="truespec bench")
    add_bench_args(parser)
    args = parser.parse_args()
    sys.exit(run_command(lambda: main(args)))
