"""N-gram drafts made on the device behind a greedy step, so that ngram verifies queue ahead as MTP's do.

The host proposer (ngram.py) reads each step's tokens on the host; a verify queued ahead (engine/async_scheduler.py)
must have its drafts before the step before it is read. So the device keeps each request's token ids (one int32 row
of ``history`` per request) and, behind every greedy decode / verify step:
- takes the accepted counts and next tokens (device_drafts.greedy_accepted);
- writes each query row's argmax at the position after the row: up to the last accepted draft those are the drafts,
  then the next token; the rows after it write past the request's new length, where the next step's writes land
  before anything reads them;
- matches the suffix n-grams (ops/ngram_match.py, kernels/ngram_match.py): the drafts of ngram.py where it has k of
  them, continued by the match's period where it has fewer, the last token repeated where nothing matched. A greedy
  verify accepts a draft only if it equals the target's token, so which drafts a step verifies never changes a
  token; the draft-length policy shortens the drafts of requests whose drafts are rejected.

A row holds a request's tokens ``0 .. known - 1`` as far as the host knows. A step planned on the host first copies
the request's tokens since ``known`` (a request's tokens are only ever appended); a step queued ahead follows one that
drafted here, whose writes already hold its tokens. Rows go when their requests finish (``forget``); ``history``
grows as requests and positions need (rows by doubling, the width in steps of 1,024 ids), outside the KV cache's
memory budget: 4 bytes per row and id (a few MB for 64 requests of 8K tokens).
"""

from dataclasses import dataclass

import torch

from truespec.core.sequence import Sequence
from truespec.layers.backend import kernels, use_kernels
from truespec.ops.host_copy import to_device_async
from truespec.ops.ngram_match import ngram_step_ref
from truespec.spec_decode.device_drafts import DeviceDrafts, greedy_accepted
from truespec.worker.model_runner import LaunchedStep

MIN_ROWS = 8
WIDTH_STEP = 1024  # a row's width grows in these steps (doubling could waste half of a long context's memory)


@dataclass(slots=True)
class _Row:
    index: int  # in ``history``
    prompt_token_ids: list[int]  # the request's own list: another request under a reused id starts over
    known: int  # tokens 0 .. known - 1 are in the row


class NgramOnDevice:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.history: torch.Tensor | None = None  # [rows, width] int32 token ids
        self.rows: dict[str, _Row] = {}  # by request id
        self.free: list[int] = []  # row indices no request holds
        self._rows_on_device: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last step's rows

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self.free.append(row.index)

    def draft_on_device(self, step: LaunchedStep, num_drafts: int, seqs: dict[str, Sequence]) -> DeviceDrafts:
        """Queue ``step``'s acceptance, its tokens' writes and ``num_drafts`` (k or 0) drafts per request on the
        device, nothing read back. Every request of ``step`` is a greedy decode or verify (AsyncScheduler); the
        step's finished requests were forgotten first (``NgramProposer.draft_on_device``)."""
        scheduled, device = step.sched.scheduled, step.argmax.device
        num_tokens, num_reqs = len(step.positions), len(scheduled)
        # ids up to the last query row's position + 1 are written; a queued step's rows moved <= k further on
        needed = max(step.positions) + self.k + 2
        if self.history is None or needed > self.history.shape[1]:
            self._grow(max(MIN_ROWS, num_reqs), -(-needed // WIDTH_STEP) * WIDTH_STEP, device)
        indices, copy_rows, copy_positions, copy_tokens = [], [], [], []
        for r in scheduled:
            seq = seqs[r.request_id]
            row = self._row(r.request_id, seq)
            indices.append(row.index)
            end = r.num_computed_tokens + 1  # tokens up to the step's first query position
            if step.shift is None and row.known < end:  # planned on the host: its tokens are the host's
                tokens = seq.token_slice(row.known, end)
                copy_rows += [row.index] * len(tokens)
                copy_positions += range(row.known, end)
                copy_tokens += tokens
            row.known = max(row.known, end)  # queued ahead: at least the plan's start (the device moved it on)
        history, req_rows = self.history, self._device_rows(indices, device)
        if copy_rows:
            copies = to_device_async(copy_rows + copy_positions + copy_tokens, device).view(3, -1)
            history[copies[0], copies[1]] = copies[2].to(torch.int32)
        inputs, argmax = step.inputs, step.argmax[:num_tokens]
        query_start_loc = inputs.ctx.query_start_loc[:num_reqs + 1]
        max_drafts = max(row.query_len for row in step.rows) - 1
        num_accepted, _ = greedy_accepted(argmax, inputs.input_ids[:num_tokens], query_start_loc, max_drafts)
        ngram_step = kernels().ngram_step if use_kernels(history) else ngram_step_ref
        # writes each row's argmax after it (positions moved by the device for a step queued ahead), then drafts
        next_ids = ngram_step(history, req_rows, inputs.positions, query_start_loc, argmax, num_accepted, self.min_n,
                              self.max_n, num_drafts)
        return DeviceDrafts(num_accepted, next_ids)

    def _device_rows(self, indices: list[int], device: torch.device) -> torch.Tensor:
        """``indices`` on the device; the last step's tensor again when they are the same (the usual step)."""
        key = tuple(indices)
        if self._rows_on_device is None or self._rows_on_device[0] != key:
            self._rows_on_device = (key, to_device_async(indices, device))
        return self._rows_on_device[1]

    def _row(self, request_id: str, seq: Sequence) -> _Row:
        row = self.rows.get(request_id)
        if row is None or row.prompt_token_ids is not seq.prompt_token_ids:
            if row is not None:
                self.free.append(row.index)
            if not self.free:
                self._grow(2 * self.history.shape[0], self.history.shape[1])
            row = self.rows[request_id] = _Row(self.free.pop(), seq.prompt_token_ids, 0)
        return row

    def _grow(self, num_rows: int, width: int, device: torch.device | None = None) -> None:
        """``history`` with ``num_rows`` rows of ``width`` ids (neither shrinks), its contents kept (the copy is queued
        after every launch that reads the old tensor)."""
        old = self.history
        old_rows, old_width = (0, 0) if old is None else old.shape
        num_rows, width = max(num_rows, old_rows), max(width, old_width)
        if num_rows == old_rows and width == old_width:
            return
        grown = torch.zeros(num_rows, width, dtype=torch.int32, device=old.device if old is not None else device)
        if old is not None:
            grown[:old_rows, :old_width] = old
        self.free += range(old_rows, num_rows)
        self.history = grown
