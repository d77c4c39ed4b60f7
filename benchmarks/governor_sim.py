"""The speculation governor (spec_decode/governor.py) on synthetic step times: its throughput against always
drafting and never drafting, for drafting that pays, loses or changes, with step-time noise, and with steps in
which requests join (a prompt chunk): as costly in both modes, or costlier while drafting (a model drafter's joins,
BENCHMARKS.md session 29), or a rare long prefill. Pure Python (CPU).

    python3 benchmarks/governor_sim.py [--steps 200 2000] [--noise 0 0.05 0.15]

A scenario gives, per step, the seconds and the tokens per request of a step that drafts and of one that does not;
the ratios are those measured on the embedded model (BENCHMARKS.md, session 7, H100: ngram k=8 2.3x at BS=1 and
0.70x at BS=64, MTP k=3 0.4-0.8x, EAGLE k=3 0.21x at BS=64). The governor is driven as the engine drives it: the
decision it gives while a step runs applies to the next step. "vs best" is the governor's tokens/s over the better
fixed mode's; "vs off" over never drafting's (the promise: never below 1 by more than the cost of measuring).
"""

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from truespec.spec_decode.governor import SpeculationGovernor  # noqa: E402

# (step, drafting, rng) -> (seconds, tokens per request, whether the step is decodes / verifies only)
Cost = Callable[[int, bool, random.Random], tuple[float, float, bool]]


def ratio(speedup: float, tokens: float = 3.0) -> Cost:
    """Drafting emits ``tokens`` per request per step at ``speedup`` x the tokens/s of not drafting."""
    return lambda i, d, rng: (tokens / speedup, tokens, True) if d else (1.0, 1.0, True)


def switch(first: Cost, second: Cost, at: float) -> Cost:
    return lambda i, d, rng: first(i, d, rng) if i < at else second(i, d, rng)


def joins(decode: Cost, share: tuple[float, float], seconds: tuple[float, float]) -> Cost:
    """``decode``'s steps, except that a share of them (not drafting, drafting) hold a prompt chunk: a step of those
    seconds that emits 0.5 tokens per request."""
    return lambda i, d, rng: (seconds[d], 0.5, False) if rng.random() < share[d] else decode(i, d, rng)


SCENARIOS: dict[str, Callable[[int], Cost]] = {
    "ngram BS=1 (2.3x)": lambda n: ratio(2.3, 3.67),
    "ngram BS=64 (0.70x)": lambda n: ratio(0.70, 3.71),
    "mtp BS=16 (0.38x)": lambda n: ratio(0.38, 2.77),
    "eagle BS=64 (0.21x)": lambda n: ratio(0.21, 2.5),
    "break-even (1.0x)": lambda n: ratio(1.0),
    "slightly better (1.04x)": lambda n: ratio(1.04),
    "slightly worse (0.96x)": lambda n: ratio(0.96),
    "0.7x then 2x at half": lambda n: switch(ratio(0.7), ratio(2.0), n / 2),
    "2x then 0.7x at half": lambda n: switch(ratio(2.0), ratio(0.7), n / 2),
    "alternating every 100": lambda n: lambda i, d, rng: (ratio(2.0) if i // 100 % 2 else ratio(0.7))(i, d, rng),
    # joins: the measured MTP shape at 16 requests (verifies 1.2x, joins 8x as often and 3x as long while drafting),
    # joins as costly in both modes, a rare prefill 30 steps long in whichever mode runs, and a long prompt whose
    # chunks fill 32 steps in a row
    "1.2x, drafting's joins costlier": lambda n: joins(ratio(1.2, 2.5), (0.03, 0.125), (1.6, 5.0)),
    "break-even, drafting's joins 2x": lambda n: joins(ratio(1.0, 2.5), (0.05, 0.2), (3.0, 6.0)),
    "1.5x, joins alike": lambda n: joins(ratio(1.5, 2.5), (0.1, 0.1), (4.0, 4.0)),
    "0.8x, joins alike": lambda n: joins(ratio(0.8, 2.5), (0.1, 0.1), (4.0, 4.0)),
    "2x, a rare 30-step prefill": lambda n: joins(ratio(2.0, 2.5), (0.02, 0.02), (30.0, 30.0)),
    "1.5x, a long prompt in 32 chunk steps every 1000": lambda n: lambda i, d, rng: (
        (8.0, 0.0, False) if 500 <= i % 1000 < 532 else ratio(1.5, 2.5)(i, d, rng)),
}


def simulate(cost: Cost, num_steps: int, noise: float, seed: int = 0, num_requests: int = 8) -> float:
    """The governor's tokens per second over ``num_steps`` steps."""
    rng, now = random.Random(seed), [0.0]
    governor = SpeculationGovernor(lambda: now[0])
    drafting, seconds_total, tokens_total = True, 0.0, 0.0
    for i in range(num_steps):
        drafting, nxt = drafting, governor.is_drafting(num_requests)
        seconds, tokens, is_decode_only = cost(i, drafting, rng)
        seconds *= max(0.1, 1 + noise * rng.gauss(0, 1))
        now[0] += seconds
        seconds_total, tokens_total = seconds_total + seconds, tokens_total + tokens
        governor.observe_step(round(tokens * num_requests), num_requests, is_decode_only)
        drafting = nxt
    return tokens_total / seconds_total


def fixed(cost: Cost, num_steps: int, drafting: bool, seeds: int = 5) -> float:
    """Tokens per second always drafting (or never), over ``seeds`` runs."""
    steps = [cost(i, drafting, rng) for rng in map(random.Random, range(seeds)) for i in range(num_steps)]
    return sum(t for _, t, _ in steps) / sum(s for s, _, _ in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.05, 0.15])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print("| scenario | steps | noise | drafting vs not | governor vs best fixed | governor vs never drafting |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, make in SCENARIOS.items():
        for n in args.steps:
            cost = make(n)
            on, off = fixed(cost, n, True), fixed(cost, n, False)
            for noise in args.noise:
                rate = sum(simulate(cost, n, noise, seed) for seed in range(args.seeds)) / args.seeds
                print(f"| {name} | {n} | {noise:.2f} | {on / off:.2f} | {rate / max(on, off):.3f} | {rate / off:.3f} |")


if __name__ == "__main__":
    main()
