"""Whether a step drafts at all: the speculation governor, from measured throughput.

The draft-length policy (draft_length.py) sizes each request's drafts from its acceptance, at a fixed guessed cost
per drafted position. What a step really costs depends on the batch: a verify of 64 x 9 rows is compute-bound where
a 64-row decode is not, and on a small launch-bound target a drafter step can cost more than the tokens it saves.
So the governor measures. After each step the engine reports its wall time (from the end of the previous step:
with async scheduling steps overlap, and the interval between step completions is what each one costs), the tokens
it emitted and its number of requests; the governor keeps, per batch-size bucket, decayed estimates of tokens per
request-second with drafting on and with drafting off, and lets a bucket's steps draft only while that pays.

- Buckets are centred on the powers of two of the running requests (1, 2, 3-5, 6-11, ..., 46-90, 91-181: the
  nearest power of two on a log scale): whether drafting pays moves with the batch's scale (memory-bound decode ->
  compute-bound verify), not with one request more or less; doubling buckets keep them few (9 up to 256 requests),
  so each is measured often. Centred, because a full batch hovers just under its ``max_num_seqs``, usually a power
  of two (63 / 64 while requests finish and others join), and a step whose neighbours ran in another bucket is
  never counted (below): edges there would leave such a batch unmeasured. A step also stays in the previous step's
  bucket while its count is within ``BUCKET_SLACK`` (log2 units) past that bucket's edge. Within a bucket, rates are
  per request (tokens / (requests x seconds)): where a step's time hardly depends on the batch (memory-bound), that
  compares samples of different sizes fairly; where it grows with the batch, samples of different sizes differ by
  up to their size ratio (under 2 in a bucket); the decay keeps both estimates recent, so mostly measured at
  similar sizes.
- A sample counts only when the step and both its neighbours ran in the same bucket and mode: a step's interval
  holds its own verify and the drafting for the next one (or, queued ahead, the previous step's tail), so the
  steps beside a switch mix both modes.
- Steps with a prompt chunk (a request joining, or a preempted one's recompute) count too: with a model drafter a join
  costs more while drafting (the drafter catches up on the prompt and drafts for the whole batch, one forward per
  launch rather than one graph replay), and requests that accept different numbers of drafts finish apart, so they
  join one by one, in more such steps (BENCHMARKS.md, session 29: at 64 requests with MTP, 64% of the drafting time
  was in steps the governor did not count then). Such steps in a row (a join, or one long prompt's chunks) are one
  sample, counted when the run ends, at most ``PROMPT_STEP_CAP`` typical decode / verify steps of its mode long (a
  moving mean, decayed x0.9 per sample), so that one long prompt, which costs the same in both modes and falls in
  whichever runs, does not decide alone; a join before the mode's first decode / verify sample in the bucket is not
  counted. Joins are rare and costly, so they are kept apart: per mode, decayed x``PROMPT_DECAY`` per sample of the
  mode, their tokens and request-seconds and their share of the mode's samples; a mode's rate mixes its decode /
  verify samples' (decayed as below) with theirs at that share. They never end a measurement or switch a mode by
  themselves (``benchmarks/governor_sim.py``, 3000 steps: with joins as costly in both modes, 1.0x of the better fixed
  mode; with joins costlier while drafting, 0.98-1.0x where counting only decode / verify steps gave 0.82-0.96x).
- A bucket not measured yet drafts (as configured: a bucket whose steps all hold prompt chunks is never
  measured). Its first counted samples give each mode a first estimate (2 samples each, drafting first); from then
  on the bucket keeps the mode it chose, and measures the other for ``EXPLORE_STEPS`` counted samples (2 if it is
  clearly ahead or behind: ``CLEAR_LOSS``) every ``interval`` x (how many times longer its steps take, 1 to 4)
  counted samples. The other takes over if it is ``MARGIN`` faster, or when the chosen mode's estimate falls
  ``MARGIN`` below its own. The interval starts at 32 (128 after a clear loss) and doubles while the other keeps
  losing (x4 on a clear loss), up to 256. So measuring a losing mode costs a few % of the time
  (``benchmarks/governor_sim.py``: within 5% of the better fixed mode over 3000 steps, 13% over 300, when
  drafting runs at 0.21x to 2.3x the speed of not drafting), and a regime change (acceptance rises, a batch that
  is no longer compute-bound) is found within 1024 counted steps. The decode / verify estimates decay per counted
  sample of the bucket (x0.9), so a measurement taken long ago speaks only for itself.

The governor only gates: when a bucket drafts, each request's draft length still comes from draft_length.py;
when it does not, every greedy request of the step drafts nothing (the drafters still catch up). A greedy token
never depends on drafts, so the governor changes no token. A random request's drafts change which sample it draws
(not the distribution), so it is not gated: a seeded request stays reproducible and independent of its batch and of
timing (llm_engine._draft_gate). Plain Python; the clock is injected (tests feed synthetic step times).
"""

