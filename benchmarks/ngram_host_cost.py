"""Host time of the ngram proposer per decode step: the full backward scan it replaced (``ScanNgramProposer``)
against the incremental index (``NgramProposer``), same process, same token streams. Runs on CPU.

    python3 benchmarks/ngram_host_cost.py [--batch-sizes 1 16 64] [--context-lens 2048 8192] [--steps 50]

Each request's context is a window of the held-out prompts (benchmarks/prompts/heldout.jsonl) tokenized with
the embedded model's tokenizer and concatenated, as long as the context (wrapping around the stream); every step
then appends the next ``--tokens-per-step`` tokens of the stream to its output (a decode step verifying ~3
accepted drafts). The index is built on a request's first drafting step (timed apart: "build"); the table gives
the median of the following steps. Both proposers must return the same drafts at every step.
"""

import argparse
import json
import os
import platform
import statistics
import time
import tracemalloc
from pathlib import Path

from transformers import AutoTokenizer

from truespec.assets import DEFAULT_MODEL_DIR
from truespec.sampling_params import SamplingParams
from truespec.spec_decode.interface import DraftRequest, Drafts
from truespec.spec_decode.ngram import NgramProposer
from truespec.worker.runner_output import ModelRunnerOutput

PROMPTS = Path(__file__).parent / "prompts" / "heldout.jsonl"


class ScanNgramProposer:
    """The proposer before the index: the whole history, copied and scanned backwards for each n, every step."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                finished_req_ids: list[str]) -> dict[str, Drafts]:
        return {r.request_id: Drafts(self.lookup(r.prompt_token_ids + r.output_token_ids, r.max_drafts))
                for r in requests if r.is_drafting}

    def lookup(self, token_ids: list[int], max_drafts: int) -> list[int]:
        limit = min(self.k, max_drafts)
        if limit <= 0:
            return []
        n_tokens = len(token_ids)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[n_tokens - n:]
            start = _last_occurrence(token_ids, suffix, end=n_tokens - n)
            if start is not None:
                follow = start + n
                return token_ids[follow:follow + limit]
        return []


def _last_occurrence(tokens: list[int], pattern: list[int], end: int) -> int | None:
    first = pattern[0]
    n = len(pattern)
    for start in range(end - 1, -1, -1):
        if tokens[start] == first and tokens[start:start + n] == pattern:
            return start
    return None


def token_stream() -> list[int]:
    """The held-out prompts, tokenized and concatenated."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    stream: list[int] = []
    for line in PROMPTS.read_text().splitlines():
        stream += tokenizer.encode(json.loads(line)["prompt"])
    return stream


def window(stream: list[int], start: int, length: int) -> list[int]:
    """``length`` tokens of the stream from ``start``, wrapping around."""
    return [stream[(start + i) % len(stream)] for i in range(length)]


def time_steps(proposer: object, stream: list[int], batch_size: int, context_len: int, steps: int,
               tokens_per_step: int, k: int) -> tuple[float, list[float], list[dict[str, Drafts]]]:
    """(seconds of the first step, seconds of each later step, each step's drafts)."""
    stride = len(stream) // batch_size
    prompts = [window(stream, i * stride, context_len) for i in range(batch_size)]
    outputs: list[list[int]] = [[] for _ in range(batch_size)]
    times, drafts = [], []
    for _ in range(steps + 1):
        for i, output in enumerate(outputs):
            output += window(stream, i * stride + context_len + len(output), tokens_per_step)
        requests = [DraftRequest(f"r{i}", SamplingParams(), prompts[i], outputs[i], 0, 0, i, [], 0, True, k)
                    for i in range(batch_size)]
        start = time.perf_counter()
        drafts.append(proposer.propose(requests, None, []))
        times.append(time.perf_counter() - start)
    return times[0], times[1:], drafts


def bytes_per_token(stream: list[int], context_len: int, min_n: int, max_n: int) -> float:
    """What the index holds for one request (token list, hash chains), per token: tracemalloc's count."""
    prompt, proposer = window(stream, 0, context_len), NgramProposer(4, min_n, max_n)
    request = DraftRequest("r", SamplingParams(), prompt, [], 0, 0, 0, [], 0, True, 4)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    proposer.propose([request], None, [])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / context_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--lookups", nargs="+", default=["5-5", "2-5"], help="prompt_lookup_min-max pairs")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tokens-per-step", type=int, default=4)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    args = parser.parse_args()
    stream = token_stream()
    print(f"ngram proposer host time per step (CPU: {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}); {len(stream)} held-out tokens, k={args.k}, {args.tokens_per_step} "
          f"tokens appended per request per step, median of {args.steps} steps after the first; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start\n")
    print("| n (min-max) | batch | context | scan µs/step | index µs/step | scan µs/req | index µs/req | speedup "
          "| index build µs/req (first step) | index bytes/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lookup in args.lookups:
        min_n, max_n = map(int, lookup.split("-"))
        for context_len in args.context_lens:
            mem = bytes_per_token(stream, context_len, min_n, max_n)
            for batch_size in args.batch_sizes:
                run = (stream, batch_size, context_len, args.steps, args.tokens_per_step, args.k)
                _, scan, scan_drafts = time_steps(ScanNgramProposer(args.k, min_n, max_n), *run)
                build, index, index_drafts = time_steps(NgramProposer(args.k, min_n, max_n), *run)
                assert [{i: d.token_ids for i, d in s.items()} for s in scan_drafts] == \
                    [{i: d.token_ids for i, d in s.items()} for s in index_drafts], "the drafts differ"
                old, new = statistics.median(scan) * 1e6, statistics.median(index) * 1e6
                print(f"| {min_n}-{max_n} | {batch_size} | {context_len} | {old:.0f} | {new:.0f} | "
                      f"{old / batch_size:.1f} | {new / batch_size:.1f} | {old / new:.0f}x | "
                      f"{build * 1e6 / batch_size:.0f} | {mem:.0f} |")


if __name__ == "__main__":
    main()
