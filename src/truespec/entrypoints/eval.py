"""``truespec eval ppl`` and ``truespec eval niah``: what a KV-cache dtype costs in quality, on held-out code.

The text is the held-out split of the running interpreter's standard library, as the embedded model's training
defines it (``truespec.training.corpus``: ~3% of the files, chosen by a hash of their path, never trained on),
without the generated codec tables under ``encodings/`` (almost free to predict, MODEL.md). For other models it is
just Python code. One engine per ``--kv-cache-dtype``, one after the other (each may take the whole device); every
dtype is checked by the engine before the first one loads, so a bad name fails at once (exit 2).

- ``ppl``: the files joined by EOS (as the training's held-out stream), cut into windows of ``--context-len``
  tokens, each scored with ``prompt_logprobs=0`` (``max_tokens=1``): mean NLL of every token after a window's
  first, and PPL = exp(mean NLL).
- ``niah``: a needle, a string-literal assignment ``IVORY_WALRUS = "365"`` (seeded key and 3-digit payload, unique
  in its prompt), is planted at the start, middle or end of about ``--context-len`` tokens of held-out code lines,
  and the prompt ends with ``IVORY_WALRUS = "``; a needle passes if the greedy completion holds the payload. (The
  embedded model copies a number from a same-prefix assignment at short range; it never answers
  ``assert KEY == "`` and never copies a payload of words, so those forms would measure nothing on it.)
"""

import argparse
import functools
import gc
import json
import math
import random
import sys
from collections.abc import Callable

import torch

from truespec.assets import DEFAULT_MODEL_DIR
from truespec.config import CUDAGRAPH_MODES, DTYPES
from truespec.entrypoints.arg_types import (
    add_prefix_caching_args,
    add_sparse_v_args,
    at_least,
    prefix_caching_kwargs,
    sparse_v_kwargs,
    writable_path,
)
from truespec.entrypoints.bench import device_name
from truespec.llm import LLM
from truespec.sampling_params import SamplingParams
from truespec.tokenizer import load_tokenizer
from truespec.training.corpus import collect_corpus

POSITIONS = {"start": 0.0, "middle": 0.5, "end": 1.0}  # where a needle goes, as a fraction of the haystack's lines
NIAH_MAX_TOKENS = 8  # a 3-digit payload, its closing quote and a little more
ADJECTIVES = ["amber", "silver", "crimson", "violet", "golden", "cobalt", "ivory", "jade", "scarlet", "teal"]
ANIMALS = ["platypus", "otter", "falcon", "badger", "heron", "lynx", "walrus", "gecko", "bison", "marmot"]
CONTEXT_HELP = ("tokens per window (default 2048: the embedded model was trained on 2,048-token windows; the engine "
                "takes up to the model's max_position_embeddings, 32,768 for the embedded model)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="perplexity and needle-in-a-haystack on held-out code, per KV dtype")
    tasks = parser.add_subparsers(dest="task", required=True)
    ppl = tasks.add_parser("ppl", help="perplexity of held-out code in --context-len windows, per KV cache dtype")
    ppl.add_argument("--max-windows", type=at_least(1), default=None, help="score at most this many windows, "
                     "spread evenly over the text (default: all)")
    niah = tasks.add_parser("niah", help="needle in a haystack: retrieve a planted string literal from held-out "
                                         "code, per KV cache dtype and needle position")
    niah.add_argument("--num-needles", type=at_least(1), default=5, help="needles per position (default 5)")
    niah.add_argument("--seed", type=int, default=0, help="seed of the needles and haystacks")
    for p, run in ((ppl, run_ppl), (niah, run_niah)):
        p.add_argument("--context-len", type=at_least(2), default=2048, help=CONTEXT_HELP)
        p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="one engine per dtype (default: auto)")
        add_engine_args(p)
        p.add_argument("--json", type=writable_path, default=None, help="write the results here")
        p.set_defaults(run=run)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: --context-len + the output")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default=None)
    add_sparse_v_args(parser)
    add_prefix_caching_args(parser)


