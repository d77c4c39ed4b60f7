"""Command line: ``truespec generate [--model DIR] "prompt"``."""

import argparse
import sys
import time

from truespec.config import DTYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="truespec", description="truespec: exactly lossless fast decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts and print tokens/s")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size)


def _generate(args: argparse.Namespace) -> int:
    from truespec import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        print(f"{out.prompt}{out.outputs[0].text}")
        print(f"[finish_reason={out.outputs[0].finish_reason}]")
    print(f"{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
