"""The speculation governor (spec_decode/governor.py): per batch-size bucket, a step drafts only while drafting's
measured throughput beats not drafting's; it explores the other mode now and then, so a regime change brings
drafting back; joins (steps with prompt chunks in a row) count apart and capped, idle gaps not at all. In the engine
it only gates drafts, so the tokens are those without speculation and those with the governor off, with ngram and
MTP, host-planned and queued ahead."""

import random
from collections.abc import Callable

import pytest

from helpers.heldout import flip_every, heldout_reference
from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.config import SpeculativeConfig
from truespec.spec_decode.governor import (
    EXPLORE_INTERVAL_MAX,
    EXPLORE_STEPS,
    SpeculationGovernor,
    bucket_name,
    bucket_of,
)

Cost = Callable[[int, bool], tuple[float, float]]  # (step, drafting) -> (seconds, tokens per request)


def pays(step: int, drafting: bool) -> tuple[float, float]:
    return (1.3, 2.6) if drafting else (1.0, 1.0)  # 2x the tokens per second


def loses(step: int, drafting: bool) -> tuple[float, float]:
    return (1.5, 1.05) if drafting else (1.0, 1.0)  # 0.7x: a compute-bound verify


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Steps:
    """Drives a governor as the engine does: the decision it gives while a step runs (the engine plans the next
    step before the governor hears of this one) applies to the next step."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.governor = SpeculationGovernor(self.clock)
        self.drafting = False  # the first step (a prefill in the engine): nobody asked before it
        self.num_steps = 0

    def run(self, n: int, cost: Cost, num_requests: int = 8, is_decode_only: bool = True) -> list[bool]:
        """Run ``n`` steps; whether each drafted."""
        modes = []
        for _ in range(n):
            drafting, self.drafting = self.drafting, self.governor.is_drafting(num_requests)
            seconds, tokens = cost(self.num_steps, drafting)
            self.clock.now += seconds
            self.governor.observe_step(round(tokens * num_requests), num_requests, is_decode_only)
            modes.append(drafting)
            self.num_steps += 1
        return modes


def runs(modes: list[bool], value: bool) -> list[int]:
    """Lengths of the runs of ``value`` in ``modes``."""
    lengths, n = [], 0
    for m in [*modes, not value]:
        if m == value:
            n += 1
        elif n:
            lengths.append(n)
            n = 0
    return lengths


def test_buckets_are_centred_on_powers_of_two_of_the_running_requests() -> None:
    counts = (1, 2, 3, 4, 5, 6, 11, 12, 45, 46, 63, 64, 90, 91)
    assert [bucket_of(n) for n in counts] == [0, 1, 2, 2, 2, 3, 3, 4, 5, 6, 6, 6, 6, 7]
    assert [bucket_name(b) for b in (0, 1, 2, 3, 6)] == ["1", "2", "3-5", "6-11", "46-90"]


@pytest.mark.parametrize("counts", [(63, 64), (45, 46), (44, 47)])
def test_a_batch_hovering_at_a_bucket_edge_is_still_measured(counts: tuple[int, int]) -> None:
    """A full batch of 64 runs 63 requests whenever one finished before the next joined; one hovering at a
    bucket's edge (45 / 46) stays in its first step's bucket. Alternating buckets would leave no step whose
    neighbours share its bucket: nothing measured, drafting never turned off."""
    steps, modes = Steps(), []
    for i in range(1000):
        modes += steps.run(1, loses, num_requests=counts[i % 2])
    assert sum(modes) <= 0.1 * len(modes), sum(modes)
    assert len(steps.governor.as_dict()["governor_drafting"]) == 1


def test_slower_drafting_is_turned_off_soon_and_stays_mostly_off() -> None:
    steps = Steps()
    modes = steps.run(2000, loses)
    # after the first step (no decision: a prefill in the engine), a new bucket drafts, then measures not drafting
    assert modes[1] and runs(modes, True)[0] <= EXPLORE_STEPS + 2, modes[:20]
    assert sum(modes) <= 0.05 * len(modes), sum(modes)  # exploring costs a few % of the steps
    assert max(runs(modes, True)) <= EXPLORE_STEPS + 2  # each exploration is short
    late = modes[1000:]
    assert sum(late) <= 0.03 * len(late)  # ... and rarer as drafting keeps losing
    # the first step ran before any decision (in the engine, a prefill)
    metrics = steps.governor.as_dict()
    assert {k: metrics[k] for k in ("num_steps_drafting_off", "governor_drafting")} == {
        "num_steps_drafting_off": len(modes) - sum(modes) - 1, "governor_drafting": {"6-11": False}}
    # the estimates it decided by, per request-second: drafting round(8 x 1.05) tokens / (8 x 1.5 s), not drafting
    # 8 / (8 x 1 s)
    rates = metrics["governor_rates"]["6-11"]
    assert rates["drafting"] == pytest.approx(8 / 12) and rates["not_drafting"] == pytest.approx(1.0)


def test_paying_drafting_stays_on_apart_from_exploration() -> None:
    modes = Steps().run(2000, pays)
    modes = modes[1:]  # the first step: no decision (a prefill in the engine)
    assert sum(not m for m in modes) <= 0.05 * len(modes)
    assert max(runs(modes, False)) <= EXPLORE_STEPS + 2  # off only while not drafting is measured
    gaps = runs(modes[100:], True)
    assert min(gaps[:-1]) >= 32 and max(gaps) <= EXPLORE_INTERVAL_MAX + EXPLORE_STEPS + 4, gaps


@pytest.mark.parametrize("noise", [0.05, 0.15])
def test_noisy_step_times_still_pick_the_faster_mode(noise: float) -> None:
    """Step times jittering by 5-15% (a shared GPU, host hiccups) with drafting 2x or 0.7x."""
    rng = random.Random(0)

    def noisy(cost: Cost) -> Cost:
        return lambda i, d: (cost(i, d)[0] * (1 + noise * rng.gauss(0, 1)), cost(i, d)[1])

    assert sum(Steps().run(2000, noisy(pays))) >= 0.9 * 2000
    assert sum(Steps().run(2000, noisy(loses))) <= 0.1 * 2000


def test_drafting_comes_back_within_the_exploration_cap_when_it_starts_paying() -> None:
    steps = Steps()
    steps.run(3000, loses)  # long enough for the exploration interval to reach its cap
    modes = steps.run(1000, pays)
    back = next(i for i in range(len(modes)) if all(modes[i:i + 100]))
    # drafting's steps took 1.5x as long: it is re-measured every 1.5 x 256 counted steps at most
    assert back <= 1.5 * EXPLORE_INTERVAL_MAX + 2 * EXPLORE_STEPS + 4, back
    assert all(modes[back:back + 100]) and sum(modes[back:]) >= 0.95 * len(modes[back:])


def test_drafting_stops_soon_when_it_stops_paying() -> None:
    """The mode in use falls behind the other's estimate: no need to wait for an exploration."""
    steps = Steps()
    steps.run(3000, pays)
    modes = steps.run(300, loses)
    # its estimate, decayed x0.9 per sample, falls from 2x to below the other's (0.97x: the margin) in 14 samples
    assert modes.index(False) <= 14 + 3 and sum(modes) <= 0.1 * len(modes)