def engine_kwargs(args: argparse.Namespace, num_output_tokens: int) -> dict[str, object]:
    """``LLM`` keywords (model included) for every engine of the run, without the KV cache dtype."""
    if args.max_model_len is not None and args.max_model_len < args.context_len + num_output_tokens:
        raise ValueError(f"--max-model-len {args.max_model_len} is below --context-len {args.context_len} + "
                         f"{num_output_tokens} output token(s)")
    kwargs: dict[str, object] = dict(
        model=args.model or str(DEFAULT_MODEL_DIR), dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len or args.context_len + num_output_tokens, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.cudagraph_mode is not None:
        kwargs["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    return kwargs | sparse_v_kwargs(args) | prefix_caching_kwargs(args)


# ---- held-out text --------------------------------------------------------------------------------------------
@functools.cache
def heldout_texts() -> tuple[list[str], str]:
    """The held-out files' texts (sorted by path), and what they are, for the report."""
    corpus = collect_corpus()
    files = [f for f in corpus.heldout if not f.path.startswith("encodings/")]
    return [f.text for f in files], (f"{len(files)} held-out files of the Python {corpus.python_version} standard "
                                     "library (truespec.training.corpus split, encodings/ left out)")


def ppl_windows(tokenizer, texts: list[str], context_len: int,  # noqa: ANN001 - a transformers tokenizer
                max_windows: int | None = None) -> list[list[int]]:
    """Non-overlapping ``context_len``-token windows of the texts joined by EOS (a shorter tail is dropped); at
    most ``max_windows`` of them, evenly spread."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stream = [t for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] for t in ids + eos]
    windows = [stream[i:i + context_len] for i in range(0, len(stream) - context_len + 1, context_len)]
    if max_windows is not None and len(windows) > max_windows:
        windows = [windows[i * len(windows) // max_windows] for i in range(max_windows)]
    if not windows:
        raise ValueError(f"--context-len {context_len} is longer than the held-out text ({len(stream)} tokens)")
    return windows


def score_windows(llm: LLM, windows: list[list[int]]) -> tuple[float, int]:
    """Total negative log-likelihood (nats) of every token after each window's first, and how many tokens."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll = -sum(entry[t] for o in outs for entry, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True))
    return nll, sum(len(w) - 1 for w in windows)


# ---- needles ----------------------------------------------------------------------------------------------------
def make_needles(tokenizer, texts: list[str], context_len: int, num_needles: int,  # noqa: ANN001
                 seed: int) -> list[dict]:
    """Per position, ``num_needles`` prompts of at most ``context_len`` tokens: held-out lines from a random place,
    the needle planted among them, then the query. Each: position, payload, prompt."""
    rng = random.Random(seed)
    lines = [line for text in texts for line in (text.rstrip("\n") + "\n").splitlines(keepends=True)]
    counts = [len(ids) for ids in tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"]]
    needles = []
    for position, depth in POSITIONS.items():
        for _ in range(num_needles):
            key = f"{rng.choice(ADJECTIVES)}_{rng.choice(ANIMALS)}".upper()
            query = f'\n{key} = "'
            budget = context_len - len(tokenizer.encode(f'{key} = "100"\n{query}'))
            hay = _haystack(lines, counts, rng.randrange(len(lines)), budget)
            payload = str(rng.randrange(100, 1000))
            while payload in "".join(hay):  # unique: the completion can only have it from the needle
                payload = str(rng.randrange(100, 1000))
            while True:
                at = round(depth * len(hay))
                prompt = "".join(hay[:at]) + f'{key} = "{payload}"\n' + "".join(hay[at:]) + query
                if len(tokenizer.encode(prompt)) <= context_len or not hay:  # as the engine encodes it
                    break
                hay.pop()  # the lines' own token counts were a little short of the joined text's
            needles.append({"position": position, "payload": payload, "prompt": prompt})
    return needles


def _haystack(lines: list[str], counts: list[int], start: int, budget: int) -> list[str]:
    """The lines from ``start`` on (wrapping around) while their token counts fit ``budget``."""
    end = start
    while end < start + len(lines) and budget >= counts[end % len(lines)]:
        budget -= counts[end % len(lines)]
        end += 1
    return [lines[i % len(lines)] for i in range(start, end)]


def run_needles(llm: LLM, needles: list[dict]) -> list[bool]:
    params = SamplingParams(temperature=0, max_tokens=NIAH_MAX_TOKENS)
    outs = llm.generate([n["prompt"] for n in needles], params, use_tqdm=False)
    return [n["payload"] in o.outputs[0].text for n, o in zip(needles, outs, strict=True)]


# ---- the commands -----------------------------------------------------------------------------------------------
def run_ppl(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs(args, 1)
    check_kv_cache_dtypes(kwargs, args.kv_cache_dtype)
    texts, source = heldout_texts()
    windows = ppl_windows(load_tokenizer(kwargs["model"]), texts, args.context_len, args.max_windows)

    def score(llm: LLM) -> dict[str, object]:
        nll, num_tokens = score_windows(llm, windows)
        return {"num_windows": len(windows), "num_tokens": num_tokens, "mean_nll": nll / num_tokens,
                "ppl": math.exp(nll / num_tokens)}

    rows, device = for_each_engine(kwargs, args.kv_cache_dtype, score)
    base = next((r["ppl"] for r in rows if r["kv_cache_dtype"] == "auto"), None)
    for r in rows:
        r["ppl_change_vs_auto"] = None if base is None else r["ppl"] / base - 1
    print(f"perplexity, {args.context_len}-token windows of {source}, on {device}:")
    print(format_ppl_table(rows))
    write_json(args, kwargs, {"task": "ppl", "source": source, "device": device, "results": rows})
    return 0


def run_niah(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs(args, NIAH_MAX_TOKENS)
    check_kv_cache_dtypes(kwargs, args.kv_cache_dtype)
    texts, source = heldout_texts()
    needles = make_needles(load_tokenizer(kwargs["model"]), texts, args.context_len, args.num_needles, args.seed)

    def retrieve(llm: LLM) -> dict[str, object]:
        passed = run_needles(llm, needles)
        return {p: sum(ok for n, ok in zip(needles, passed, strict=True) if n["position"] == p) for p in POSITIONS}

    rows, device = for_each_engine(kwargs, args.kv_cache_dtype, retrieve)
    print(f"needle in a haystack, about {args.context_len} tokens of {source}, {args.num_needles} needles per "
          f"position, on {device}:")
    print(format_niah_table(rows, args.num_needles))
    write_json(args, kwargs, {"task": "niah", "source": source, "device": device, "num_needles": args.num_needles,
                              "results": rows})
    return 0


def check_kv_cache_dtypes(kwargs: dict[str, object], dtypes: list[str]) -> None:
    """The engine's own check of every configuration, before any model loads."""
    for dtype in dtypes:
        LLM.check_args(**kwargs, kv_cache_dtype=dtype)


def for_each_engine(kwargs: dict[str, object], dtypes: list[str],
                    run: Callable[[LLM], dict[str, object]]) -> tuple[list[dict[str, object]], str]:
    """Per KV cache dtype, ``run(llm)``'s row on an engine of its own (freed before the next); the device."""
    rows, device = [], ""
    for dtype in dtypes:
        llm = LLM(**kwargs, kv_cache_dtype=dtype)
        rows.append({"kv_cache_dtype": dtype} | run(llm))
        device = device_name(llm.llm_engine.device)
        del llm
        gc.collect()  # its KV pool, before the next engine takes the device
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows, device


def format_ppl_table(rows: list[dict]) -> str:
    lines = ["| kv cache dtype | windows | tokens scored | mean NLL (nats) | PPL | PPL vs auto |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        change = r["ppl_change_vs_auto"]
        change = "-" if change is None or r["kv_cache_dtype"] == "auto" else f"{100 * change:+.2f}%"
        lines.append(f"| {r['kv_cache_dtype']} | {r['num_windows']} | {r['num_tokens']} | {r['mean_nll']:.4f} | "
                     f"{r['ppl']:.3f} | {change} |")
    return "\n".join(lines)


def format_niah_table(rows: list[dict], num_needles: int) -> str:
    lines = ["| kv cache dtype | " + " | ".join(POSITIONS) + " | total |", "|---|" + "---:|" * (len(POSITIONS) + 1)]
    for r in rows:
        cells = [f"{r[p]}/{num_needles}" for p in POSITIONS]
        total = f"{sum(r[p] for p in POSITIONS)}/{num_needles * len(POSITIONS)}"
        lines.append(f"| {r['kv_cache_dtype']} | " + " | ".join(cells) + f" | {total} |")
    return "\n".join(lines)


def write_json(args: argparse.Namespace, kwargs: dict[str, object], report: dict[str, object]) -> None:
    if args.json is not None:
        report |= {"model": kwargs["model"], "context_len": args.context_len, "engine_args": kwargs}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    from truespec.entrypoints.errors import run_command

    parser = argparse.ArgumentParser(prog="truespec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args()
    sys.exit(run_command(lambda: parsed.run(parsed)))
