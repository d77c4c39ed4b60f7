"""The engine: validate and add requests, then step: schedule -> run -> process outputs -> propose drafts."""

import threading
import time
from collections.abc import Callable

import torch

from truespec.config import EngineConfig
from truespec.core.gdn_prefill_rule import GdnPrefillRule
from truespec.core.scheduler import Scheduler
from truespec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from truespec.core.sequence import PLACEHOLDER, Sequence
from truespec.engine.async_scheduler import AsyncScheduler, queued_steps
from truespec.engine.draft_gate import draft_counter, draft_gate
from truespec.engine.draft_handoff import DraftHandoff
from truespec.engine.input_processor import InputProcessor, PromptType, Request
from truespec.engine.model_setup import load_models, make_runner, warm_up
from truespec.engine.output_processor import OutputProcessor
from truespec.engine.parallel_sampling import ParentRequests
from truespec.engine.stop_checker import StopChecker
from truespec.kv_cache.config import CacheConfig
from truespec.layers.gdn import chunked_prefill_min_len
from truespec.outputs import RequestOutput
from truespec.sampling_params import SamplingParams
from truespec.spec_decode.draft_length import DraftLengthPolicy
from truespec.spec_decode.governor import SpeculationGovernor
from truespec.spec_decode.interface import Proposer
from truespec.spec_decode.metrics import SpecDecodeMetrics
from truespec.spec_decode.proposer import (
    check_speculative_config,
    make_proposer,
    num_lookahead_tokens,
)
from truespec.structured_output.manager import StructuredOutputManager
from truespec.tokenizer import load_tokenizer
from truespec.worker.runner_output import ModelRunnerOutput


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        spec = config.speculative_config
        self.cache_config, self.device = self.check_config(config)  # before anything is allocated
        cache = self.cache_config
        self.loaded, drafter, self.max_model_len = load_models(config, cache, self.device)
        self.hf_config, self.dtype = self.loaded.hf_config, self.loaded.dtype
        self.vocab_size = self.hf_config.vocab_size
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        self.stop_checker = StopChecker(self.tokenizer, self.hf_config, config.model)
        self.output_processor = OutputProcessor(self.tokenizer, self.stop_checker)
        # grammar matchers of requests with structured outputs; EOS is allowed where the grammar may end
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                          self.stop_checker.eos_token_ids,
                                                          config.structured_outputs_config.disable_any_whitespace)
        self.runner, self.kv, graphs = make_runner(config, cache, self.device, self.loaded, drafter,
                                                   self.stop_checker.eos_token_ids, self.max_model_len)
        k, n, num_blocks = config.num_speculative_tokens, config.max_num_seqs, self.kv.blocks.num_ids
        # fla runs the GDN prefill of long prompts (bf16 / fp16 on CUDA): their chunks are cut where its bits agree
        self.gdn_rule = GdnPrefillRule.create(chunked_prefill_min_len(self.loaded.model, self.device),
                                              config.max_num_batched_tokens)
        self.scheduler = Scheduler(self.kv, n, config.max_num_batched_tokens, num_lookahead_tokens(spec),
                                   config.long_prefill_token_threshold, self.gdn_rule)
        proposer = make_proposer(spec, drafter, num_blocks, self.kv.num_state_slots, self.device, config.seed,
                                 graphs, self.hf_config.hidden_size, cache.kv_cache_dtype)
        warm_up(config, self.runner, self.scheduler, proposer, self.gdn_rule, num_blocks, cache.block_size)
        self.spec_metrics = SpecDecodeMetrics(k)
        self.draft_length = DraftLengthPolicy(k, spec.min_draft_acceptance if spec is not None else None)
        governs = spec is not None and spec.governor == "auto"
        self.governor = SpeculationGovernor() if governs else None  # whether a step drafts at all, by measurement
        # whether the next step may draft at all, and the drafts a request's next step verifies (closures, not bound
        # methods: the async scheduler keeps them, and a reference back to the engine would keep a dropped engine's
        # caches alive until the cycle collector)
        self.may_draft = draft_gate(self.governor, self.scheduler,
                                     spec.disable_by_batch_size if spec is not None else None)
        self.num_drafts = draft_counter(self.draft_length, self.spec_metrics, self.may_draft)
        self.seqs: dict[str, Sequence] = {}
        self.parents = ParentRequests()  # requests with n > 1, whose children are in seqs
        # after each step the proposer's turn: propose, or take the drafts left on the device (``self.proposer``)
        self.handoff = DraftHandoff(proposer, self.seqs, self.scheduler, self.draft_length, self.may_draft,
                                    self.num_drafts)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size,
                                              self.structured_outputs)
        queue_decodes, queue_verifies = queued_steps(config.async_scheduling, self.device.type, proposer,
                                                     spec is not None and spec.draft_on_device is True)
        drafter = proposer if queue_verifies else None
        self.overlap = AsyncScheduler(self.scheduler, self.runner, self.seqs, enabled=queue_decodes, drafter=drafter,
                                      num_drafts=self.num_drafts,
                                      may_draft=self.may_draft if proposer is not None else None)
        # called after a request's tokens of a step are applied, with its number of accepted drafts (tests and
        # `truespec verify --debug-fault` observe or perturb the engine through these)
        self.update_hooks: list[Callable[[Sequence, int], None]] = []
        self._stepping = threading.Lock()  # held by the thread inside step()

    @property
    def proposer(self) -> Proposer | None:
        """The drafts' source (None without speculation); tests may swap it."""
        return self.handoff.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self.handoff.proposer = proposer

    @staticmethod
    def check_config(config: EngineConfig) -> tuple[CacheConfig, torch.device]:
        """Everything that can be checked before anything loads: the cache settings, the device, and the
        drafter (from its files' configs and headers). Returns the cache config and the device."""
        device = _resolve_device(config.device)
        cache = CacheConfig.from_engine_config(config)
        check_speculative_config(config.speculative_config, config.model)
        return cache, device

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams) -> Request:
        """Validate one request and build it, without touching engine state: its Sequence, or with ``n > 1`` a
        ParentRequest over n child Sequences (engine/parallel_sampling.py)."""
        return self.input_processor.make_request(prompt, params)

    def add_sequence(self, seq: Sequence) -> None:
        self.structured_outputs.add(seq.request_id, seq.params)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def add(self, request: Request) -> None:
        """Queue a request ``make_request`` built (a parent: all its children)."""
        if isinstance(request, Sequence):
            return self.add_sequence(request)
        self.parents.add(request)
        for child in request.children:
            self.add_sequence(child)

    def add_request(self, prompt: PromptType, params: SamplingParams) -> str:
        request = self.make_request(prompt, params)
        self.add(request)
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        """Abort a request (a parent: every child); its blocks and state slots go back to the pools."""
        parent = self.parents.pop(request_id)
        for seq_id in [c.request_id for c in parent.children] if parent is not None else [request_id]:
            seq = self.seqs.pop(seq_id, None)
            self.structured_outputs.forget(seq_id)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.output_processor.forget(seq_id)
        self.overlap.drop_if_finished()

    def final_output(self, request: Request) -> RequestOutput:
        """The output of a request that finished without handing it out (aborted from elsewhere)."""
        if isinstance(request, Sequence):
            return self.output_processor.make_output(request)
        return request.make_output([self.output_processor.make_output(c) for c in request.unreported_children()])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule -> run -> process outputs -> propose drafts. Returns the outputs the step produced (as each
        request's ``output_kind`` asks). A step queued by async scheduling is collected here."""
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("LLMEngine.step is running in another thread: one engine steps one batch at a time "
                               "(LLM.generate serialises its callers; do the same around the engine)")
        try:
            launched = self.overlap.take()
            if launched is None:  # a step planned on the host; a queued one has no constrained request
                sched = self.scheduler.schedule()
                sched.grammar_bitmask = self.structured_outputs.bitmask(sched.scheduled)
            else:
                sched = launched.sched
            if not sched.scheduled:
                if self.governor is not None:
                    self.governor.pause()  # idle: the next step's interval is not its cost
                self.handoff.forget_finished()  # idle: what the proposer keeps for finished requests
                return []
            try:
                launched = launched or self.overlap.launch(sched)
                ahead = self.overlap.launch_next(launched)
                output = self.runner.collect(launched)
                updated = self._update(sched.scheduled, output, provisional=ahead == "decode")
                if launched.device_drafts is None:
                    self.handoff.propose(sched, output, may_draft=ahead != "decode", shifted=launched.shift is not None)
                else:
                    self.handoff.take_device_drafts(sched, output, launched.device_drafts, is_queued=ahead == "verify")
            except BaseException:
                self._restart(sched)
                raise
            self.overlap.drop_if_finished()
            if self.governor is not None:  # the step ends here: the governor times it
                self.governor.observe_step(sum(map(len, output.sampled_token_ids)), len(sched.scheduled),
                                           sched.is_decode_only)
        finally:
            self._stepping.release()
        outputs = [out for seq in updated if (out := self.output_processor.make_output(seq)) is not None]
        return self.parents.aggregate(outputs)  # children's outputs -> their parents' (n > 1)

    def _update(self, scheduled: list[ScheduledRequest], output: ModelRunnerOutput,
                provisional: bool) -> list[Sequence]:
        """Apply the step to its requests: progress, drafts used up, new tokens (until a stop). The requests with
        an output to hand out (see ``OutputProcessor.wants_output``). ``provisional``: async scheduling already
        advanced them and appended a placeholder token."""
        updated, now, has_drafts = [], time.monotonic(), False
        for r, tokens, logprobs, prompt_logprobs in zip(scheduled, output.sampled_token_ids, output.logprobs,
                                                        output.prompt_logprobs, strict=True):
            seq = self.seqs.get(r.request_id)
            if seq is None or seq.is_finished:  # aborted, or stopped at a step queued before this one was read
                continue
            num_accepted = len(tokens) - 1 if tokens else 0
            if provisional:
                seq.output_token_ids.pop()
            else:
                seq.advance(r.num_new_tokens, num_accepted)
            if prompt_logprobs:
                self.output_processor.add_prompt_logprobs(seq, prompt_logprobs)
            if not tokens:  # a prefill chunk that is not the request's last
                continue
            if seq.draft_token_ids:  # used up by this step (or cut to what the request may still emit)
                seq.draft_token_ids, seq.draft_probs = [], None
            self.structured_outputs.accept(r.request_id, tokens)
            if r.draft_token_ids:
                has_drafts = True
                self.spec_metrics.observe(len(r.draft_token_ids), num_accepted)
                self.draft_length.observe(r.request_id, len(r.draft_token_ids), num_accepted)
            reason = self.output_processor.process(seq, tokens, logprobs, now)
            if reason is not None:  # nothing after the stop leaks out
                self.scheduler.finish(seq, reason)
                self.seqs.pop(seq.request_id, None)
                self.structured_outputs.forget(seq.request_id)
            for hook in self.update_hooks:
                hook(seq, num_accepted)
            if self.output_processor.wants_output(seq):
                updated.append(seq)
        self.spec_metrics.observe_step(has_drafts)
        return updated

    def _restart(self, sched: SchedulerOutput) -> None:
        """After an error in a step: every request of the step (and of a step queued after it) restarts from its
        tokens, since the forward may have overwritten state slots (and drafter caches) that were never accounted
        for. Their output is unchanged. The finished requests the step reported are reported again."""
        queued = self.overlap.take()
        self.scheduler.report_finished(sched.finished_req_ids + (queued.sched.finished_req_ids if queued else []))
        self.scheduler.prefix.discard_saves(sched.state_saves + (queued.sched.state_saves if queued else []))
        for r in [*sched.scheduled, *(queued.sched.scheduled if queued is not None else [])]:
            seq = self.seqs.get(r.request_id)
            if seq is None:  # it finished in this step: nothing will hand out its output
                self.output_processor.forget(r.request_id)
                continue
            if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER:
                seq.output_token_ids.pop()  # a token the step never delivered
            if not seq.is_finished and seq in self.scheduler.running:
                self.scheduler.preempt(seq)

    def cache_info(self) -> dict[str, int]:
        return self.kv.cache_info() | {"kv_bytes_per_token": self.runner.kv_bytes_per_token,
                                       "state_bytes_per_slot": self.runner.state_bytes_per_slot}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and state checkpoint (vLLM's); False while a request holds a cached block."""
        return self.kv.reset_prefix_cache()

    def get_metrics(self) -> dict[str, object]:
        """The speculative-decoding counters, the governor's, and the prefix cache's (in tokens, as vLLM's)."""
        governor = self.governor.as_dict() if self.governor is not None else SpeculationGovernor().as_dict()
        prefix = {"prefix_cache_queries": self.kv.num_queried_tokens, "prefix_cache_hits": self.kv.num_hit_tokens}
        return self.spec_metrics.as_dict() | governor | prefix


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return torch.device(device)