def test_batch_size_buckets_are_independent() -> None:
    """Drafting pays for 1 request and loses for 64: each bucket finds its own mode."""
    steps, small, large = Steps(), [], []
    for _ in range(40):
        small += steps.run(50, pays, num_requests=1)
        large += steps.run(50, loses, num_requests=64)
    assert sum(small) >= 0.9 * len(small) and sum(large) <= 0.1 * len(large)
    assert steps.governor.as_dict()["governor_drafting"] == {"1": True, "46-90": False}


def test_idle_gaps_are_not_measured_and_a_join_counts_capped() -> None:
    """Drafting pays, while every 21st step holds a prompt chunk that takes 100 s when drafting and 1 s when not,
    and every idle gap 1000 s: counted whole, they would turn drafting off; the gaps are not counted, the joins
    capped at 3 typical steps and mixed in at their share, so drafting still pays. Joins before any decode sample
    are not counted (nothing to cap them by)."""
    steps = Steps()
    steps.run(50, lambda i, d: (100.0, 1.0) if d else (1.0, 1.0), is_decode_only=False)
    assert steps.governor.as_dict()["governor_drafting"] == {}  # nothing learned
    modes = []
    for _ in range(40):
        modes += steps.run(20, pays)
        modes += steps.run(1, lambda i, d: (100.0, 0.1) if d else (1.0, 1.0), is_decode_only=False)
        steps.governor.pause()  # the engine had nothing to run
        steps.clock.now += 1000.0
    assert sum(modes) >= 0.9 * len(modes)


