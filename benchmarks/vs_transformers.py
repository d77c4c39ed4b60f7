"""truespec vs transformers ``generate`` on one model directory and one device, plus the memory roofline.

    python3 benchmarks/vs_transformers.py --model DIR --json out.json [--batch-sizes 1 8 32 128]
        [--input-len 512] [--output-len 256] [--hf-compile] [--mixed [--hf-mixed]] [--truespec-only | --hf-only]

Both engines decode the same random prompt ids greedily for exactly ``--output-len`` tokens. Reported: BS=1 time
per output token (``(t(output_len) - t(1)) / (output_len - 1)``: decode steps only), output tokens/s per batch
size (wall time including prefill), and the roofline: the bytes one decode step must move (every weight once,
the lm_head in full; each request's KV over the mean context; GDN recurrent and conv states read and written)
over the measured device copy bandwidth. ``--mixed``: 256 requests with input and output lengths drawn from
100..1024 (nano-vllm's benchmark); transformers runs them as left-padded static batches (``--hf-mixed``).
The engines run one after the other (transformers first), each freed before the next.
"""

import argparse
import gc
import importlib.util
import json
import math
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from truespec import LLM, SamplingParams
from truespec.entrypoints.bench import CUDAGRAPH_MODES, device_name, random_prompts, synchronize, timed_generate

MIXED_NUM_REQUESTS, MIXED_MIN_LEN, MIXED_MAX_LEN = 256, 100, 1024  # nano-vllm's bench.py
Generate = Callable[[list[list[int]], list[int]], None]  # (prompt ids per request, output len per request)


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(args.model)
    special_ids = AutoTokenizer.from_pretrained(args.model).all_special_ids
    bandwidth = copy_bandwidth(device, args.copy_mib)
    report = {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
              "model": args.model, "dtype": args.dtype, "input_len": args.input_len, "output_len": args.output_len,
              "batch_sizes": args.batch_sizes, "has_fla": _has("fla"), "has_causal_conv1d": _has("causal_conv1d"),
              "copy_bandwidth_GBps": bandwidth / 1e9, "engines": {},
              "roofline": [roofline(args.model, config, dtype, bs, args.input_len, args.output_len, bandwidth)
                           for bs in sorted({1, *args.batch_sizes})]}
    workload = (mixed_requests(config.vocab_size, special_ids, args.seed) if args.mixed else
                {bs: [p["prompt_token_ids"] for p in random_prompts(config.vocab_size, special_ids, bs,
                                                                    args.input_len, args.seed)]
                 for bs in args.batch_sizes})
    for name, build in engine_builders(args, config, device, dtype).items():
        report["engines"][name] = run_engine(name, build, workload, args)
        if args.json is not None:  # after each engine: a later crash or timeout keeps the earlier numbers
            args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))


