"""Runs one step: a ``SchedulerOutput`` in, a ``ModelRunnerOutput`` out.

Builds the step's tensors from the scheduled requests, runs the model (eagerly or from a CUDA graph), and samples
or verifies each request's tokens. It owns the device-side caches (bound to the layers once at start-up) and the
random streams of sampling requests; it never reads or changes engine objects.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from truespec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from truespec.kv_cache.layout import allocate_caches, copy_state_slots, kv_bytes_per_token, state_bytes_per_slot
from truespec.layers.rejection_sampler import emitted_tokens, greedy_verify, rejection_sample_draws
from truespec.layers.sampler import request_generator
from truespec.layers.token_bitmask import apply_token_bitmask_
from truespec.ops.host_copy import to_device_async
from truespec.sampling_params import SamplingParams
from truespec.worker.graph_runner import GraphRunner, GraphSettings
from truespec.worker.input_builder import ContextRow, StepInputs
from truespec.worker.prompt_logprobs import QueuedPromptLogprobs, prompt_logprobs_entries, queue_prompt_logprobs
from truespec.worker.runner_output import ModelRunnerOutput


@dataclass
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``) whose tokens ``ModelRunner.collect`` reads."""

    sched: SchedulerOutput
    logits: torch.Tensor  # [rows, vocab] float, grammar masks and min_tokens bans applied
    output: ModelRunnerOutput
    spans: list[tuple[int, int]] = field(default_factory=list)  # per request: (first logits row, rows)
    raw: dict[int, torch.Tensor] = field(default_factory=dict)  # log-softmax rows of logprobs requests
    argmax: torch.Tensor | None = None  # [rows] on the device: the greedy tokens
    # on the host (pinned; valid once ``done``): ``argmax`` if any request is greedy, then each random request's
    # draws (``rejection_sample_draws``); ``offsets``: per request, where its values start in it
    values_host: torch.Tensor | None = None
    offsets: list[int] = field(default_factory=list)
    prompt_logprobs: QueuedPromptLogprobs | None = None  # of the requests with prompt logprobs due (host copies)
    done: "torch.cuda.Event | None" = None  # recorded after the copies to the host
    # the forward's rows and positions as the host built them, and its device inputs (for a drafter's catch-up)
    rows: list[ContextRow] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    inputs: StepInputs | None = None
    shift: torch.Tensor | None = None  # [R] on the device: how far its positions were moved (a step queued ahead)
    ids_at: int | None = None  # with ``shift``: where the step's input ids (drafts unknown to the host) start in
    # ``values_host``
    device_drafts: Any = None  # spec_decode.device_drafts.DeviceDrafts queued behind it, if any


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int,
                 eos_token_ids: set[int], kv_cache_dtype: str = "auto") -> None:
        self.model = model
        self.gdn_layers = model.gdn_layers()  # a walk over every module: once, not per state copy
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.eos_token_ids = eos_token_ids  # banned before a request's min_tokens (unless ignore_eos)
        self._generators: dict[str, torch.Generator] = {}
        self.graphs = GraphRunner(model, "target", GraphSettings(), device, prompt_rows=True)  # eager until init_graphs

    # ---- caches and graphs -----------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model, self.kv_cache_dtype)

    @property
    def state_bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.model)

    def allocate_caches(self, num_blocks: int, block_size: int, num_state_slots: int) -> None:
        allocate_caches(self.model, num_blocks, block_size, num_state_slots, self.device, self.kv_cache_dtype)

    def init_graphs(self, settings: GraphSettings) -> None:
        """After ``allocate_caches``: set up the forward (eager or CUDA graphs) and capture the graphs."""
        self.graphs = GraphRunner(self.model, "target", settings, self.device, prompt_rows=True)
        self.graphs.capture()

    # ---- one step --------------------------------------------------------------------------
    # A step is ``launch`` (the target scores every request's tokens and drafts) then ``collect`` (sample /
    # verify); the engine may queue the next launch in between (async scheduling).
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, input_ids_from: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> LaunchedStep:
        """Queue a step's forward, logits and tokens (and the prompt logprobs due) on the device, without waiting.

        ``input_ids_from``: a device tensor whose first T values replace the step's T input ids (async
        scheduling: the previous step's argmax or drafts, still being computed, feed this step). ``shift``: [R]
        device tensor, request r's positions move that far (a verify queued before the previous step's
        accepted counts were read); its drafts are then read back with its tokens."""
        for request_id in sched.finished_req_ids:
            self._generators.pop(request_id, None)
        if sched.state_saves or sched.state_restores:  # prefix caching's state checkpoints, before the forward
            self._copy_states(sched.state_saves, sched.state_restores)
        scheduled = sched.scheduled
        rows, input_ids, positions = self.prepare(scheduled)
        hidden, inputs = self.graphs.run(rows, input_ids, positions, decode_only=sched.is_decode_only,
                                         input_ids_from=input_ids_from, shift=shift)
        ctx = inputs.ctx
        logits = self.model.compute_logits(hidden[ctx.logits_indices])
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if sched.grammar_bitmask is not None:  # all-ones rows (unconstrained) change no bit; no constraint: no mask
            apply_token_bitmask_(logits, self._grammar_bitmask(sched.grammar_bitmask))
        output = ModelRunnerOutput([r.request_id for r in scheduled], hidden_states=hidden,
                                   query_start_loc=ctx.query_start_loc_cpu)
        step = LaunchedStep(sched, logits, output, rows=rows, positions=positions, inputs=inputs, shift=shift)
        row = 0
        for r in scheduled:  # rows [row, row + 1 + drafts) of the requests whose last chunk ran
            n = r.num_logits
            step.spans.append((row, n))
            if n and r.params.logprobs is not None:  # as vLLM: after the grammar mask, before min_tokens bans
                step.raw[row] = torch.log_softmax(logits[row:row + n], dim=-1)
            if n and r.params.min_tokens > r.num_output_tokens:
                num_banned_rows = min(n, r.params.min_tokens - r.num_output_tokens)  # row i: output num_output + i
                banned = self._min_tokens_bans(r.params)
                if banned:
                    logits[row:row + num_banned_rows, banned] = float("-inf")
            row += n
        self._queue_tokens(step)
        step.prompt_logprobs = queue_prompt_logprobs(self.model, hidden, scheduled, ctx.query_start_loc_cpu)
        self._record_done(step)
        return step

    def _copy_states(self, saves: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """Saves (a slot saved twice keeps the later save), then restores, as (source, destination) state slots; the
        slot ids reach the device without waiting for it (async scheduling keeps overlapping)."""
        for copies in (saves, restores):
            last = {dst: src for src, dst in copies}
            if last and self.gdn_layers:
                ids = to_device_async([*last.values(), *last], self.device)
                copy_state_slots(self.gdn_layers, ids[:len(last)], ids[len(last):])

    def _grammar_bitmask(self, host: torch.Tensor) -> torch.Tensor:
        """The step's grammar mask on the device: the host's, copied once (not waited for)."""
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    def _min_tokens_bans(self, params: SamplingParams) -> list[int]:
        """Tokens a request may not emit before ``min_tokens``: its stop tokens, and EOS unless ``ignore_eos``."""
        return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))

    def _queue_tokens(self, step: LaunchedStep) -> None:
        """Queue every request's tokens on the device (one argmax over the batch for the greedy ones, the draws of
        each random one with its own generator) and one copy of them all to the host (read after ``done``): no
        per-request sync, and the host may queue the next step before this one ends."""
        values = []
        if any(r.params.is_greedy for r in step.sched.scheduled):
            step.argmax = step.logits.argmax(dim=-1)
            values.append(step.argmax)
        offset = len(step.logits) if values else 0
        for r, (start, n) in zip(step.sched.scheduled, step.spans, strict=True):
            if n == 0 or r.params.is_greedy:
                step.offsets.append(start)
                continue
            values.append(rejection_sample_draws(step.logits[start:start + n], r.draft_token_ids, r.draft_probs,
                                                 r.params, self._generator(r.request_id, r.params)))
            step.offsets.append(offset)
            offset += len(values[-1])
        if step.shift is not None:
            step.ids_at = offset
            values.append(step.inputs.input_ids[:len(step.positions)])
        if values:
            step.values_host = torch.cat(values).to("cpu", non_blocking=True)

    def _record_done(self, step: LaunchedStep) -> None:
        """The event after the step's copies to the host (on CPU they are done when queued)."""
        if self.device.type == "cuda" and (step.values_host is not None or step.prompt_logprobs is not None):
            step.done = torch.cuda.Event()  # on this device's stream, also when another device is current
            step.done.record(torch.cuda.current_stream(self.device))

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step; per request, its accepted drafts and new token (greedy or sampled), and the
        prompt logprobs it gave."""
        if step.done is not None:
            step.done.synchronize()
        values = step.values_host.tolist() if step.values_host is not None else []  # the step's one host read
        out = step.output
        out.prompt_logprobs = prompt_logprobs_entries(step.prompt_logprobs, step.sched.scheduled)
        qsl = out.query_start_loc
        for i, (r, (start, n), at) in enumerate(zip(step.sched.scheduled, step.spans, step.offsets, strict=True)):
            if n == 0:
                out.sampled_token_ids.append([])
                out.logprobs.append(None)
                continue
            drafts = r.draft_token_ids
            if step.ids_at is not None:  # drafted on the device: the host learns them here (its query's last rows)
                drafts = values[step.ids_at + qsl[i + 1] - len(drafts):step.ids_at + qsl[i + 1]]
            if r.params.is_greedy:  # the argmax of its 1 + d rows
                tokens = greedy_verify(drafts, values[at:at + n])
            else:  # its d accept flags and 1 + d samples
                tokens = emitted_tokens(r.draft_token_ids, values[at:at + 2 * n - 1])
            out.sampled_token_ids.append(tokens)
            num = r.params.logprobs
            out.logprobs.append(None if num is None else _top_logprobs(step.raw[start], tokens, num))
        return out

    @staticmethod
    def prepare(scheduled: list[ScheduledRequest]) -> tuple[list[ContextRow], list[int], list[int]]:
        """The step's rows, input ids and positions (the state after the last sequence token and after every
        draft is kept: docs/ARCHITECTURE.md, invariant 2). A long prompt's chunk runs fla's GDN kernel only if all
        its rows are prompt rows (output positions recomputed after preemption take the token loop, as decoded)."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows = []
        for r in scheduled:
            start, query_len, num_prompt_rows = r.num_computed_tokens, r.num_scheduled_tokens, r.num_prompt_rows
            input_ids += r.token_ids
            positions += range(start, start + query_len)
            gdn_chunked = None if r.gdn_chunked is None else r.gdn_chunked and num_prompt_rows == query_len
            rows.append(ContextRow(r.block_ids, start, query_len, r.state_src, r.first_state_slot,
                                   r.num_new_tokens - 1, r.num_logits, num_prompt_rows, gdn_chunked))
        return rows, input_ids, positions

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = request_generator(params, request_id, self.seed, self.device)
        return gen


def _top_logprobs(logprobs: torch.Tensor, tokens: list[int], num: int) -> list[dict[int, float]]:
    """For each emitted token: its log-probability and the ``num`` most likely tokens' (log-softmax of the raw
    logits, before temperature / top-k / top-p)."""
    out = []
    for row, token in zip(logprobs, tokens, strict=False):
        top = torch.topk(row, num) if num > 0 else None
        entry = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        entry[token] = float(row[token])
        out.append(entry)
    return out