def alternate(steps: Steps, n: int, decode: Cost, join: Cost, every: tuple[int, int]) -> list[bool]:
    """``n`` steps: ``decode``'s, but every ``every[drafting]``-th step of a mode holds a prompt chunk (``join``)."""
    modes, counts = [], [0, 0]
    for _ in range(n):
        d = steps.drafting
        counts[d] += 1
        is_join = counts[d] % every[d] == 0
        modes += steps.run(1, join if is_join else decode, is_decode_only=not is_join)
    return modes


def test_drafting_whose_joins_cost_more_than_it_saves_is_turned_off() -> None:
    """The shape measured with MTP at 16 requests (BENCHMARKS.md, session 29): verifies 1.2x as fast as decodes, but
    while drafting every 8th step is a join of 5 typical steps (requests finish apart and each join is planned on
    the host), not drafting every 33rd of 1.6: drafting loses overall (0.94x). Counting only decode / verify steps,
    the governor kept drafting."""
    def decode(step: int, drafting: bool) -> tuple[float, float]:
        return (2.5 / 1.2, 2.5) if drafting else (1.0, 1.0)

    def join(step: int, drafting: bool) -> tuple[float, float]:
        return (5.0, 0.6) if drafting else (1.6, 0.9)

    modes = alternate(Steps(), 3000, decode, join, every=(33, 8))[1000:]
    assert sum(modes) <= 0.1 * len(modes), sum(modes)


def test_joins_as_costly_in_both_modes_keep_paying_drafting_on() -> None:
    """Every 10th step of either mode is a join of 4 s: drafting, 1.5x as fast in its decode / verify steps, still
    pays, and the joins (rare, costly, in whichever mode runs) do not make the governor hesitate."""
    def decode(step: int, drafting: bool) -> tuple[float, float]:
        return (2.5 / 1.5, 2.5) if drafting else (1.0, 1.0)

    modes = alternate(Steps(), 3000, decode, lambda i, d: (4.0, 0.5), every=(10, 10))[1:]
    assert sum(modes) >= 0.95 * len(modes), sum(modes)


def test_a_join_before_its_modes_first_decode_sample_is_not_counted() -> None:
    """The bucket has drafting's samples; the first steps without drafting hold prompt chunks: with no typical step
    of that mode to cap them by, they are not counted (counted whole, one long join would decide)."""
    steps = Steps()
    while True:  # the new bucket's first drafting samples, until its first estimate of not drafting begins
        steps.run(1, pays)
        if not steps.drafting:
            break
    steps.run(3, lambda i, d: (50.0, 0.1), is_decode_only=False)
    steps.run(1, pays)  # the join ends
    assert steps.governor._buckets[bucket_of(8)].prompt[False][:3] == [0.0, 0.0, 0.0]  # no join's tokens, time, count


def test_one_long_prompt_in_many_chunk_steps_counts_as_one_join() -> None:
    """Drafting pays 1.5x; one long prompt's 32 chunks fill 32 steps in a row while drafting. They are one join,
    capped at 3 typical steps: drafting stays on. (Counted as 32 capped samples, they made drafting lose for
    thousands of steps.)"""
    def decode(step: int, drafting: bool) -> tuple[float, float]:
        return (2.5 / 1.5, 2.5) if drafting else (1.0, 1.0)

    steps = Steps()
    steps.run(500, decode)
    steps.run(32, lambda i, d: (8.0, 0.0), is_decode_only=False)
    modes = steps.run(2000, decode)
    assert sum(modes) >= 0.95 * len(modes), sum(modes)


def test_governor_config_is_validated() -> None:
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).governor is None
    for value in ("auto", "off"):
        assert SpeculativeConfig("ngram", 2, governor=value).governor == value
    with pytest.raises(ValueError, match="speculative_config.governor"):
        SpeculativeConfig("ngram", 2, governor="on")


# ---- engine ----------------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SPEC = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        "mtp": {"method": "mtp", "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def embedded() -> tuple[list[str], list[list[int]]]:
    """Four held-out prompts and the embedded model's greedy tokens for each, without speculation."""
    return heldout_reference(GREEDY)


def spec_llm(method: str, governor: str, async_scheduling: bool) -> LLM:
    return LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048,
               async_scheduling=async_scheduling, speculative_config=SPEC[method] | {"governor": governor})


