"""Builds the per-step tensors, runs the model, samples.

Owns the device-side caches: paged KV for every attention layer and recurrent-state slots for
every GDN layer, bound to the layers once at start-up.
"""

from dataclasses import dataclass, field

import torch

from truespec.engine.context_builder import ContextRow
from truespec.engine.graph_runner import GraphRunner, GraphSettings
from truespec.engine.scheduler import ScheduledSeq
from truespec.engine.sequence import Sequence
from truespec.engine.state_manager import StateManager
from truespec.engine.stop_checker import StopChecker
from truespec.layers.rejection_sampler import emitted_tokens, greedy_verify, rejection_sample_draws


@dataclass
class StepOutput:
    tokens: list[list[int]] = field(default_factory=list)  # per request: accepted drafts + 1 new token, or []
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)  # per emitted token, if asked
    hidden: torch.Tensor | None = None  # [num_tokens, hidden_size] the target's final hidden states
    query_start_loc: list[int] = field(default_factory=list)  # request r's rows in ``hidden``


@dataclass
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``) whose tokens ``ModelRunner.collect`` reads."""

    scheduled: list[ScheduledSeq]
    logits: torch.Tensor  # [rows, vocab] float, min_tokens bans applied
    output: StepOutput
    spans: list[tuple[int, int]] = field(default_factory=list)  # per request: (first logits row, rows)
    raw: dict[int, torch.Tensor] = field(default_factory=dict)  # log-softmax rows of logprobs requests
    argmax: torch.Tensor | None = None  # [rows] on the device: the greedy tokens
    # on the host (pinned; valid once ``done``): ``argmax`` if any request is greedy, then each random request's
    # draws (``rejection_sample_draws``); ``offsets``: per request, where its values start in it
    values_host: torch.Tensor | None = None
    offsets: list[int] = field(default_factory=list)
    done: "torch.cuda.Event | None" = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.attention_layers = list(model.attention_layers())
        self.gdn_layers = list(model.gdn_layers())
        self._generators: dict[str, torch.Generator] = {}
        self.graphs = GraphRunner(model, "target", GraphSettings(), device)  # eager until init_graphs

    # ---- cache sizing and allocation -------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        elem = _element_size(self.dtype)
        return sum(2 * layer.num_kv_heads * layer.head_dim * elem for layer in self.attention_layers)

    @property
    def state_bytes_per_slot(self) -> int:
        total = 0
        for layer in self.gdn_layers:
            for shape, dtype in zip(layer.state_shapes(), layer.state_dtypes(), strict=True):
                total += _numel(shape) * _element_size(dtype)
        return total

    def allocate_caches(self, num_blocks: int, block_size: int, num_state_slots: int) -> None:
        allocate_caches(self.model, num_blocks, block_size, num_state_slots, self.device)

    def init_graphs(self, settings: GraphSettings) -> None:
        """After ``allocate_caches``: set up the forward (eager or CUDA graphs) and capture the graphs."""
        self.graphs = GraphRunner(self.model, "target", settings, self.device)
        self.graphs.capture()

    # ---- one step --------------------------------------------------------------------------
    # A step is ``launch`` (the target scores every request's tokens and drafts) then ``collect`` (sample /
    # verify); the engine may queue the next launch in between (async scheduling).
    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], states: StateManager, stop_checker: StopChecker,
               input_ids_from: torch.Tensor | None = None) -> "LaunchedStep":
        """Queue a step's forward, logits and greedy argmax on the device, without waiting for them.

        ``input_ids_from``: a device tensor whose first T values replace the step's T input ids (async
        scheduling: the previous step's argmax, still being computed, feeds this step's decodes)."""
        rows, input_ids, positions = self.prepare(scheduled, states)
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        hidden, ctx = self.graphs.run(rows, input_ids, positions, decode_only=decode_only,
                                      input_ids_from=input_ids_from)
        logits = self.model.compute_logits(hidden[ctx.logits_indices])
        logits = logits if logits.dtype == torch.float64 else logits.float()
        step = LaunchedStep(scheduled, logits, StepOutput(hidden=hidden, query_start_loc=ctx.query_start_loc_cpu))
        row = 0
        for s in scheduled:  # rows [row, row + 1 + drafts) of the requests whose last chunk ran
            n = 1 + len(s.draft_token_ids) if s.is_last_chunk else 0
            step.spans.append((row, n))
            if n and s.seq.params.logprobs is not None:  # of the raw logits (before min_tokens bans), as vLLM
                step.raw[row] = torch.log_softmax(logits[row:row + n], dim=-1)
            if len(s.seq.output_token_ids) < s.seq.params.min_tokens:
                for i in range(n):  # min_tokens: position i would be output token len(output) + i
                    banned = stop_checker.banned_token_ids(s.seq, offset=i)
                    if banned:
                        logits[row + i, banned] = float("-inf")
            row += n
        self._queue_tokens(step)
        return step

    def _queue_tokens(self, step: "LaunchedStep") -> None:
        """Queue every request's tokens on the device (one argmax over the batch for the greedy ones, the draws of
        each random one with its own generator) and one copy of them all to the host behind an event: no
        per-request sync, and the host may queue the next step before this one ends."""
        values = []
        if any(s.seq.params.is_greedy for s in step.scheduled):
            step.argmax = step.logits.argmax(dim=-1)
            values.append(step.argmax)
        offset = len(step.logits) if values else 0
        for s, (start, n) in zip(step.scheduled, step.spans, strict=True):
            if n == 0 or s.seq.params.is_greedy:
                step.offsets.append(start)
                continue
            values.append(rejection_sample_draws(step.logits[start:start + n], s.draft_token_ids, s.seq.draft_probs,
                                                 s.seq.params, self._generator(s.seq)))
            step.offsets.append(offset)
            offset += len(values[-1])
        if values:
            step.values_host = torch.cat(values).to("cpu", non_blocking=True)
            if self.device.type == "cuda":  # on this device's stream, also when another device is current
                step.done = torch.cuda.Event()
                step.done.record(torch.cuda.current_stream(self.device))

    @torch.inference_mode()
    def collect(self, step: "LaunchedStep") -> StepOutput:
        """Wait for a launched step; per request, its accepted drafts and new token (greedy or sampled)."""
        if step.done is not None:
            step.done.synchronize()
        values = step.values_host.tolist() if step.values_host is not None else []  # the step's one host read
        out = step.output
        for s, (start, n), at in zip(step.scheduled, step.spans, step.offsets, strict=True):
            seq = s.seq
            if n == 0:
                out.tokens.append([])
                out.logprobs.append(None)
                continue
            if seq.params.is_greedy:  # the argmax of its 1 + d rows
                tokens = greedy_verify(s.draft_token_ids, values[at:at + n])
            else:  # its d accept flags and 1 + d samples
                tokens = emitted_tokens(s.draft_token_ids, values[at:at + 2 * n - 1])
            out.tokens.append(tokens)
            if seq.params.logprobs is None:
                out.logprobs.append(None)
            else:
                out.logprobs.append(_top_logprobs(step.raw[start], tokens, seq.params.logprobs))
        return out

    def prepare(self, scheduled: list[ScheduledSeq],
                states: StateManager) -> tuple[list[ContextRow], list[int], list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        rows = []
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            input_ids += seq.token_slice(start, start + s.num_new_tokens) + s.draft_token_ids
            positions += range(start, start + s.query_len)
            # keep the state after the last sequence token and after every draft (invariant 2)
            rows.append(ContextRow(seq.block_ids, start, s.query_len, states.current_slot(seq), states.first_slot(seq),
                                   s.num_new_tokens - 1, 1 + len(s.draft_token_ids) if s.is_last_chunk else 0))
        return rows, input_ids, positions

    # ---- per-request generators ------------------------------------------------------------
    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.is_greedy:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = self._generators[seq.request_id] = seq.make_generator(self.device, self.seed)
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)


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


def allocate_caches(model: torch.nn.Module, num_blocks: int, block_size: int, num_state_slots: int,
                    device: torch.device) -> None:
    """Bind zeroed caches to a model's (or drafter's) layers: paged KV for its attention layers, state slots
    for its GDN layers, in the dtypes the layers declare."""
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(layer.kv_cache_shape(num_blocks, block_size), dtype=model.dtype, device=device)
    for layer in model.gdn_layers():
        (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = layer.state_shapes(), layer.state_dtypes()
        layer.conv_state = torch.zeros(num_state_slots, *conv_shape, dtype=conv_dtype, device=device)
        layer.ssm_state = torch.zeros(num_state_slots, *ssm_shape, dtype=ssm_dtype, device=device)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
