"""GPU smoke of the engine on the embedded model (greedy, float32, TF32 off) through the torch reference
layers and through the Triton kernels: no speculation vs each method; prints identical counts and tokens/s.

    python benchmarks/gpu_smoke.py --eagle DIR
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eagle", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = [json.loads(line) for line in (ROOT / "prompts" / "heldout.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in rows[:: max(1, len(rows) // args.num_prompts)]][: args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    common = dict(dtype="float32", device="cuda", max_model_len=2048, max_num_seqs=16)
    configs = {"none": None,
               "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2},
               "draft_model k=3": {"method": "draft_model", "model": str(DEFAULT_DRAFT_MODEL_DIR),
                                   "num_speculative_tokens": 3},
               "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3}}
    if args.eagle:
        configs["eagle k=3"] = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": 3}
    references: dict[str, list[list[int]]] = {}
    print(f"device: {torch.cuda.get_device_name()}")
    for backend in ("torch", "triton"):
        os.environ["TRUESPEC_BACKEND"] = backend
        for name, config in configs.items():
            llm = LLM(str(DEFAULT_MODEL_DIR), speculative_config=config, **common)
            llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            elapsed = time.perf_counter() - start
            references.setdefault(backend, outs)
            same = sum(a == b for a, b in zip(outs, references[backend], strict=True))
            vs_torch = sum(a == b for a, b in zip(outs, references["torch"], strict=True))
            m = llm.get_metrics()
            print(f"{backend:6s} {name:16s} identical to no-spec {same}/{len(prompts)}, to torch no-spec "
                  f"{vs_torch}/{len(prompts)}  {sum(map(len, outs)) / elapsed:8.1f} tok/s  "
                  f"mean acceptance length {m['mean_acceptance_length']:.2f}", flush=True)


if __name__ == "__main__":
    main()