def engine_builders(args: argparse.Namespace, config: object, device: torch.device,
                    dtype: torch.dtype) -> dict[str, Callable[[], Generate]]:
    """In run order: transformers first (its memory is returned reliably), then truespec (which sizes its KV
    pool from the free memory), then the compiled transformers (which may fail)."""
    hf = not args.truespec_only and (args.hf_mixed or not args.mixed)
    builders: dict[str, Callable[[], Generate]] = {}
    if hf:
        builders["transformers"] = lambda: hf_engine(args.model, dtype, device, config, None)
    if not args.hf_only:
        max_num_seqs = MIXED_NUM_REQUESTS if args.mixed else max(args.batch_sizes)
        builders["truespec"] = lambda: truespec_engine(args, max_num_seqs)
    if hf and args.hf_compile:
        builders["transformers_static_compile"] = lambda: hf_engine(args.model, dtype, device, config, "static")
    return builders


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (e.g. from benchmarks/qwen35_shape.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    only = p.add_mutually_exclusive_group()
    only.add_argument("--truespec-only", action="store_true")
    only.add_argument("--hf-only", action="store_true")
    p.add_argument("--hf-compile", action="store_true",
                   help="also transformers with cache_implementation='static' (auto torch.compile on CUDA)")
    p.add_argument("--mixed", action="store_true",
                   help="instead of the batch sweep: 256 requests of mixed lengths (truespec only unless --hf-mixed)")
    p.add_argument("--hf-mixed", action="store_true", help="the mixed requests through transformers too")
    p.add_argument("--hf-mixed-batch-size", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default=None)
    p.add_argument("--copy-mib", type=int, default=None, help="copy size for the bandwidth (default 1024, CPU 64)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


# ---- the engines: each a generate(prompts, output_lens) closure --------------------------------------
def truespec_engine(args: argparse.Namespace, max_num_seqs: int) -> Generate:
    max_len = (MIXED_MAX_LEN * 2 if args.mixed else args.input_len + args.output_len) + 64  # + room for drafts
    # prefix caching off: the timed runs repeat the warm-up's prompts, and transformers caches nothing across calls
    kwargs: dict[str, object] = dict(dtype=args.dtype, device=args.device, max_model_len=max_len,
                                     max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    if args.enforce_eager:  # only when asked, so the script runs on engines without these knobs
        kwargs["enforce_eager"] = True
    if args.cudagraph_mode is not None:
        kwargs["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    llm = LLM(args.model, **kwargs)

    def generate(prompts: list[list[int]], output_lens: list[int]) -> None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        outputs, _ = timed_generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
        assert [len(o.outputs[0].token_ids) for o in outputs] == output_lens
    return generate


def hf_engine(model_dir: str, dtype: torch.dtype, device: torch.device, config: object,
              cache_implementation: str | None) -> Generate:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    extra = {} if cache_implementation is None else {"cache_implementation": cache_implementation}

    @torch.inference_mode()
    def generate(prompts: list[list[int]], output_lens: list[int]) -> None:
        width, new = max(map(len, prompts)), max(output_lens)  # static batch: left-pad, decode the longest
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad, **extra)
        assert out.shape[1] == width + new
    return generate


# ---- measurement -------------------------------------------------------------------------------
def run_engine(name: str, build: Callable[[], Generate], workload: dict | tuple,
               args: argparse.Namespace) -> dict[str, object]:
    """Everything for one engine; a failure (import, compile, out of memory) is recorded, not raised."""
    print(f"-- {name}: building", flush=True)
    result: dict[str, object] = {}
    try:
        generate = build()
        if isinstance(workload, tuple):  # --mixed: (prompts, output lens)
            batch_size = len(workload[0]) if name == "truespec" else args.hf_mixed_batch_size
            result["mixed"] = _guard({}, mixed_throughput, generate, *workload, batch_size)
        else:  # batch size -> prompts
            result.update(bs1_latency(generate, workload[min(workload)][:1], args.output_len))
            result["throughput"] = [_guard({"batch_size": bs}, throughput, generate, batch, args.output_len)
                                    for bs, batch in workload.items()]
        print(f"-- {name}: {result}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported in the JSON and the table
        result["error"] = _error(e)
        print(f"-- {name}: failed: {result['error']}", flush=True)
    generate = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def bs1_latency(generate: Generate, prompt: list[list[int]], output_len: int) -> dict[str, float]:
    generate(prompt, [output_len])  # warm-up
    first, full = _timed(generate, prompt, [1]), _timed(generate, prompt, [output_len])
    return {"bs1_first_token_s": first, "bs1_wall_s": full,
            "bs1_step_s": (full - first) / max(1, output_len - 1)}


def throughput(generate: Generate, batch: list[list[int]], output_len: int) -> dict[str, float]:
    generate(batch, [output_len] * len(batch))  # warm-up
    elapsed = _timed(generate, batch, [output_len] * len(batch))
    return {"elapsed_s": elapsed, "output_tok_per_s": len(batch) * output_len / elapsed,
            "step_s": elapsed / output_len}


def mixed_requests(vocab_size: int, special_ids: list[int], seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths of the mixed workload, lengths uniform in [MIXED_MIN_LEN, MIXED_MAX_LEN]."""
    rng = random.Random(seed)
    input_lens = [rng.randint(MIXED_MIN_LEN, MIXED_MAX_LEN) for _ in range(MIXED_NUM_REQUESTS)]
    output_lens = [rng.randint(MIXED_MIN_LEN, MIXED_MAX_LEN) for _ in range(MIXED_NUM_REQUESTS)]
    pool = random_prompts(vocab_size, special_ids, MIXED_NUM_REQUESTS, MIXED_MAX_LEN, seed + 1)
    return [p["prompt_token_ids"][:n] for p, n in zip(pool, input_lens, strict=True)], output_lens


def mixed_throughput(generate: Generate, prompts: list[list[int]], output_lens: list[int],
                     batch_size: int) -> dict[str, float]:
    generate(prompts[:2], [8, 8])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        generate(prompts[i:i + batch_size], output_lens[i:i + batch_size])
    elapsed = time.perf_counter() - start
    return {"num_requests": len(prompts), "batch_size": batch_size, "elapsed_s": elapsed,
            "output_tok_per_s": sum(output_lens) / elapsed,
            "total_tok_per_s": (sum(output_lens) + sum(map(len, prompts))) / elapsed}


def _timed(generate: Generate, prompts: list[list[int]], output_lens: list[int]) -> float:
    synchronize()
    start = time.perf_counter()
    generate(prompts, output_lens)
    synchronize()
    return time.perf_counter() - start


# ---- the roofline ------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, mib: int | None, iters: int = 10) -> float:
    """Bytes/s of ``dst.copy_(src)`` counting the read and the write (2 * size per copy)."""
    num_bytes = (mib or (64 if device.type == "cpu" else 1024)) * 2**20
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    synchronize()
    return 2 * num_bytes * iters / (time.perf_counter() - start)


def weight_numel(model_dir: str) -> int:
    """Elements a decode step reads: every checkpoint tensor except ``mtp.*``; the embedding only when it is
    also the lm_head (tied), as a row gather is negligible."""
    shapes: dict[str, list[int]] = {}
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[name] = f.get_slice(name).get_shape()
    numel = {k: math.prod(s) for k, s in shapes.items() if not k.startswith("mtp.")}
    if any(k.endswith("lm_head.weight") for k in numel):
        numel = {k: n for k, n in numel.items() if not k.endswith("embed_tokens.weight")}
    return sum(numel.values())


def roofline(model_dir: str, config: object, dtype: torch.dtype, batch_size: int, input_len: int,
             output_len: int, bandwidth: float) -> dict[str, object]:
    """Bytes of one decode step at the mean decode context, and their time at ``bandwidth``."""
    elsize = torch.empty((), dtype=dtype).element_size()
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers  # dense models
    num_full, num_linear = types.count("full_attention"), types.count("linear_attention")
    context = input_len + output_len // 2
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = num_full * 2 * config.num_key_value_heads * head_dim * context * elsize
    ssm = conv = 0
    if num_linear:
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        ssm = num_linear * nv * dk * dv * 4 * 2  # float32 state, read + write
        conv = num_linear * (2 * nk * dk + nv * dv) * (config.linear_conv_kernel_dim - 1) * elsize * 2
    parts = {"weights": weight_numel(model_dir) * elsize, "kv": batch_size * kv, "gdn_state": batch_size * ssm,
             "conv_state": batch_size * conv}
    total = sum(parts.values())
    return {"batch_size": batch_size, "context_len": context, "bytes": parts, "total_bytes": total,
            "step_s": total / bandwidth}


# ---- the report --------------------------------------------------------------------------------
def format_table(report: dict) -> str:
    engines = report["engines"]
    lines = [f"device: {report['device']}, torch {report['torch']}, transformers {report['transformers']}, "
             f"fla {report['has_fla']}, copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s"]
    if any("throughput" in e for e in engines.values()):
        lines += ["", sweep_table(report), "", latency_table(report)]
    for name, e in engines.items():
        m = e.get("mixed", {})
        if "output_tok_per_s" in m:
            lines.append(f"mixed, {name}: {m['num_requests']} requests, {m['output_tok_per_s']:.1f} output tok/s, "
                         f"{m['total_tok_per_s']:.1f} total tok/s, {m['elapsed_s']:.1f} s")
        for error in (m.get("error"), e.get("error")):
            lines += [f"{name} failed: {error}"] if error else []
    return "\n".join(lines)


def sweep_table(report: dict) -> str:
    """Per batch size: each engine's tok/s and ms per output step (x the roofline), truespec's speed-up."""
    engines, roof = report["engines"], {r["batch_size"]: r["step_s"] for r in report["roofline"]}
    others = [n for n in engines if n != "truespec"] if "truespec" in engines else []
    head = ("| BS | roofline ms | " + " | ".join(f"{n} tok/s | {n} ms/step (x roofline)" for n in engines)
            + "".join(f" | truespec / {n}" for n in others) + " |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for bs in report["batch_sizes"]:
        rows = {n: _row(e, bs) for n, e in engines.items()}
        cells = [f"{bs}", f"{roof[bs] * 1e3:.3f}"]
        for r in rows.values():
            step = r.get("step_s")
            cells += [_fmt(r.get("output_tok_per_s"), ".1f"),
                      f"{_fmt(step, '.3f', 1e3)} ({_fmt(_div(step, roof[bs]), '.1f')}x)"]
        ts = rows["truespec"].get("output_tok_per_s") if others else None
        cells += [_fmt(_div(ts, rows[n].get("output_tok_per_s")), ".2f") + "x" for n in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def latency_table(report: dict) -> str:
    roof = next(r["step_s"] for r in report["roofline"] if r["batch_size"] == 1)
    lines = [f"| BS=1 decode, per output token | ms | x roofline ({roof * 1e3:.3f} ms) |", "|---|---:|---:|"]
    for name, e in report["engines"].items():
        step = e.get("bs1_step_s")
        lines.append(f"| {name} | {_fmt(step, '.3f', 1e3)} | {_fmt(_div(step, roof), '.1f')}x |")
    return "\n".join(lines)


def _row(engine: dict, bs: int) -> dict:
    return next((r for r in engine.get("throughput", []) if r.get("batch_size") == bs), {})


def _guard(tags: dict[str, object], fn: Callable[..., dict], *fn_args: object) -> dict[str, object]:
    try:
        return {**tags, **fn(*fn_args)}
    except Exception as e:  # noqa: BLE001 - one failed size (out of memory) must not lose the others
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**tags, "error": _error(e)}


def _error(e: Exception) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {str(e)[:300]} ({Path(where.filename).name}:{where.lineno})"


def _fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _has(module: str) -> bool:
    """Whether transformers can use this kernel package (else it falls back to torch)."""
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
