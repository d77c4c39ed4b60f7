"""truespec on the CPU: start-up, ``truespec demo`` and decode tok/s against transformers, side by side in one run.

    python3 benchmarks/cpu_speed.py [--src BEFORE_SRC --src AFTER_SRC] [--batch-sizes 1 16] [--input-len 32]
        [--output-len 64] [--threads 2] [--repeats 3] [--skip-demo] [--json out.json]

Every measurement runs in a fresh interpreter (``PYTHONPATH=SRC``), so two checkouts' ``src`` directories (before /
after) are timed by the same script in the same run, with transformers between them. Per checkout: ``import
truespec``, ``LLM()`` on the embedded model (float32, CPU) after the import, and the first ``generate``; the wall
time of ``python -m truespec demo``; and output tok/s of greedy decoding of ``--output-len`` tokens from random
``--input-len``-token prompts at each batch size (wall time of one ``generate``, prefill included; the best of
``--repeats`` after a warm-up, each run with prompts of its own, so no run is served from a prefix cache: this machine
is shared, the best run is the one least disturbed). transformers runs
the same prompts through ``model.generate`` (a static batch of equal-length prompts, its dynamic cache).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "src" / "truespec" / "assets" / "stdlib-qwen35"


def main() -> None:
    args = parse_args()
    srcs = args.src or [str(ROOT / "src")]
    report: dict[str, object] = {"cpu": cpu_name(), "threads": args.threads, "input_len": args.input_len,
                                 "output_len": args.output_len, "repeats": args.repeats, "runs": {}}
    runs: dict[str, dict] = report["runs"]
    for src in srcs:
        runs[src] = {"startup": best_of(args.repeats, lambda s=src: child(args, s, "startup"), key="llm_s")}
        if not args.skip_demo:
            runs[src]["demo_s"] = min(demo_seconds(src) for _ in range(args.demo_repeats))
        runs[src]["decode"] = child(args, src, "truespec")
        print(json.dumps({src: runs[src]}), flush=True)
    runs["transformers"] = {"decode": child(args, srcs[-1], "transformers")}
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", action="append", help="a checkout's src directory (repeat: before, after)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads in both engines (default: torch's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--demo-repeats", type=int, default=1)
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", choices=("startup", "truespec", "transformers"), help=argparse.SUPPRESS)
    return p.parse_args()


def child(args: argparse.Namespace, src: str, what: str) -> dict:
    """Run this script's ``--child`` part in a fresh interpreter with ``src`` on the path; its JSON line."""
    cmd = [sys.executable, __file__, "--child", what, "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--repeats", str(args.repeats), "--batch-sizes", *map(str, args.batch_sizes)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def demo_seconds(src: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "truespec", "demo"], env={**os.environ, "PYTHONPATH": src},
                   capture_output=True, check=True)
    return time.perf_counter() - start


def best_of(n: int, run: object, key: str) -> dict:
    return min((run() for _ in range(n)), key=lambda r: r[key])


# ---- the children: each prints one JSON line ------------------------------------------------------
def child_startup(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    import truespec

    imported = time.perf_counter()
    llm = truespec.LLM(dtype="float32", device="cpu")
    ready = time.perf_counter()
    llm.generate(["def add(a, b):"], truespec.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return {"import_s": imported - start, "llm_s": ready - imported, "first_generate_s": time.perf_counter() - ready}


def child_decode(args: argparse.Namespace, engine: str) -> dict:
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    generate = truespec_generate(max(args.batch_sizes), args) if engine == "truespec" else hf_generate()
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # after LLM(): the engine's own setting is overridden
    result = {"threads": torch.get_num_threads()}
    for bs in args.batch_sizes:
        generate(random_prompts(bs, args.input_len, seed=10_000), args.output_len)  # warm-up
        times = []
        for i in range(args.repeats):  # fresh prompts each run: no engine may serve them from a prefix cache
            prompts = random_prompts(bs, args.input_len, seed=i)
            start = time.perf_counter()
            generate(prompts, args.output_len)
            times.append(time.perf_counter() - start)
        result[str(bs)] = {"best_s": min(times), "tok_per_s": bs * args.output_len / min(times),
                           "all_s": [round(t, 4) for t in times]}
    return result


def truespec_generate(max_num_seqs: int, args: argparse.Namespace) -> object:
    from truespec import LLM, SamplingParams

    llm = LLM(dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
              max_model_len=args.input_len + args.output_len + 16)

    def generate(prompts: list[list[int]], output_len: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return generate


def hf_generate() -> object:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0

    @torch.inference_mode()
    def generate(prompts: list[list[int]], output_len: int) -> None:
        ids = torch.tensor(prompts)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        assert out.shape[1] == ids.shape[1] + output_len
    return generate


def random_prompts(batch_size: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Ids drawn from the vocabulary past the special tokens (0..3 in the embedded tokenizer)."""
    import torch

    vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (batch_size, input_len), generator=gen).tolist()


# ---- the report ------------------------------------------------------------------------------------
def format_table(report: dict) -> str:
    runs = report["runs"]
    hf = runs["transformers"]["decode"]
    srcs = [s for s in runs if s != "transformers"]
    lines = [f"CPU: {report['cpu']}; threads {hf['threads']}; float32; {report['input_len']}-token prompts, "
             f"{report['output_len']} greedy tokens; best of {report['repeats']}",
             "", "| checkout | import s | LLM() s | first generate s | demo s |", "|---|---:|---:|---:|---:|"]
    for s in srcs:
        st = runs[s]["startup"]
        demo = runs[s].get("demo_s")
        lines.append(f"| {s} | {st['import_s']:.2f} | {st['llm_s']:.2f} | {st['first_generate_s']:.2f} | "
                     f"{'-' if demo is None else f'{demo:.1f}'} |")
    head = "| BS | transformers tok/s | " + " | ".join(f"{s} tok/s (x transformers)" for s in srcs) + " |"
    lines += ["", head, "|" + "---:|" * (head.count("|") - 1)]
    for bs in (k for k in hf if k != "threads"):
        cells = [bs, f"{hf[bs]['tok_per_s']:.0f}"]
        for s in srcs:
            ts = runs[s]["decode"][bs]["tok_per_s"]
            cells.append(f"{ts:.0f} ({ts / hf[bs]['tok_per_s']:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"unknown x {os.cpu_count()}"


if __name__ == "__main__":
    cli = parse_args()
    if cli.child == "startup":
        print(json.dumps(child_startup(cli)))
    elif cli.child is not None:
        print(json.dumps(child_decode(cli, cli.child)))
    else:
        main()
