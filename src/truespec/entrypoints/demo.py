"""``truespec demo``: the embedded model completes a function and applies an edit, with and without
speculation, and shows that the tokens are the same while fewer target steps are needed."""

import sys
import time

from truespec.llm import LLM
from truespec.sampling_params import SamplingParams
from truespec.training.tokenizer import format_edit

# A held-out stdlib pattern (benchmarks/prompts/heldout.jsonl): a 6M-parameter model completes what it has seen
# the shape of; on free-form functions it soon repeats itself.
COMPLETION = ("import codecs\n\n### Codec APIs\n\nclass Codec(codecs.Codec):\n\n"
              "    def encode(self,input,errors='strict'):\n")
ORIGINAL = '''def parse_pairs(text, sep="="):
    """Split lines of 'key=value' into a dict."""
    result = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split(sep, 1)
        result[key.strip()] = value.strip()
    return result
'''
EDIT = format_edit(ORIGINAL, "rename result to pairs\n")
RUNS = [("completion", COMPLETION, {"method": "mtp", "num_speculative_tokens": 3}),
        ("edit", EDIT, {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2})]


def run_demo(device: str = "auto", max_tokens: int = 160) -> int:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    plain = LLM(device=device)
    for name, prompt, config in RUNS:
        fast = LLM(device=device, speculative_config=config)
        base_out, base_s = _timed(plain, prompt, params)
        spec_out, spec_s = _timed(fast, prompt, params)
        m = fast.get_metrics()
        print(f"=== {name}: {config['method']} k={config['num_speculative_tokens']} ===")
        print(spec_out.text)
        print(f"[{len(spec_out.token_ids)} tokens | no speculation {len(base_out.token_ids) / base_s:.0f} tok/s | "
              f"{config['method']} {len(spec_out.token_ids) / spec_s:.0f} tok/s | mean acceptance length "
              f"{m['mean_acceptance_length']:.2f} | identical tokens: {spec_out.token_ids == base_out.token_ids}]\n")
    return 0


def _timed(llm: LLM, prompt: str, params: SamplingParams) -> tuple[object, float]:
    start = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    return out, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(run_demo())
