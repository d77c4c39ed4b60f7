"""The plan of a verify queued ahead (engine/async_scheduler.py): the step after ``launched``, made before
``launched``'s tokens are read, from the drafts the drafter queued behind it on the device.

- Each request of ``launched`` that goes on verifies its next token and drafts; a request that finished at the step
  before ``launched`` (or was aborted) is left out, its ids and shift not gathered. The plan starts each request as
  if ``launched`` accepts nothing; its blocks cover the case where it accepts everything (plus the drafter's
  lookahead), and the device moves it by what ``launched`` accepted (``shift``).
- A request that may reach max_tokens at ``launched`` stays in, without drafts: if ``launched`` ends it, its rows
  are dropped like those of a request that hit a stop token; if not, it accepted too few for its row to pass its
  last position, so its move is capped there (and its blocks with it).
- With a drafter that drafts behind prompts (a model drafter), waiting requests join (``may_admit``: greedy, no
  logprobs or structured outputs, not a long prompt under a GdnPrefillRule): their prompt chunks, whose ids the host
  knows, follow the verifies, not moved. (A moved step keeps no host copy of its positions and state sources, which
  fla's call plans from, so its GDN layers run the token loop: a long prompt's chunk there would not get the fla bits
  its chunks get everywhere else, core/gdn_prefill_rule.py.)
  One that could join but does not fit (the step's budget, KV blocks) makes the next such step planned on the host,
  which admits it as ``Scheduler.schedule`` does.
- A request whose prompt ``launched`` computes an earlier chunk of (a joining prompt's chunks end at its state
  checkpoints, with prefix caching on a hybrid model) goes on with its next chunk, planned as ``Scheduler.schedule``
  would, not moved, under the same conditions as a request joining (``may_admit``), if it has no output yet (a
  re-prefill after preemption goes on in a step planned on the host: its chunks past the prompt hold blocks only up
  to its longest length); the drafter only caught up on it behind ``launched`` (spec_decode/device_drafts.py).
No plan (None) when a request is not in ``launched``, one has structured outputs or min_tokens still due, a waiting
request may not join, or the blocks do not fit: the next step is then planned on the host.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from truespec.core.gdn_prefill_rule import GdnPrefillRule
from truespec.core.scheduler import Scheduler
from truespec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from truespec.core.sequence import Sequence
from truespec.ops.host_copy import to_device_async
from truespec.spec_decode.interface import DeviceDrafter
from truespec.worker.model_runner import LaunchedStep


@dataclass
class VerifyPlan:
    sched: SchedulerOutput
    input_ids: torch.Tensor  # the step's input ids on the device: gathered drafts, then joining prompts' ids
    shift: torch.Tensor  # [R] on the device: how far each request moves (what ``launched`` accepted; 0 if joining)
    admitted: list[ScheduledRequest]  # the joining requests (the step's last ones)


def going_on(launched: LaunchedStep, seqs: dict[str, Sequence],
             running: list[Sequence]) -> tuple[list[int], list[Sequence]] | None:
    """The rows of ``launched`` whose requests go on and their requests, if those are exactly the ``running`` ones and
    none has structured outputs (its next rows' grammar mask needs ``launched``'s tokens on the host)."""
    if any(r.params.structured_outputs is not None for r in launched.sched.scheduled):
        return None
    rows, kept = [], []
    for i, r in enumerate(launched.sched.scheduled):
        seq = seqs.get(r.request_id)
        if seq is not None and not seq.is_finished:
            rows.append(i)
            kept.append(seq)
    return (rows, kept) if kept and kept == running else None


def may_admit(seq: Sequence, num_tokens: int, gdn_rule: GdnPrefillRule | None = None) -> bool:
    """Whether a waiting request may join a verify queued ahead with ``num_tokens`` of its prompt: greedy without
    logprobs or structured outputs, no drafts (a re-prefill's), and not long under ``gdn_rule`` (its chunks run fla,
    which a moved step cannot: module docstring). The drafter drafts behind the step on the device too
    (``_drafts_on_device``) and the step after it is queued ahead again, with the prompt's next chunk if this one
    was not its last."""
    p = seq.params
    return (num_tokens > 0 and not seq.draft_token_ids and p.is_greedy and p.logprobs is None
            and p.prompt_logprobs is None and p.structured_outputs is None
            and (gdn_rule is None or not gdn_rule.is_long(seq.prompt_len)))


def plan_verify(scheduler: Scheduler, seqs: dict[str, Sequence], drafter: DeviceDrafter,
                num_drafts: Callable[[str, bool], int], launched: LaunchedStep,
                host_admits: bool) -> tuple[VerifyPlan | None, bool]:
    """The verify after ``launched`` (module docstring), scheduled, or None; and whether the next plan must leave
    admitting to a step planned on the host (``host_admits``: this plan's, from the plan before)."""
    found = going_on(launched, seqs, scheduler.running)
    if found is None:
        return None, False
    kept, goers = found
    admit = partial(may_admit, gdn_rule=scheduler.gdn_rule) if drafter.drafts_after_prompts else None
    first = scheduler.waiting[0] if scheduler.waiting else None
    if first is not None and len(scheduler.running) < scheduler.max_num_seqs and (
            host_admits or admit is None or not admit(first, first.num_uncomputed_tokens)):
        return None, False  # the next step admits a waiting request: its prompt goes in a step planned on the host
    dd = launched.device_drafts
    k, plans, limits = dd.num_drafts, [], []  # k drafts, or none; limits: the most each request's plan may move
    going_at: list[int] = []  # the plans of prompts going on (their next chunk)
    scheduled = [launched.sched.scheduled[i] for i in kept]
    for r, seq in zip(scheduled, goers, strict=True):
        if not r.is_last_chunk:  # its prompt goes on: the next chunk, planned by the scheduler, not moved
            if admit is None or seq.output_token_ids or not admit(seq, 1):  # a fresh prompt's (not a re-prefill's)
                return None, False
            going_at.append(len(plans))
            plans.append((seq, seq.num_computed_tokens + r.num_new_tokens, 0, None))
            limits.append(0)
            continue
        if seq.params.min_tokens > len(seq.output_token_ids):
            return None, False  # its next rows may need min_tokens bans
        num_drafts_now = len(r.draft_token_ids)
        room = seq.max_output_len - len(seq.output_token_ids) - 1 - num_drafts_now  # if it accepts them all
        start = seq.num_computed_tokens + r.num_new_tokens  # after its query's sequence tokens, nothing accepted
        if room >= 1:
            drafts = min(num_drafts(seq.request_id, True), room - 1, k)  # every request is greedy here
            plans.append((seq, start, drafts, start + num_drafts_now + 1 + drafts + drafter.num_lookahead_tokens))
            limits.append(num_drafts_now)
            continue
        last = seq.prompt_len + seq.max_output_len - 1  # it may finish at ``launched``: no drafts, capped here
        plans.append((seq, start, 0, min(start + num_drafts_now + 1, last + 1) + drafter.num_lookahead_tokens))
        limits.append(min(num_drafts_now, last - start))
    if sum(1 + d for _, _, d, hold in plans if hold is not None) > scheduler.max_num_batched_tokens:
        return None, False
    out = scheduler.schedule_verify_ahead(plans, admit if scheduler.waiting else None)
    if out is None:
        return None, False
    device, counts = dd.next_ids.device, {d for _, _, d, _ in plans}
    # the prompts going on: their chunks' ids after the drafts' in the source the step's ids are gathered from
    going = {i: out.scheduled[i].token_ids for i in going_at}
    if len(counts) == 1 and not going and len(kept) == len(launched.sched.scheduled):  # each: token, as many drafts
        (drafts,) = counts
        ids, shift = dd.next_ids[:, :1 + drafts].flatten(), dd.num_accepted
    else:
        index, base = [], dd.next_ids.numel()
        for n, (i, (_, _, d, _)) in enumerate(zip(kept, plans, strict=True)):
            if n in going:
                index += range(base, base + len(going[n]))
                base += len(going[n])
            else:
                index += range(i * (1 + k), i * (1 + k) + 1 + d)
        source = dd.next_ids.flatten()
        if going:
            source = torch.cat([source, to_device_async([t for ids in going.values() for t in ids], device)])
        ids = source.index_select(0, to_device_async(index, device))
        shift = dd.num_accepted.index_select(0, to_device_async(kept, device))
    if going or any(limit < len(r.draft_token_ids) for limit, r in zip(limits, scheduled, strict=True)):
        shift = torch.minimum(shift, to_device_async(limits, device))
    admitted = out.scheduled[len(plans):]
    if admitted:
        ids = torch.cat([ids, to_device_async([t for r in admitted for t in r.token_ids], device)])
        shift = torch.cat([shift, shift.new_zeros(len(admitted))])
    # one that could join but did not: the next plan leaves it to a step planned on the host
    still_waiting = bool(scheduler.waiting) and len(scheduler.running) < scheduler.max_num_seqs
    return VerifyPlan(out, ids, shift, admitted), still_waiting
