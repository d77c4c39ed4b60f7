"""Sparse-V on the embedded model's real attention: the decode attention kernel with the tile skip on vs off.

    python3 benchmarks/sparse_v_speed.py [--contexts 8192 32766] [--batch-size 1]
        [--kv-cache-dtypes auto turboquant_4bit_nc] [--threshold 1e-3] [--json FILE]

Per KV cache dtype, one eager engine (the embedded model, bf16, CUDA) prefills ``--batch-size`` held-out windows of
each context length (``truespec eval ppl``'s text) and decodes one token; every attention layer's call of that
decode step (``kernels.step_attention``: q, the cache, the step's metadata) is recorded. Those calls are then
replayed over the real K/V the prefill wrote, as one CUDA graph per setting (``triton.testing.do_bench_cudagraph``),
with the sparse-V threshold off and at ``--threshold``: us per step (all attention layers), the speed-up, and the
largest difference of the outputs (sparse-V is lossy against off; its quality is ``truespec eval ppl --sparse-v``).
Prints a markdown table last.
"""

import argparse
import json

import torch
import triton

from truespec import LLM, SamplingParams
from truespec.entrypoints.eval import heldout_texts, ppl_windows
from truespec.layers.backend import kernels


def record_decode_calls(llm: LLM, windows: list[list[int]]) -> list[dict]:
    """The attention calls of the decode step after prefilling ``windows`` (one per request), with their tensors
    cloned (the cache itself is kept by reference: it holds the prompts' K/V after the run)."""
    module = kernels()
    original, calls = module.step_attention, []

    def recording(q: torch.Tensor, kv_cache: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor,
                  tables: torch.Tensor, scale: float, prompt_rows: torch.Tensor | None, **kw: object
                  ) -> torch.Tensor:  # fmt: skip
        if q.shape[0] == len(windows) and int(seq_lens.min()) > len(windows[0]):  # the decode step
            calls.append(dict(args=(q.clone(), kv_cache, qsl.clone(), seq_lens.clone(), tables.clone(), scale, None),
                              fmt=kw.get("fmt")))  # fmt: skip
        return original(q, kv_cache, qsl, seq_lens, tables, scale, prompt_rows, **kw)

    module.step_attention = recording
    try:
        llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)  # fmt: skip
    finally:
        module.step_attention = original
    if not calls:
        raise RuntimeError("no decode step's attention was recorded")
    return calls


def replay(calls: list[dict], threshold: float | None) -> tuple[float, list[torch.Tensor]]:
    """us per step of the recorded calls (one CUDA graph), and their outputs."""
    def run() -> list[torch.Tensor]:
        return [kernels().step_attention(*c["args"], fmt=c["fmt"], sparse_v_threshold=threshold) for c in calls]

    outs = run()
    return triton.testing.do_bench_cudagraph(run) * 1e3, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32766])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "turboquant_4bit_nc"])
    parser.add_argument("--threshold", type=float, default=1e-3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    texts, _ = heldout_texts()
    rows = []
    for dtype in args.kv_cache_dtypes:
        for context in args.contexts:
            # several windows: one step prefills them all (no decode beside a prompt chunk), the next decodes them
            batched = {"max_num_batched_tokens": args.batch_size * context} if args.batch_size > 1 else {}
            llm = LLM(dtype="bfloat16", device="cuda", kv_cache_dtype=dtype, max_model_len=context + 2,
                      max_num_seqs=args.batch_size, enforce_eager=True, enable_prefix_caching=False, **batched)
            windows = ppl_windows(llm.get_tokenizer(), texts, context, max_windows=args.batch_size)
            if len(windows) < args.batch_size:
                raise ValueError(f"the held-out text has {len(windows)} windows of {context} tokens, not "
                                 f"--batch-size {args.batch_size}")
            calls = record_decode_calls(llm, windows)
            off_us, off = replay(calls, None)
            on_us, on = replay(calls, args.threshold)
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(off, on, strict=True))
            rows.append(dict(kv_cache_dtype=dtype, context=context, batch_size=args.batch_size, layers=len(calls),
                             off_us=off_us, on_us=on_us, speedup=off_us / on_us, max_abs_diff=diff))  # fmt: skip
            print(rows[-1], flush=True)
            del llm
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, embedded model, BS {args.batch_size}, threshold {args.threshold}: "
          "attention us per decode step (all layers)")
    print("| kv_cache_dtype | context | off us | on us | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['context']} | {r['off_us']:.1f} | {r['on_us']:.1f} | "
              f"{r['speedup']:.3f}x | {r['max_abs_diff']:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "threshold": args.threshold, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
