"""Where a decode step's GPU time goes: torch.profiler over eager decode steps (the kernels a graph replays are
the same), grouped by kernel, per step. ``--prefill``: the steps that compute the prompts instead (every chunk of
one batch of ``--input-len``-token prompts, after an untimed warm-up prefill), per prefill.

    python3 benchmarks/profile_step.py --model DIR [--batch-size 1] [--input-len 512] [--steps 16] [--prefill]
"""

import argparse
import time

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
    parser.add_argument("--prefill", action="store_true", help="profile the prompts' steps, not decode steps")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, device="cuda", enforce_eager=True,
              max_model_len=max(4096, args.input_len + args.steps + 8),
              max_num_seqs=args.batch_size, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 2000, (args.input_len,), generator=gen).tolist()}
               for _ in range(args.batch_size)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True,
                                             output_kind=FINAL_ONLY))
    def prefilling() -> bool:
        return any(s.num_computed_tokens < s.prompt_len for s in engine.seqs.values())

    if not args.prefill:
        while prefilling():
            engine.step()  # every prefill chunk, outside the profile
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if args.prefill:
            while prefilling():
                engine.step()
        else:
            for _ in range(args.steps):
                engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    per = 1 if args.prefill else args.steps  # the table's unit: one prefill of the batch, or one decode step
    while engine.has_unfinished_requests():
        engine.step()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events)
    unit = "prefill" if args.prefill else "decode step"
    print(f"{torch.cuda.get_device_name()}, BS={args.batch_size}, context {args.input_len}: GPU kernel time per "
          f"{unit} {total / per / 1000:.3f} ms (wall under the profiler {1e3 * wall / per:.3f} ms), kernels per "
          f"{unit} {sum(e.count for e in events) / per:.0f}\n")
    print(f"| kernel | per {unit} (us) | share | launches |\n|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:24]:
        print(f"| {e.key[:70]} | {e.device_time_total / per:.1f} | {e.device_time_total / total:.1%} "
              f"| {e.count / per:.0f} |")


if __name__ == "__main__":
    main()
