"""Output tokens/s of the embedded model with each speculative method, eager vs CUDA graphs, drafter captured vs
eager, on the held-out edit / completion / chat prompts at BS=1 and BS=16 (greedy, bf16 by default).

    python3 benchmarks/spec_speed.py --json benchmarks/results/spec_speed_h200.json

BS=1 runs --bs1-prompts prompts one at a time (max_num_seqs=1); BS=16 runs 16 prompts together. Each
configuration gets one untimed warm-up generate first. Prints a markdown table last.
"""

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_DIR

ROOT = Path(__file__).resolve().parent
KINDS = ("edit", "completion", "chat")
METHODS = {
    "none": None,
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
    "draft_model k=3": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(DEFAULT_DRAFT_MODEL_DIR)},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "eagle k=3": {"method": "eagle", "num_speculative_tokens": 3, "model": str(DEFAULT_EAGLE_DIR)},
}


def configs() -> list[tuple[str, str, dict]]:
    """(graph mode label, method, LLM kwargs)."""
    out = []
    for method, spec in METHODS.items():
        out.append(("eager", method, {"enforce_eager": True, "speculative_config": spec}))
        out.append(("graphs", method, {"speculative_config": spec}))
        if spec is not None and spec["method"] != "ngram":
            out.append(("graphs, drafter eager", method, {"speculative_config": {**spec, "enforce_eager": True}}))
    return out


def timed(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--bs1-prompts", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [json.loads(line) for line in (ROOT / "prompts" / "heldout.jsonl").read_text().splitlines()]
    by_kind = {k: [r["prompt"] for r in rows if r["kind"] == k] for k in KINDS}
    results = []
    for graphs, method, kwargs in configs():
        for bs in (1, 16):
            llm = LLM(dtype=args.dtype, device="cuda", max_model_len=2048, max_num_seqs=bs,
                      enable_prefix_caching=False, **kwargs)  # repeated prompts must not skip prefill
            llm.generate(by_kind["edit"][-2:], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
            for kind in KINDS:
                prompts = by_kind[kind][: args.bs1_prompts if bs == 1 else 16]
                before = llm.get_metrics()
                seconds, tokens = timed(llm, prompts, args.max_tokens)
                after = llm.get_metrics()
                drafts = after["num_drafts"] - before["num_drafts"] if method != "none" else 0
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"] if method != "none" else 0
                row = {"graphs": graphs, "method": method, "bs": bs, "kind": kind, "tokens": tokens,
                       "seconds": seconds, "tok_s": tokens / seconds,
                       "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                       "forwards": dict(llm.llm_engine.runner.graphs.stats)}
                results.append(row)
                print(json.dumps(row), flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "dtype": args.dtype, "max_tokens": args.max_tokens,
                                         "results": results}, indent=1))
    print(f"\n{device}, embedded model, {args.dtype}, {args.max_tokens} greedy tokens per prompt; output tok/s "
          "(mean acceptance length)\n")
    print("| graphs | method | " + " | ".join(f"BS={bs} {k}" for bs in (1, 16) for k in KINDS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in range(6)) + " |")
    for graphs, method, _ in configs():
        cells = [next(r for r in results if (r["graphs"], r["method"], r["bs"], r["kind"]) == (graphs, method, bs, k))
                 for bs in (1, 16) for k in KINDS]
        print(f"| {graphs} | {method} | " + " | ".join(f"{c['tok_s']:.0f} ({c['mean_acceptance_length']:.2f})"
                                                      for c in cells) + " |")


if __name__ == "__main__":
    main()