import math
import time
from collections.abc import Callable

DECAY = 0.9  # weight a sample keeps per later counted sample of its bucket
MARGIN = 0.03  # the mode in use keeps its place unless the other is this much faster
EXPLORE_STEPS = 4  # counted samples of a mode per measurement
CLEAR_LOSS, CLEAR_LOSS_STEPS = 0.8, 2  # a measurement ends after 2 samples if this far behind (or 1/0.8 ahead)
EXPLORE_INTERVAL_MIN, EXPLORE_INTERVAL_MAX = 32, 256  # counted samples between two measurements of the other mode
MAX_COST_RATIO = 4  # ... times how many times longer its steps take (at most this): measuring costs less time
BUCKET_SLACK = 0.25  # a step stays in the previous step's bucket this far (log2) past its edge: 46-90 keeps 39-107
PROMPT_STEP_CAP = 3.0  # a join (steps with prompt chunks in a row) counts at most this many typical steps
PROMPT_DECAY = 0.98  # weight a prompt-chunk statistic keeps per later sample of its mode

Decision = tuple[int, bool]  # (bucket, drafting) given to a step


def bucket_of(num_requests: int) -> int:
    """The nearest power of two's exponent on a log scale: 0 for 1 request, 1 for 2, 2 for 3-5, 3 for 6-11, ...
    (log2 of a count is never exactly halfway)."""
    return round(math.log2(max(num_requests, 1)))


def is_near_bucket(num_requests: int, bucket: int) -> bool:
    """Whether a step of ``num_requests`` may stay in ``bucket``: within BUCKET_SLACK past its edges."""
    return abs(math.log2(max(num_requests, 1)) - bucket) <= 0.5 + BUCKET_SLACK


def bucket_name(bucket: int) -> str:
    lo, hi = max(1, math.ceil(2 ** (bucket - 0.5))), math.floor(2 ** (bucket + 0.5))
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


