"""The most a speculative method can gain: tokens per decode step on the held-out edit prompts, at batch size 1.

    python3 benchmarks/spec_tokens_per_step.py [--methods mtp eagle draft_model] [--prompts 24] [--max-tokens 128]
        [--dtype float32] [--device cpu]

Runs the ``spec_vs_none.py`` workload (greedy, ``ignore_eos``) one request at a time with ``draft_length`` "fixed"
(every step drafts k) and "adaptive" (the default), and prints the tokens each decode step emitted (prefill steps
left out) with the engine's draft counters. A method's speedup over no speculation is at most this number (a
verify step costs at least one plain decode step); the acceptance is the drafter's, so the CPU's float32 answer is
close to a GPU's bf16 one.
"""

import argparse
import json

from spec_vs_none import METHODS, PROMPTS

from truespec import LLM, SamplingParams

KEYS = ("num_steps", "num_steps_without_drafts", "num_drafts", "num_draft_tokens", "num_accepted_tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", nargs="+", default=["mtp", "eagle", "draft_model"])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [r["prompt"] for r in rows if r["kind"] == "edit"][:args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for method in args.methods:
        spec = METHODS[f"{method} k={args.k}"]
        for draft_length in ("fixed", "adaptive"):
            llm = LLM(dtype=args.dtype, device=args.device, max_num_seqs=1,
                      speculative_config=spec | {"draft_length": draft_length})
            outs = llm.generate(prompts, params, use_tqdm=False)
            m = llm.get_metrics()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs) - len(prompts)  # after each prompt's step
            per_step = tokens / (m["num_steps"] - len(prompts))
            print(f"{method} k={args.k} {draft_length}: {per_step:.3f} tokens per decode step",
                  {k: m[k] for k in KEYS}, flush=True)


if __name__ == "__main__":
    main()
