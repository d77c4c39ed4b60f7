"""A drafter's whole drafting behind a uniform greedy verify, as one CUDA graph replay: a hidden-state head's (MTP,
EAGLE), or a draft model's (``reads_tokens``).

``ModelDrafter.draft_on_device`` queues a step's acceptance, catch-up and k draft steps as separate launches, each
with metadata packed on the host: on a small target that host work is longer than the device's. When every
request of the step verifies the same number of drafts (query length q = 1 + k), the chain below does the same
work inside one captured graph, keyed by the request count padded up to a capture size S:

1. acceptance: request r's drafts are query rows r q + 1 .. r q + k; draft j is accepted while it equals the
   argmax of the row before it; the next token is the argmax of the row after the last accepted draft;
2. catch-up: the verify's own rows at its positions (the device's, already moved), each row's token the argmax
   of that row (as ``draft_on_device``); the first draft from the row of the last accepted position;
3. draft steps j = 1 .. k - 1: one token per request at position start + accepted + j.
All metadata is computed on the device inside the graph, by one launch (``kernels.chain_metadata``; its torch
reference ``ops.spec_step.chain_metadata_ref`` on CPU), from five static inputs (argmax, input ids, hidden
states, start positions, block tables) and the request count; requests past it are inert (no query tokens, KV
slot -1, context length 0). Every real row computes what the launches of ``draft_on_device`` compute (the
projections are row invariant, attention is per row), so the drafts are the same (tests/test_gpu_spec_exactness.py).

A draft model reads tokens, not hidden states (``device_drafts.draft_by_launches``): its catch-up has one row more
per request (the position after the query), fed the step's first input token and then each row's argmax, and each
draft sits one position later. Its metadata is computed by torch ops inside the graph (``_token_chain``); the
acceptance comes from the same launch as a head's.
"""

import torch

from truespec.forward_context import ForwardContext, set_forward_context
from truespec.layers.backend import kernels, use_kernels
from truespec.ops.spec_step import ChainMetadata, chain_metadata_ref, kv_slots_on_device
from truespec.spec_decode.device_drafts import DeviceDrafts

MAX_CHAIN_REQUESTS = 64  # larger batches use draft_on_device's launches (their logits rows would dominate memory)