class _Bucket:
    __slots__ = ("mode", "chosen", "tokens", "seconds", "weights", "seen_at", "step", "run", "since", "interval",
                 "step_seconds", "prompt")

    def __init__(self) -> None:
        self.mode = self.chosen = True  # drafting now; the mode chosen (they differ while the other is measured)
        self.tokens, self.seconds = [0.0, 0.0], [0.0, 0.0]  # decayed tokens and request-seconds, by drafting
        self.weights = [0.0, 0.0]  # decayed number of samples
        self.step_seconds: list[float | None] = [None, None]  # a decode / verify step's wall seconds (moving mean)
        # per mode, slowly decayed: prompt-chunk samples' tokens, request-seconds and count, and all samples' count
        self.prompt = [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
        self.seen_at = [0, 0]  # the step of the bucket at which each mode's estimate was last updated
        self.step = 0  # counted samples of the bucket
        self.run = 0  # counted samples of the current mode since it began
        self.since = 0  # counted samples of the chosen mode since the other was last measured
        self.interval = EXPLORE_INTERVAL_MIN

    def add(self, mode: bool, num_tokens: int, request_seconds: float) -> None:
        w = DECAY ** (self.step - self.seen_at[mode])
        self.tokens[mode] = self.tokens[mode] * w + num_tokens
        self.seconds[mode] = self.seconds[mode] * w + request_seconds
        self.weights[mode] = self.weights[mode] * w + 1.0
        self.seen_at[mode], self.step = self.step, self.step + 1

    def add_to_share(self, mode: bool, num_tokens: int, request_seconds: float, is_prompt: bool) -> None:
        p = self.prompt[mode]
        p[:] = [x * PROMPT_DECAY for x in p]
        if is_prompt:
            p[0], p[1], p[2] = p[0] + num_tokens, p[1] + request_seconds, p[2] + 1.0
        p[3] += 1.0

    def add_decode_step(self, mode: bool, seconds: float) -> None:
        mean = self.step_seconds[mode]
        self.step_seconds[mode] = seconds if mean is None else DECAY * mean + (1 - DECAY) * seconds

    def typical_step(self, mode: bool) -> float | None:
        """A decode / verify step's wall seconds in ``mode`` (None: none measured yet)."""
        return self.step_seconds[mode]

    def rate(self, mode: bool) -> float:
        """Tokens per request-second: the decode / verify samples' (quickly decayed), mixed with the prompt-chunk
        samples' at their share of the mode's samples (slowly decayed: they are rare and costly)."""
        tokens, seconds = self.tokens[mode] / self.weights[mode], self.seconds[mode] / self.weights[mode]
        p_tokens, p_seconds, p_count, count = self.prompt[mode]
        if p_count:
            share = p_count / count
            tokens = (1 - share) * tokens + share * p_tokens / p_count
            seconds = (1 - share) * seconds + share * p_seconds / p_count
        return tokens / seconds

    def cost_ratio(self, mode: bool) -> float:
        """How many steps of the other mode one step of ``mode`` takes, 1 to MAX_COST_RATIO."""
        ratio = self.seconds[mode] / self.weights[mode] * self.weights[not mode] / self.seconds[not mode]
        return min(max(ratio, 1.0), MAX_COST_RATIO)

    def switch(self, mode: bool) -> None:
        self.mode, self.run = mode, 0


class SpeculationGovernor:
    """Per batch-size bucket, drafting on or off by measured throughput (the module docstring says how)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._last_end: float | None = None  # when the previous step ended (None: unknown, after an idle engine)
        # the decisions given to the previous step, the step now reported and the step after it
        self._prev: Decision | None = None
        self._cur: Decision | None = None
        self._next: Decision | None = None
        self.num_steps_off = 0  # steps the governor turned drafting off for
        # consecutive counted steps with prompt chunks, one sample when the run ends: (bucket, mode, tokens,
        # request-seconds, requests of its last step)
        self._join: tuple[int, bool, int, float, int] | None = None

    def is_drafting(self, num_running: int) -> bool:
        """Whether the next step drafts, with ``num_running`` requests running. The same answer until the next
        ``observe_step``: the engine asks it (per request) while planning the step after the one it reports next."""
        last = self._cur or self._prev  # the bucket of the step now running (or of the one before it)
        bucket = last[0] if last is not None and is_near_bucket(num_running, last[0]) else bucket_of(num_running)
        b = self._buckets.get(bucket)
        mode = b is None or b.mode  # a bucket not measured yet drafts (as configured)
        self._next = (bucket, mode)
        return mode

    def observe_step(self, num_tokens: int, num_requests: int, is_decode_only: bool) -> None:
        """A step ended now: it emitted ``num_tokens`` over its ``num_requests`` requests; ``is_decode_only``: no
        request of it computed a prompt chunk (or recomputed after preemption): such a step counts capped."""
        now, last = self.clock(), self._last_end
        self._last_end = now
        prev, cur, nxt = self._prev, self._cur, self._next
        self._prev, self._cur, self._next = cur, nxt, None
        if cur is not None and not cur[1]:
            self.num_steps_off += 1
        if last is None or now <= last or cur is None or not prev == cur == nxt \
                or not is_near_bucket(num_requests, cur[0]):
            return
        seconds, join = now - last, self._join
        if not is_decode_only:  # a prompt chunk's step: part of a join, counted when the join ends
            if join is not None and join[:2] != cur:
                self._end_join()
                join = None
            tokens, request_seconds = (join[2], join[3]) if join is not None else (0, 0.0)
            self._join = (*cur, tokens + num_tokens, request_seconds + num_requests * seconds, num_requests)
            return
        self._end_join()
        self._learn(cur[0], cur[1], num_tokens, num_requests * seconds, seconds)

    def _end_join(self) -> None:
        """Count the run of prompt-chunk steps just ended as one sample of its bucket and mode, at most
        ``PROMPT_STEP_CAP`` typical steps long (none yet: not counted)."""
        join, self._join = self._join, None
        b = self._buckets.get(join[0]) if join is not None else None
        typical = b.typical_step(join[1]) if b is not None else None
        if typical is not None:
            _, mode, tokens, request_seconds, num_requests = join
            b.add_to_share(mode, tokens, min(request_seconds, PROMPT_STEP_CAP * typical * num_requests), True)

    def pause(self) -> None:
        """The engine had nothing to run: the next step's interval is not its cost (a join in progress ends)."""
        self._last_end = None
        self._end_join()

    def _learn(self, bucket: int, mode: bool, num_tokens: int, request_seconds: float, seconds: float) -> None:
        """A counted decode / verify step of ``seconds`` (``request_seconds`` over its requests) in ``mode``."""
        b = self._buckets.get(bucket)
        if b is None:
            b = self._buckets[bucket] = _Bucket()
        if mode != b.mode:  # cannot happen (a switch drops the steps beside it); never learn from it
            return
        b.add(mode, num_tokens, request_seconds)
        b.add_decode_step(mode, seconds)
        b.add_to_share(mode, num_tokens, request_seconds, False)
        b.run += 1
        other = not mode
        if mode != b.chosen:  # measuring the other mode: it takes over only if clearly faster
            ratio = b.rate(mode) / b.rate(other)
            is_clear = b.run >= CLEAR_LOSS_STEPS and not CLEAR_LOSS <= ratio <= 1 / CLEAR_LOSS
            if b.run >= EXPLORE_STEPS or is_clear:
                b.since = 0
                if ratio > 1 + MARGIN:  # the loser is measured again soon, later if it lost clearly
                    b.chosen, b.interval = mode, EXPLORE_INTERVAL_MIN * (4 if is_clear else 1)
                else:
                    b.interval = min((4 if is_clear else 2) * b.interval, EXPLORE_INTERVAL_MAX)
                    b.switch(other)
            return
        b.since += 1
        if not b.weights[other]:  # a new bucket: a first estimate of each mode, then their measurements decide
            if b.run >= CLEAR_LOSS_STEPS:
                b.switch(other)
            return
        if b.run < EXPLORE_STEPS:
            return
        if b.since >= b.interval * b.cost_ratio(other):  # measure the other mode
            b.switch(other)
        elif b.rate(mode) * (1 + MARGIN) < b.rate(other):  # the chosen mode fell behind
            b.chosen, b.since, b.interval = other, 0, EXPLORE_INTERVAL_MIN
            b.switch(other)

    def as_dict(self) -> dict[str, object]:
        """Metrics: ``num_steps_drafting_off``; per bucket measured, whether it chose drafting and its estimates
        (tokens per request-second with and without drafts; None before a first sample)."""
        def rate(b: _Bucket, mode: bool) -> float | None:
            return b.rate(mode) if b.weights[mode] else None

        buckets = sorted(self._buckets.items())
        return {"num_steps_drafting_off": self.num_steps_off,
                "governor_drafting": {bucket_name(k): b.chosen for k, b in buckets},
                "governor_rates": {bucket_name(k): {"drafting": rate(b, True), "not_drafting": rate(b, False)}
                                   for k, b in buckets}}
