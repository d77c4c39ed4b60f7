"""Acceptance of every speculative method on the embedded model's held-out prompts, and edit accuracy at
BS=1 vs BS=8 (the failure of vLLM #40738, where a mixed batch corrupted the recurrent state: it must not move).

    python benchmarks/spec_acceptance.py --per-kind 8 --out benchmarks/results/spec_acceptance_cpu.json

Prints a markdown table (mean acceptance length and per-position acceptance rate per method, k and prompt
kind) and writes the raw numbers as JSON.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from truespec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
KINDS = ("edit", "completion", "chat")


def load_prompts(path: Path, per_kind: int) -> dict[str, list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {kind: [r for r in rows if r["kind"] == kind][:per_kind] for kind in KINDS}


def params_for(llm: LLM, rows: list[dict]) -> list[SamplingParams]:
    tok = llm.get_tokenizer()
    return [SamplingParams(temperature=0, max_tokens=len(tok.encode(r["reference"])) + 32) for r in rows]


def run(llm: LLM, rows: list[dict]) -> tuple[list[str], dict, float]:
    before = llm.get_metrics()
    start = time.perf_counter()
    outs = llm.generate([r["prompt"] for r in rows], params_for(llm, rows), use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.get_metrics()
    delta = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pairs = zip(after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"], strict=True)
    delta["per_pos"] = [a - b for a, b in pairs]
    delta["num_output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    return [o.outputs[0].text for o in outs], delta, elapsed


def exact_match(texts: list[str], rows: list[dict]) -> float:
    return sum(t.strip() == r["reference"].strip() for t, r in zip(texts, rows, strict=True)) / max(1, len(rows))


def methods(args: argparse.Namespace, k: int) -> dict[str, dict]:
    out = {"ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
           "draft_model": {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k},
           "mtp": {"method": "mtp", "num_speculative_tokens": k}}
    if args.eagle and Path(args.eagle, "config.json").is_file():
        out["eagle"] = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": k}
    return out


def main() -> None:
    try:
        from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_MODEL_DIR
    except ImportError:
        DEFAULT_MODEL_DIR = DEFAULT_DRAFT_MODEL_DIR = Path(".")  # noqa: N806 - pass --model / --draft-model
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--draft-model", default=str(DEFAULT_DRAFT_MODEL_DIR))
    parser.add_argument("--eagle", default=str(Path(DEFAULT_MODEL_DIR).parent / "stdlib-eagle"))
    parser.add_argument("--prompts", default=str(ROOT / "prompts" / "heldout.jsonl"))
    parser.add_argument("--per-kind", type=int, default=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 8])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(Path(args.prompts), args.per_kind)
    common = dict(dtype=args.dtype, device=args.device, max_model_len=4096, max_num_seqs=16)
    results: dict = {"config": vars(args), "runs": []}

    base = LLM(args.model, **common)
    edits = prompts["edit"]
    bs1 = [run(base, [r])[0][0] for r in edits]
    bs8 = run(LLM(args.model, **{**common, "max_num_seqs": 8}), edits)[0]
    ngram8 = LLM(args.model, speculative_config=methods(args, 8)["ngram"], **{**common, "max_num_seqs": 8})
    bs8_ngram = run(ngram8, edits)[0]
    results["edit_accuracy"] = {"bs1": exact_match(bs1, edits), "bs8": exact_match(bs8, edits),
                                "bs8_ngram_k8": exact_match(bs8_ngram, edits),
                                "identical_bs1_bs8": bs1 == bs8 == bs8_ngram, "num_prompts": len(edits)}
    for kind in KINDS:
        _, _, elapsed = run(base, prompts[kind])
        results["runs"].append({"method": "none", "k": 0, "kind": kind, "seconds": elapsed})
    for k in args.ks:
        for name, config in methods(args, k).items():
            llm = LLM(args.model, speculative_config=config, **common)
            for kind in KINDS:
                _, delta, elapsed = run(llm, prompts[kind])
                results["runs"].append({"method": name, "k": k, "kind": kind, "seconds": elapsed, **delta})
                print(f"{name} k={k} {kind}: {table_cells(delta)}", flush=True)
    print(markdown(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


def table_cells(d: dict) -> str:
    drafts = max(1, d["num_drafts"])
    per_pos = " / ".join(f"{a / drafts:.2f}" for a in d["per_pos"])
    return f"{1 + d['num_accepted_tokens'] / drafts:.2f} | {per_pos}"


def markdown(results: dict) -> str:
    acc = results["edit_accuracy"]
    lines = [f"Edit exact match ({acc['num_prompts']} held-out edits): BS=1 {acc['bs1']:.3f}, BS=8 {acc['bs8']:.3f}, "
             f"BS=8 + ngram k=8 {acc['bs8_ngram_k8']:.3f}; outputs identical: {acc['identical_bs1_bs8']}", "",
             "| method | k | kind | mean acceptance length | acceptance per position |", "|---|---|---|---|---|"]
    for r in results["runs"]:
        if r["method"] != "none":
            lines.append(f"| {r['method']} | {r['k']} | {r['kind']} | {table_cells(r)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
