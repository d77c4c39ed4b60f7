"""Prompt logprobs (``SamplingParams.prompt_logprobs``), computed on the device from a step's hidden states.

For each prompt token the scheduler lists (``ScheduledRequest.prompt_logprob_token_ids``), the row of the position
before it gives the log-softmax of the target's raw logits (as vLLM, and as ``logprobs``): the token's own value and
the ``n`` largest. Rows are scored ``SLICE_ROWS`` at a time, so a prefill chunk of thousands of rows never holds
more than that many rows of vocabulary-wide logits, and only [rows, 1 + n] values and [rows, n] ids are kept for
the host, which reads them with the step's tokens (``ModelRunner.collect``).
"""

from dataclasses import dataclass

import torch

from truespec.core.scheduler_output import ScheduledRequest
from truespec.ops.host_copy import to_device_async

SLICE_ROWS = 256  # rows of [rows, vocab] logits alive at once (248K vocabulary in fp32: 254 MB)


@dataclass
class QueuedPromptLogprobs:
    """A step's prompt logprobs, flattened over its requests in order (host copies once the step is done)."""

    values: torch.Tensor  # per row: the prompt token's logprob, then the n largest (n = the request's own)
    token_ids: torch.Tensor  # per row: the n most likely token ids, most likely first


def queue_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, scheduled: list[ScheduledRequest],
                          query_start_loc: list[int]) -> QueuedPromptLogprobs | None:
    """Queue the prompt logprobs of every request of the step that has some due (None: none has)."""
    due = [(r, first_row) for r, first_row in zip(scheduled, query_start_loc, strict=False)
           if r.prompt_logprob_token_ids]
    if not due:
        return None
    all_targets = to_device_async([t for r, _ in due for t in r.prompt_logprob_token_ids], hidden.device)
    values, token_ids, at = [], [], 0
    for r, first_row in due:
        rows = r.prompt_logprobs_rows
        targets, at = all_targets[at:at + len(rows)], at + len(rows)
        for a in range(0, len(rows), SLICE_ROWS):
            b = min(a + SLICE_ROWS, len(rows))
            logits = model.compute_logits(hidden[first_row + rows.start + a:first_row + rows.start + b])
            logprobs = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
            top = torch.topk(logprobs, r.params.prompt_logprobs, dim=-1)  # [rows, n]
            values.append(torch.cat([logprobs.gather(1, targets[a:b, None]), top.values], dim=1).flatten())
            token_ids.append(top.indices.flatten())
    return QueuedPromptLogprobs(torch.cat(values).to("cpu", non_blocking=True),
                                torch.cat(token_ids).to("cpu", non_blocking=True))



def prompt_logprobs_entries(queued: QueuedPromptLogprobs | None,
                            scheduled: list[ScheduledRequest]) -> list[list[dict[int, float]] | None]:
    """Per request: one {token_id: logprob} per prompt token it listed (the n most likely, then the prompt token
    if it is not among them, as ``logprobs``' entries), or None. Reads the host copies: after the step is done."""
    values = queued.values.tolist() if queued is not None else []
    token_ids = queued.token_ids.tolist() if queued is not None else []
    out: list[list[dict[int, float]] | None] = []
    at_value = at_id = 0
    for r in scheduled:
        if not r.prompt_logprob_token_ids:
            out.append(None)
            continue
        n, entries = r.params.prompt_logprobs, []
        for token in r.prompt_logprob_token_ids:
            entry = dict(zip(token_ids[at_id:at_id + n], values[at_value + 1:at_value + 1 + n], strict=True))
            entry[token] = values[at_value]
            entries.append(entry)
            at_value, at_id = at_value + 1 + n, at_id + n
        out.append(entries)
    return out
