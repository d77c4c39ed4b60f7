"""Ways to cut a model's output text into streamed deltas, for the parser tests (a speculative step emits
several tokens at once, so a delta may hold anything from one character to several tags)."""

import random
from collections.abc import Iterator


def cuts(text: str, seed: int = 0) -> Iterator[list[str]]:
    """Every fixed delta size 1..8, every single split point, and seeded random cuts."""
    for size in range(1, 9):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for pos in range(len(text) + 1):
        yield [text[:pos], text[pos:]]
    rng = random.Random(seed)
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
