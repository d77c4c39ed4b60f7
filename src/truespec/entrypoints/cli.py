"""Command line: ``truespec generate [--model DIR] "prompt"``, ``truespec verify`` and ``truespec serve``."""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from truespec.config import DTYPES
from truespec.entrypoints.arg_types import (
    add_prefix_caching_args,
    add_sparse_v_args,
    prefix_caching_kwargs,
    sparse_v_kwargs,
)
from truespec.entrypoints.bench import add_parser as add_bench_parser
from truespec.entrypoints.errors import run_command
from truespec.entrypoints.eval import add_parser as add_eval_parser
from truespec.entrypoints.prompts_file import check_cli_prompts, load_prompts
from truespec.entrypoints.serve import add_serve_args, run_server
from truespec.entrypoints.verify import DEBUG_FAULTS, KNOBS, baseline_of, format_results, json_object, verify
from truespec.kv_cache.formats import KV_CACHE_DTYPES
from truespec.llm import LLM
from truespec.sampling_params import SamplingParams

PromptType = str | dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="truespec", description="truespec: exactly lossless fast decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts and print tokens/s")
    add_prompt_args(gen)
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.set_defaults(run=_generate)
    ver = sub.add_parser("verify", help="check that a configuration gives the tokens of the engine without it "
                                        "(exit 1 on any divergence)")
    add_prompt_args(ver)
    add_engine_args(ver)
    ver.add_argument("--max-tokens", type=int, default=128)
    ver.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ver.add_argument("--baseline-eager", action="store_true",
                     help="run the baseline without CUDA graphs (enforce_eager), so the candidate's graphs are "
                          "under test too")
    ver.add_argument("--debug-fault", choices=sorted(DEBUG_FAULTS), help=argparse.SUPPRESS)  # verify's self-test
    ver.set_defaults(run=_verify)
    demo = sub.add_parser("demo", help="the embedded model completes a function and applies an edit, "
                                       "with and without speculation")
    demo.add_argument("--device", default="auto")
    demo.set_defaults(run=_demo)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(run=_serve)
    add_bench_parser(sub)
    add_eval_parser(sub)
    args = parser.parse_args(argv)
    return run_command(lambda: args.run(args))


def _demo(args: argparse.Namespace) -> int:
    from truespec.entrypoints.demo import run_demo

    return run_demo(args.device)


def _serve(args: argparse.Namespace) -> int:
    return run_server(args, engine_kwargs(args))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None,
                        help="prompt tokens one request computes per step: > 0 always, 0 never (default: 2048 while "
                             "another request is decoding)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV cache storage (default auto: the model dtype; fp8, TurboQuant presets)")
    add_sparse_v_args(parser)
    add_prefix_caching_args(parser)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads on the CPU (default: 1 for small models, else torch's; env "
                             "TRUESPEC_CPU_THREADS)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="prepare the next decode step (and MTP / EAGLE verify) while the device runs this one "
                             "(default: on for CUDA)")
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                        help="projections whose rows do not depend on the rest of the step, so speculation never "
                             "changes a 16-bit token (default: on; --no-batch-invariant: cuBLAS, faster prefill)")
    parser.add_argument("--compilation-config", type=_arg_type(json_object), default=None,
                        help='CUDA graphs, as JSON: \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\'')
    parser.add_argument("--structured-outputs-config", type=_arg_type(json_object), default=None,
                        help='structured outputs, as JSON: \'{"disable_any_whitespace": true}\'')
    for knob in KNOBS:  # unset: the engine's default (and verify's baseline)
        parser.add_argument("--" + knob.name.replace("_", "-"), type=_arg_type(knob.parse), default=None,
                            help=knob.help)


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    kwargs = dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
                  compilation_config=args.compilation_config, async_scheduling=args.async_scheduling,
                  batch_invariant=args.batch_invariant, structured_outputs_config=args.structured_outputs_config,
                  cpu_threads=args.cpu_threads, long_prefill_token_threshold=args.long_prefill_token_threshold)
    kwargs.update({k.name: getattr(args, k.name) for k in KNOBS if getattr(args, k.name) is not None})
    return kwargs | sparse_v_kwargs(args) | prefix_caching_kwargs(args)


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompt text(s)")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help='more prompts, one per line: JSON objects with a "prompt" (or "prompt_token_ids") '
                             "key, or plain text")


def prompts_of(args: argparse.Namespace) -> list[PromptType]:
    check_cli_prompts(args.prompts)
    prompts: list[PromptType] = list(args.prompts)
    if args.prompts_file is not None:
        prompts += load_prompts(args.prompts_file)
    if not prompts:
        raise ValueError("no prompts: give them as arguments or with --prompts-file")
    return prompts


def _arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as e:  # argparse prints this message and exits with code 2
            raise argparse.ArgumentTypeError(str(e)) from e
    return convert


def _generate(args: argparse.Namespace) -> int:
    prompts = prompts_of(args)
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        print(f"{out.prompt or ''}{out.outputs[0].text}")
        print(f"[finish_reason={out.outputs[0].finish_reason}]")
    print(f"{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s", file=sys.stderr)
    if llm.llm_engine.config.speculative_config is not None:
        print(format_spec_metrics(llm.get_metrics()), file=sys.stderr)
    return 0


def format_spec_metrics(m: dict[str, object]) -> str:
    drafts, draft_tokens, accepted = m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]
    rate = accepted / draft_tokens if draft_tokens else 0.0
    per_pos = " ".join(f"{n / drafts if drafts else 0.0:.3f}" for n in m["num_accepted_tokens_per_pos"])
    return (f"speculative decoding: num_drafts={drafts} num_draft_tokens={draft_tokens} "
            f"num_accepted_tokens={accepted} (acceptance rate {rate:.3f}) "
            f"mean_acceptance_length={m['mean_acceptance_length']:.3f}\n"
            f"acceptance rate per position: {per_pos}\n"
            f"steps={m['num_steps']} steps_without_drafts={m['num_steps_without_drafts']} "
            f"draft_skips={m['num_draft_skips']} steps_drafting_off={m['num_steps_drafting_off']}")


def _verify(args: argparse.Namespace) -> int:
    prompts = prompts_of(args)
    candidate = engine_kwargs(args)
    if not {k.name for k in KNOBS} & candidate.keys() and not args.baseline_eager:
        flags = ", ".join(["--" + k.name.replace("_", "-") for k in KNOBS] + ["--baseline-eager"])
        raise ValueError(f"nothing to verify: give the configuration under test ({flags})")
    baseline = None
    if args.baseline_eager:
        baseline = {k: v for k, v in baseline_of(candidate).items() if k != "model"} | {"enforce_eager": True}
    engines = []  # the candidate LLM, kept to read its speculative metrics

    def hook(llm: LLM) -> None:
        engines.append(llm)
        if args.debug_fault is not None:
            DEBUG_FAULTS[args.debug_fault](llm)

    results = verify(candidate.pop("model"), prompts, candidate, baseline, max_tokens=args.max_tokens,
                     ignore_eos=args.ignore_eos, candidate_hook=hook)
    print(format_results(results))
    if "speculative_config" in candidate:
        metrics = engines[0].get_metrics()
        print(format_spec_metrics(metrics), file=sys.stderr)
        if metrics["num_accepted_tokens"] == 0:
            print("warning: no draft token was accepted, so the state hand-off after an acceptance was not "
                  "exercised: try more --max-tokens or prompts the model continues predictably", file=sys.stderr)
    return 0 if all(r.is_identical for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
