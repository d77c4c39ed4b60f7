"""Whether and how much a request's next step drafts: the gates the engine hands its step loop and the async scheduler
(closures, not bound methods: the async scheduler keeps them, and a reference back to the engine would keep a dropped
engine's caches alive until the cycle collector ran)."""

from collections.abc import Callable

from truespec.core.scheduler import Scheduler
from truespec.spec_decode.draft_length import DraftLengthPolicy
from truespec.spec_decode.governor import SpeculationGovernor
from truespec.spec_decode.metrics import SpecDecodeMetrics


def draft_gate(governor: SpeculationGovernor | None, scheduler: Scheduler,
                disable_by_batch_size: int | None) -> Callable[..., bool]:
    """``may_draft(is_greedy=True)``: whether a request's next step may draft at all: not when
    ``disable_by_batch_size`` requests or more are running, nor, for a greedy request, when the governor has turned
    drafting off for this many (the drafters then only catch up). A random request's drafts change which sample it
    draws (not its distribution), so the governor leaves them alone: a seeded request stays reproducible and
    independent of its batch and of timing."""
    def may_draft(is_greedy: bool = True) -> bool:
        num_running = len(scheduler.running)
        if disable_by_batch_size is not None and num_running >= disable_by_batch_size:
            return False
        return governor is None or not is_greedy or governor.is_drafting(num_running)
    return may_draft


def draft_counter(policy: DraftLengthPolicy, metrics: SpecDecodeMetrics,
                   may_draft: Callable[..., bool]) -> Callable[[str, bool], int]:
    """``num_drafts(request_id, is_greedy)``: what the draft-length policy gives the request's next step (a step it
    skips is counted), or 0 without asking it when the request's next step may not draft (``may_draft``)."""
    def num_drafts(request_id: str, is_greedy: bool) -> int:
        if not may_draft(is_greedy):
            return 0
        count = policy.num_drafts(request_id)
        metrics.num_draft_skips += count == 0
        return count
    return num_drafts
