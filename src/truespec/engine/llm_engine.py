"""The engine: validate and add requests, then step: schedule -> run -> postprocess."""

import itertools

import torch

from truespec.config import EngineConfig
from truespec.engine.block_manager import BlockManager
from truespec.engine.cache_sizing import resolve_max_model_len, size_kv_pool
from truespec.engine.graph_runner import GraphSettings
from truespec.engine.model_runner import LaunchedStep, ModelRunner
from truespec.engine.scheduler import ScheduledSeq, Scheduler
from truespec.engine.sequence import PLACEHOLDER, Sequence
from truespec.engine.state_manager import StateManager
from truespec.engine.stop_checker import StopChecker
from truespec.models.loader import load_model
from truespec.sampling_params import SamplingParams
from truespec.spec_decode.metrics import SpecDecodeMetrics
from truespec.spec_decode.proposer import make_proposer
from truespec.tokenizer import load_tokenizer

PromptType = str | dict


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self.loaded = loaded = load_model(config.model, config.dtype, self.device)
        self.hf_config, self.dtype, self.mtp_weights = loaded.hf_config, loaded.dtype, loaded.mtp_weights
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.runner = ModelRunner(loaded.model, self.device, self.dtype, config.seed)
        k = config.num_speculative_tokens
        num_blocks = size_kv_pool(config, self.runner, self.max_model_len, config.max_num_seqs * (1 + k))
        self.state_manager = StateManager(num_groups=config.max_num_seqs, slots_per_group=1 + k)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.runner.allocate_caches(num_blocks, config.block_size, self.state_manager.num_slots)
        self.graph_settings = GraphSettings(
            mode=config.cudagraph_mode, block_size=config.block_size,
            capture_sizes=config.compilation_config.capture_sizes(config.max_num_batched_tokens
                                                                  + config.max_num_seqs * k),
            max_blocks_per_req=-(-(self.max_model_len + k + 1) // config.block_size))
        self.runner.init_graphs(self.graph_settings)
        self.scheduler = Scheduler(self.block_manager, self.state_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.stop_checker = StopChecker(self.tokenizer, self.hf_config, config.model)
        self.proposer = make_proposer(config.speculative_config, loaded, self.block_manager, self.state_manager,
                                      self.scheduler.max_drafts, self.device, config.seed, self.graph_settings)
        self.spec_metrics = SpecDecodeMetrics(k)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._async = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self._inflight: LaunchedStep | None = None  # a step queued by async scheduling, collected next
        self.num_async_steps = 0  # steps queued before the previous one's tokens were read

    # ---- requests ------------------------------------------------------------------------------
    def make_sequence(self, prompt: PromptType, params: SamplingParams) -> Sequence:
        """Validate one request and build its Sequence, without touching engine state."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (the prompt must leave room for one output token)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        max_output_len = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_output_len = min(max_output_len, params.max_tokens)
        return Sequence(f"{next(self._ids)}", text, token_ids, params, max_output_len)

    def add_sequence(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(self, prompt: PromptType, params: SamplingParams) -> str:
        seq = self.make_sequence(prompt, params)
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self.runner.release(request_id)
        self._drop_finished_inflight()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step loop ---------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedule -> run (verify drafts) -> postprocess -> propose drafts for the next step.
        Returns the requests that finished in this step.

        With async scheduling, a step whose requests all decode greedily on without drafts queues the next
        step before reading its own tokens (``_launch_next``); the next call collects that one."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
        scheduled = launched.scheduled if launched is not None else out.scheduled
        try:
            if launched is None:
                launched = self.runner.launch(scheduled, self.state_manager, self.stop_checker)
            provisional = self._launch_next(launched)
            step = self.runner.collect(launched)
            finished = [s.seq for s, tokens, logprobs in zip(launched.scheduled, step.tokens, step.logprobs,
                                                             strict=True)
                        if not s.seq.is_finished and self._postprocess(s, tokens, logprobs, provisional)]
            if self.proposer is not None:  # requests that got a new token decode next: draft for them
                self.proposer.propose(launched.scheduled, step)
        except BaseException:
            # The forward may have overwritten state slots (and drafter caches) that postprocess never
            # accounted for: every request of the step (and of a step queued after it) restarts from its
            # tokens, so none runs on from a half-written state. Their output is unchanged; the error goes to
            # the caller.
            queued = [] if self._inflight is None else self._inflight.scheduled
            self._inflight = None
            for s in [*scheduled, *queued]:
                if s.seq.output_token_ids and s.seq.output_token_ids[-1] == PLACEHOLDER:
                    s.seq.output_token_ids.pop()  # a token the step never delivered
                if not s.seq.is_finished and s.seq in self.scheduler.running:
                    self.scheduler.preempt(s.seq)
            raise
        self._drop_finished_inflight()
        return finished

    def _drop_finished_inflight(self) -> None:
        """Forget a queued step whose requests all stopped or were aborted: nothing will read its tokens."""
        if self._inflight is not None and all(s.seq.is_finished for s in self._inflight.scheduled):
            self._inflight = None

    def _launch_next(self, launched: LaunchedStep) -> bool:
        """Async scheduling: if every request of ``launched`` goes on to a greedy one-token decode, advance
        them past ``launched`` with a placeholder token, schedule and queue the next step, its input ids
        copied on the device from ``launched``'s argmax. True if it did.

        Only what no token value changes is done ahead: positions, KV blocks, state slots. A request that
        stops at ``launched`` (EOS, stop token or string) has its queued token discarded; the KV and state
        that token wrote went to blocks and slots it held, and anything that reuses them later is queued
        after it on the same stream. Each request's rows are computed as without the overlap (invariant 1),
        so outputs are unchanged (tests/test_async_scheduling.py)."""
        if not self._async or self.proposer is not None:
            return False
        if self.scheduler.waiting and len(self.scheduler.running) < self.config.max_num_seqs:
            return False  # the next step may admit a waiting request: its prompt goes in a step planned on the host
        seqs = [s.seq for s in launched.scheduled]
        if seqs != self.scheduler.running or len(seqs) > self.config.max_num_batched_tokens:
            return False
        blocks = 0
        for s in launched.scheduled:
            p = s.seq.params
            if (not s.is_last_chunk or s.draft_token_ids or not p.is_greedy or p.logprobs is not None
                    or len(s.seq.output_token_ids) + 2 > s.seq.max_output_len):
                return False
            blocks += self.block_manager.num_blocks_needed(s.seq, s.num_new_tokens + 1)
        if blocks > self.block_manager.num_free_blocks:
            return False
        for s in launched.scheduled:
            self._advance(s, num_accepted=0)
            s.seq.output_token_ids.append(PLACEHOLDER)
        out = self.scheduler.schedule()
        if [s.seq for s in out.scheduled] != seqs or out.preempted or any(s.query_len != 1 for s in out.scheduled):
            raise RuntimeError(f"async scheduling: the next step is not the decode of {seqs} it was planned as")
        self._inflight = self.runner.launch(out.scheduled, self.state_manager, self.stop_checker,
                                            input_ids_from=launched.argmax)
        self.num_async_steps += 1
        return True

    def _advance(self, s: ScheduledSeq, num_accepted: int) -> None:
        """Move the request past its computed tokens and ``num_accepted`` verified drafts."""
        seq = s.seq
        seq.num_computed_tokens += s.num_new_tokens + num_accepted
        seq.state_index = num_accepted  # the slot holding the state after the last accepted token

    def _postprocess(self, s: ScheduledSeq, tokens: list[int], logprobs: list[dict[int, float]] | None,
                     provisional: bool = False) -> bool:
        """Advance the request past what was verified; append its new tokens. True if it finished.
        ``provisional``: ``_launch_next`` already advanced it and appended a placeholder for its one token."""
        seq = s.seq
        num_accepted = max(len(tokens) - 1, 0)
        if provisional:
            seq.output_token_ids.pop()
        else:
            self._advance(s, num_accepted)
        if tokens:  # the last chunk ran: its drafts are used up
            seq.draft_token_ids, seq.draft_probs = [], None
            self.spec_metrics.observe(len(s.draft_token_ids), num_accepted)
        for i, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[i])
            reason = self.stop_checker.check(seq)
            if reason is not None:  # nothing after the stop leaks out
                self.scheduler.finish(seq, reason)
                self.runner.release(seq.request_id)
                self.seqs.pop(seq.request_id, None)
                return True
        return False

    # ---- helpers ---------------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(type(t) is int for t in ids):  # bool is no token
                raise ValueError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                         f"got {type(prompt).__name__}")

    def cache_info(self) -> dict[str, int]:
        return {
            "block_size": self.block_manager.block_size,
            "num_blocks": self.block_manager.num_blocks,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_state_slots": self.state_manager.num_groups,
            "num_free_state_slots": self.state_manager.num_free_groups,
            "kv_bytes_per_token": self.runner.kv_bytes_per_token,
        }


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return torch.device(device)