class SlowDrafts:
    """A clock for the governor in which a step takes 1 s plus 1 s per draft token it verified."""

    def __init__(self, llm: LLM) -> None:
        self.metrics, self.now, self.seen = llm.llm_engine.spec_metrics, 0.0, 0

    def __call__(self) -> float:
        drafted, self.seen = self.metrics.num_draft_tokens - self.seen, self.metrics.num_draft_tokens
        self.now += 1.0 + drafted
        return self.now


@pytest.mark.parametrize("method, async_scheduling", [("ngram", False), ("ngram", True), ("mtp", False),
                                                      ("mtp", True)])
def test_steps_the_governor_turns_off_give_the_tokens_without_speculation(embedded: tuple, method: str,
                                                                          async_scheduling: bool) -> None:
    """Drafting looks slow, so the governor turns it off after measuring both modes: the tokens are those without
    speculation and with the governor off. Queued ahead, the off steps are queued as decodes (ngram) or as
    verifies of no drafts with only the drafter's catch-up behind them (MTP)."""
    prompts, reference = embedded
    off = spec_llm(method, "off", async_scheduling)
    assert off.llm_engine.governor is None
    assert [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)] == reference
    llm = spec_llm(method, "auto", async_scheduling)
    llm.llm_engine.governor.clock = SlowDrafts(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    m, m_off = llm.get_metrics(), off.get_metrics()
    assert m["num_drafts"] > 0 and m["num_steps_drafting_off"] >= 0.5 * m["num_steps"], m
    assert m["num_steps_without_drafts"] >= m["num_steps_drafting_off"] > m_off["num_steps_without_drafts"]
    # all four requests decode together (3-5); fewer run at the end, not long enough to leave their first measurement
    assert m["governor_drafting"]["3-5"] is False and m_off["num_steps_drafting_off"] == 0
    if async_scheduling:  # off steps were queued ahead (ngram never queues a step it may draft for)
        assert llm.llm_engine.overlap.num_async_steps >= 0.3 * m["num_steps"]
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]


def test_ngram_steps_disabled_by_batch_size_are_queued_ahead(embedded: tuple) -> None:
    """disable_by_batch_size gates drafting through the same ``may_draft``: with async scheduling, ngram's steps
    that draft nothing are queued ahead as decodes, as without speculation."""
    prompts, reference = embedded
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048, async_scheduling=True,
              speculative_config=SPEC["ngram"] | {"disable_by_batch_size": 1})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference
    assert llm.get_metrics()["num_drafts"] == 0
    assert llm.llm_engine.overlap.num_async_steps >= 0.5 * llm.get_metrics()["num_steps"]


def test_random_requests_keep_drafting_so_seeded_ones_stay_reproducible(embedded: tuple) -> None:
    """A random request's drafts change which sample it draws (not its distribution): the governor gates only
    greedy requests, so seeded requests get the tokens they get with the governor off, whatever the timing."""
    prompts, reference = embedded
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True), GREEDY,
              SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=40, ignore_eos=True)]
    off = spec_llm("ngram", "off", async_scheduling=False)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert expected[0] == reference[0] and expected[2] == reference[2]
    llm = spec_llm("ngram", "auto", async_scheduling=False)
    llm.llm_engine.governor.clock = SlowDrafts(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    m = llm.get_metrics()
    # the greedy requests stopped drafting; in some of those steps the random ones still verified drafts
    assert 0 < m["num_steps_without_drafts"] < m["num_steps_drafting_off"], m


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_drafting_switched_on_and_off_every_few_steps_keeps_the_tokens(embedded: tuple, method: str) -> None:
    """Queued ahead, every kind of hand-over: a queued decode followed by a host-planned verify (ngram), device
    drafts of none followed by a step that may draft, and back; with stops, min_tokens and short max_tokens."""
    prompts, reference = embedded
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[reference[0][13]]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=9),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    expected = [reference[0][:reference[0].index(reference[0][13]) + 1], reference[1], reference[2][:7],
                reference[3]]
    for n in (1, 3):
        llm = spec_llm(method, "auto", async_scheduling=True)
        flip_every(llm.llm_engine.governor, n)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected, n
        m = llm.get_metrics()
        assert m["num_drafts"] > 0 and m["num_steps_without_drafts"] > 0
        assert llm.llm_engine.overlap.num_async_steps > 0 and llm.llm_engine.overlap.inflight is None