class DraftChain:
    def __init__(self, head: torch.nn.Module, k: int, sizes: list[int], width: int, block_size: int,
                 hidden_size: int | None, device: torch.device, reads_tokens: bool = False) -> None:
        self.head, self.k, self.q, self.width, self.block_size = head, k, 1 + k, width, block_size
        self.reads_tokens = reads_tokens  # a draft model: no hidden states in, one catch-up row more per request
        self.sizes = [s for s in sorted(sizes) if s <= MAX_CHAIN_REQUESTS]
        top = self.sizes[-1] if self.sizes else 0
        long = dict(dtype=torch.int64, device=device)
        # the step's rows as the verify packed them (request r's 1 + d_r rows from query_start_loc[r])
        self.argmax = torch.zeros(top * self.q, **long)
        self.input_ids = torch.zeros(top * self.q, **long)
        self.hidden = None if reads_tokens else torch.zeros(top * self.q, hidden_size, dtype=head.dtype, device=device)
        self.positions = torch.zeros(top * self.q, **long)
        self.query_start_loc = torch.zeros(top + 1, **long)
        self.tables = torch.full((top, width), -1, **long)
        self.num_reqs = torch.zeros((), **long)
        self.meta = ChainMetadata.empty(top, k, device)  # computed inside the graph by one launch
        self.no_state = torch.full((top,), -1, **long)  # constants of every forward's context
        self.zeros = torch.zeros(top, **long)
        self.rows = torch.arange(top * (self.q + reads_tokens), **long)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, in one memory pool (after the head's caches are allocated)."""
        pool = None
        for size in reversed(self.sizes):
            self._body(size)  # compile / autotune outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                accepted, next_ids = self._body(size)
            pool = graph.pool()
            self.graphs[size] = (graph, accepted, next_ids)

    def can_run(self, num_reqs: int, query_lens: list[int], width: int) -> bool:
        return (num_reqs <= (self.sizes[-1] if self.sizes else 0) and all(n <= self.q for n in query_lens)
                and width <= self.width)

    def run(self, argmax: torch.Tensor, input_ids: torch.Tensor, hidden: torch.Tensor | None, positions: torch.Tensor,
            query_start_loc: torch.Tensor, tables: torch.Tensor, num_tokens: int) -> DeviceDrafts:
        """The drafts of a step of R requests of at most q tokens each (``can_run``): its argmax, input ids, hidden
        states (None: ``reads_tokens``) and positions [num_tokens], query_start_loc [R + 1] and block tables [R, <=
        width], on the device."""
        num_reqs = len(query_start_loc) - 1
        size = next(s for s in self.sizes if s >= num_reqs)
        self.argmax[:num_tokens].copy_(argmax[:num_tokens])
        self.input_ids[:num_tokens].copy_(input_ids[:num_tokens])
        if self.hidden is not None:
            self.hidden[:num_tokens].copy_(hidden[:num_tokens])
        self.positions[:num_tokens].copy_(positions[:num_tokens])
        self.query_start_loc[:num_reqs + 1].copy_(query_start_loc)
        if tables.shape[1] < self.width:
            self.tables[:num_reqs].fill_(-1)
        self.tables[:num_reqs, :tables.shape[1]].copy_(tables[:num_reqs])
        self.num_reqs.fill_(num_reqs)
        if size in self.graphs:
            graph, accepted, next_ids = self.graphs[size]
            graph.replay()
        else:  # not captured (a test on CPU): the same work, launched op by op
            accepted, next_ids = self._body(size)
        return DeviceDrafts(accepted[:num_reqs].clone(), next_ids[:num_reqs].clone())

    # ---- what the graph holds ------------------------------------------------------------------------
    def _body(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, num_tokens, meta = self.k, size * self.q, self.meta
        fill = kernels().chain_metadata if use_kernels(self.argmax) else chain_metadata_ref
        fill(self.argmax, self.input_ids, self.positions, self.query_start_loc, self.tables, self.num_reqs, size, k,
             self.block_size, meta)
        if self.reads_tokens:
            return self._token_chain(size)
        # catch-up: the verify's own rows (request r's 1 + d_r rows from its query start); rows past the last are
        # padding
        positions = self.positions[:num_tokens]
        ctx = self._context(meta.step_qsl[:size + 1], meta.seq_lens[:size], positions, meta.slots[:num_tokens], size)
        with set_forward_context(ctx):
            out = self.head(self.argmax[:num_tokens], positions, self.hidden[:num_tokens])
        hidden = out.index_select(0, meta.hidden_rows[:size])  # [S, H]: at the last accepted position
        drafts = [self._argmax(hidden)]
        for step in range(1, k):  # draft steps: one token per request
            positions = meta.draft_positions[step - 1, :size]
            ctx = self._context(meta.chain_qsl[:size + 1], meta.draft_seq_lens[step - 1, :size], positions,
                                meta.draft_slots[step - 1, :size], size)
            with set_forward_context(ctx):
                hidden = self.head(drafts[-1], positions, hidden)
            drafts.append(self._argmax(hidden))
        return meta.accepted, torch.stack([meta.next_token[:size], *drafts], dim=1)

    def _token_chain(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft model's catch-up and draft steps (the acceptance already in ``self.meta``): request r's catch-up
        rows are positions start .. start + len_r (its query and the position after it), fed its first input token
        and then the argmax of each of its rows; the first draft comes from the row of its new token (start +
        accepted + 1), draft j is fed at the position after it + j. Requests past ``num_reqs`` are padding."""
        meta, k, q1 = self.meta, self.k, self.q + 1
        device, num_tokens = self.argmax.device, size * q1
        last = self.argmax.shape[0] - 1
        step_qsl = meta.step_qsl[:size + 1]
        first, lens = step_qsl[:-1], step_qsl.diff()
        req = torch.arange(size, device=device)
        is_real = req < self.num_reqs
        accepted = meta.accepted[:size]
        start = self.positions[first.clamp(max=last)]
        qsl = step_qsl + torch.minimum(torch.arange(size + 1, device=device), self.num_reqs)  # one more row each
        token = torch.arange(num_tokens, device=device)
        owner = torch.searchsorted(qsl[1:], token, right=True).clamp(max=size - 1)
        offset = token - qsl[owner]  # the row's place in its request's catch-up
        positions = start[owner] + offset
        row = first[owner] + offset - 1  # the verify row whose argmax it is fed (offset 0: the first input token)
        ids = torch.where(offset == 0, self.input_ids[first[owner].clamp(max=last)],
                          self.argmax[row.clamp(min=0, max=last)])
        slots = kv_slots_on_device(self.tables[:size], owner, positions, self.block_size, token < qsl[size])
        seq_lens = torch.where(is_real, start + lens + 1, 0)
        with set_forward_context(self._context(qsl, seq_lens, positions, slots, size)):
            out = self.head(ids, positions)
        hidden = out.index_select(0, qsl[:-1] + accepted + 1)  # [S, H]: at the new token
        drafts = [self._argmax(hidden)]
        for step in range(1, k):  # draft steps: one token per request
            at = start + accepted + 1 + step
            slots = kv_slots_on_device(self.tables[:size], req, at, self.block_size, is_real)
            with set_forward_context(self._context(meta.chain_qsl[:size + 1], torch.where(is_real, at + 1, 0), at,
                                                   slots, size)):
                hidden = self.head(drafts[-1], at)
            drafts.append(self._argmax(hidden))
        return accepted, torch.stack([meta.next_token[:size], *drafts], dim=1)

    def _context(self, qsl: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 size: int) -> ForwardContext:
        """A chain forward's metadata: the computed per-request values and the constant ones (no state, every row
        a logits row), all views of static buffers, so the graph holds no kernel for them."""
        num_tokens = len(positions)
        return ForwardContext(
            query_start_loc=qsl, seq_lens=seq_lens, slot_mapping=slots, block_tables=self.tables[:size],
            state_src=self.no_state[:size], state_dst=self.no_state[:size], state_write_start=self.zeros[:size],
            logits_indices=self.rows[:num_tokens],
            query_start_loc_cpu=list(range(0, num_tokens + 1, num_tokens // size)), seq_lens_cpu=None)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head.compute_logits(hidden)
        return (logits if logits.dtype == torch.float64 else logits.float()).argmax(dim=-1)
