"""Where a decode step's GPU time goes: torch.profiler over eager decode steps (the kernels a graph replays are
the same), grouped by kernel, per step.

    python3 benchmarks/profile_step.py --model DIR [--batch-size 1] [--input-len 512] [--steps 16]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from truespec import LLM, RequestOutputKind, SamplingParams

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # as LLM.generate: no per-step outputs to build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, device="cuda", enforce_eager=True, max_model_len=4096,
              max_num_seqs=args.batch_size, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 2000, (args.input_len,), generator=gen).tolist()}
               for _ in range(args.batch_size)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True,
                                             output_kind=FINAL_ONLY))
    while any(s.num_computed_tokens < s.prompt_len for s in engine.seqs.values()):
        engine.step()  # every prefill chunk, outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events)
    print(f"{torch.cuda.get_device_name()}, BS={args.batch_size}, context {args.input_len}: GPU kernel time per "
          f"decode step {total / args.steps / 1000:.3f} ms, kernels per step "
          f"{sum(e.count for e in events) / args.steps:.0f}\n")
    print("| kernel | per step (us) | share | launches per step |\n|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:18]:
        print(f"| {e.key[:70]} | {e.device_time_total / args.steps:.1f} | {e.device_time_total / total:.1%} "
              f"| {e.count / args.steps:.0f} |")


if __name__ == "__main__":
    main()
