"""Builds the per-step tensors, runs the model, samples.

Owns the device-side caches: paged KV for every attention layer and recurrent-state slots for
every GDN layer, bound to the layers once at start-up.
"""

import torch

from truespec.engine.block_manager import BlockManager
from truespec.engine.scheduler import ScheduledSeq
from truespec.engine.sequence import Sequence
from truespec.engine.state_manager import StateManager
from truespec.forward_context import ForwardContext, set_forward_context
from truespec.layers.sampler import sample
from truespec.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.attention_layers = list(model.attention_layers())
        self.gdn_layers = list(model.gdn_layers())
        self._generators: dict[str, torch.Generator] = {}
        self._num_generators_made = 0

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
        for layer in self.attention_layers:
            layer.kv_cache = torch.zeros(layer.kv_cache_shape(num_blocks, block_size), dtype=self.dtype,
                                         device=self.device)
        for layer in self.gdn_layers:
            (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = layer.state_shapes(), layer.state_dtypes()
            layer.conv_state = torch.zeros(num_state_slots, *conv_shape, dtype=conv_dtype, device=self.device)
            layer.ssm_state = torch.zeros(num_state_slots, *ssm_shape, dtype=ssm_dtype, device=self.device)

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], blocks: BlockManager, states: StateManager,
                banned_token_ids: list[list[int]]) -> list[int | None]:
        """Run one step; returns the sampled token for each request whose last chunk ran, else None."""
        input_ids, positions, ctx = self.prepare(scheduled, blocks, states)
        with set_forward_context(ctx):
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden[ctx.logits_indices])
        sampling = [s for s in scheduled if s.is_last_chunk]
        banned = [b for s, b in zip(scheduled, banned_token_ids, strict=True) if s.is_last_chunk]
        for row, ids in enumerate(banned):
            if ids:
                logits[row, ids] = float("-inf")
        tokens = iter(sample(logits, [s.seq.params for s in sampling],
                             [self._generator(s.seq) for s in sampling]))
        return [next(tokens) if s.is_last_chunk else None for s in scheduled]

    def prepare(self, scheduled: list[ScheduledSeq], blocks: BlockManager,
                states: StateManager) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens, state_src, state_dst, write_start, logits_indices = [], [], [], [], []
        for s in scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slot_mapping += (blocks.slot(seq, p) for p in range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            state_src.append(states.current_slot(seq))
            state_dst.append(states.first_slot(seq))
            write_start.append(n - 1)  # plain decode / prefill chunk: keep the last token's state
            if s.is_last_chunk:
                logits_indices.append(query_start_loc[-1] - 1)
        width = max(len(s.seq.block_ids) for s in scheduled)
        tables = [s.seq.block_ids + [-1] * (width - len(s.seq.block_ids)) for s in scheduled]
        t = self._tensor
        ctx = ForwardContext(
            query_start_loc=t(query_start_loc), seq_lens=t(seq_lens), slot_mapping=t(slot_mapping),
            block_tables=t(tables), state_src=t(state_src), state_dst=t(state_dst),
            state_write_start=t(write_start), logits_indices=t(logits_indices),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)
        return t(input_ids), t(positions), ctx

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    # ---- per-request generators ------------------------------------------------------------
    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.is_greedy:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(_request_seed(seq.params, self.seed, self._num_generators_made))
            self._num_generators_made += 1
            self._generators[seq.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)


def _request_seed(params: SamplingParams, engine_seed: int, counter: int) -> int:
    if params.seed is not None:
        return params.seed
    return (engine_seed * 1_000_003 + counter) % (2**63)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
