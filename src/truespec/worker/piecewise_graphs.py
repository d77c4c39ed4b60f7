"""Steps whose GDN prefill runs fla's chunk kernel, replayed from CUDA graphs in pieces (issue 17).

fla's launch sizes come from the host (a step's chunk count), so such a step is never one graph (graph_runner.py),
and run eagerly its forward is bound by the host: ~350 kernel launches from Python for an 8K-token step of the
Qwen3.5-0.8B shape, ~40-60 ms of host time against ~33 ms of GPU time (BENCHMARKS.md, session 27). Everything in it
but fla's calls reads device metadata only, so the forward is captured in pieces cut at those calls: piece 1 runs
from the embedding to the first GDN layer's gates; fla runs eagerly on that layer's q / k / v / g / beta (the conv
writes q / k / v, the gating kernel g / beta, into static buffers that every GDN layer shares) and its output is
copied into a static tensor; piece 2 runs from there to the next GDN layer's gates; and so on (that shape: 18 fla
calls between 19 replays). The
pieces of every bucket are captured on one stream into one memory pool (the caching allocator reuses a freed block
only on the stream that freed it), and replay one step at a time, in capture order.

Buckets are token counts: 256, 512, then multiples of 1,024 up to the step budget, and the size of a step that
computes a capped prompt chunk beside up to 256 decode / verify rows (2,304 by default) (the row-invariant matmul
changes path above 512 rows, kernels/row_invariant_matmul.py: a bucket takes the path of the eager steps it serves). A
step pads to its bucket with inert rows and to ``max_num_reqs`` request rows (input_builder.py). fla never sees the
padding (the step's plan takes the requests' rows), the conv and the token loop leave padding rows to zeros, and every
other kernel computes a real row as it would in the eager step (with ``batch_invariant=True``, the default, the
projections do not see the row count), so a replayed step gives the eager step's bits. Two variants per bucket, as an
eager step chooses: every row a prompt row (the split-KV attention kernel not launched; the padding rows' attention
output is then never written, and stays in those rows) or not.

The target's other steps above the full graphs' largest size (graph_runner.py, 512 tokens by default: short prompts
batched together, a long prompt's last chunk, verifies of many requests) replay the same pieces: for them every GDN
layer's call between two pieces is the token loop alone (``gdn_chunked`` without a chunked request; g / beta as
tensors, the bits of the fused-gates launch an eager step makes). So do such steps planned ahead (verifies queued
ahead, with requests joining: ``shift``), moved on the device like the full graphs' steps: they never hold a request
for fla (engine/verify_plan.py), and their GDN layers' calls take the token loop on the device's metadata without the
host's (layers/gdn.py).

Before each capture, a dry run of the same forward with the recorder, fla called in place: every Triton kernel
variant the pieces launch compiles outside the capture.
"""

from collections.abc import Callable

import torch

from truespec.forward_context import ForwardContext, get_forward_context, set_forward_context
from truespec.worker.input_builder import ContextRow, StepInputs, device_inputs
from truespec.worker.static_inputs import StaticInputs

BUCKET_TOKENS = 1024  # bucket spacing above SMALL_BUCKETS: a step computes at most 1,023 padding rows
SMALL_BUCKETS = (256, 512)  # a long prompt's last chunk beside decodes may be short
MIXED_ROWS = 256  # the rows a mixed step's bucket leaves beside its prompt chunk (decodes, verifies)


def bucket_sizes(max_num_tokens: int, prompt_cap: int | None = None) -> list[int]:
    """SMALL_BUCKETS, multiples of BUCKET_TOKENS, and ``max_num_tokens`` itself, up to ``max_num_tokens``; with
    ``prompt_cap`` (the most prompt tokens a request computes in a step beside decodes, ChunkPlanner.mixed_prefill_cap)
    also ``prompt_cap + MIXED_ROWS``: such a step (a 2,048-token chunk and 8 decodes) would otherwise pad to the next
    multiple of 1,024 (3,072 rows for 2,056)."""
    mixed = () if prompt_cap is None else (prompt_cap + MIXED_ROWS,)
    sizes = {*SMALL_BUCKETS, *range(BUCKET_TOKENS, max_num_tokens + 1, BUCKET_TOKENS), max_num_tokens, *mixed}
    return sorted(s for s in sizes if s <= max_num_tokens)


def fill_flags(flags: torch.Tensor, plan: Callable[[ForwardContext], object] | None, ctx: ForwardContext) -> None:
    """Before a replay: the static per-request ``flags`` the conv reads, from the step's plan (built here once for
    the step's fla calls too), zeros where no request of the step takes fla's chunk kernel. A step moved on the device
    (no host copy of its state sources, which the plan reads) has no such request (GraphRunner.run): zeros."""
    step_flags = plan(ctx).chunked_flags if plan is not None and ctx.state_cpu is not None else None
    flags.zero_()
    if step_flags is not None:
        flags[:step_flags.shape[0]].copy_(step_flags)


class PieceRecorder:
    """ForwardContext.pieces while a bucket's forward is dry-run or captured: the GDN layers' hooks."""

    def __init__(self, owner: "PiecewiseGraphs", capturing: bool) -> None:
        self.owner, self.capturing = owner, capturing
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.ops: list[tuple[Callable[[ForwardContext], torch.Tensor], torch.Tensor]] = []  # (fla's call, its output)

    def chunked_flags(self, plan: Callable[[ForwardContext], object]) -> torch.Tensor:
        """The static [max_num_reqs] flags the conv reads (ChunkedPlan.chunked_flags); ``plan`` builds a step's plan
        (the first GDN layer's, shared by all), called before each replay to fill them."""
        self.owner.plan = self.owner.plan or plan
        return self.owner.flags

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.owner.buffer(name, numel, dtype)

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.owner.pool)
        self.graphs.append(graph)

    def eager(self, fn: Callable[[ForwardContext], torch.Tensor]) -> torch.Tensor:
        """End the piece, run ``fn`` (fla's call) on the step's context, return its output in a static tensor that
        the next piece (begun here) reads; at each replay ``fn`` runs again on the replayed step's context."""
        ctx = get_forward_context()
        if not self.capturing:
            return fn(ctx)
        self.graphs[-1].capture_end()
        out = fn(ctx)
        static = self.owner.buffer("eager_out", out.numel(), out.dtype).view(out.shape)
        static.copy_(out)
        del out  # freed before the next capture begins
        self.ops.append((fn, static))
        self.begin()
        return static


class PiecewiseGraphs:
    """The target's piecewise graphs: static inputs, buckets, capture and replay (module docstring)."""

    def __init__(self, model: torch.nn.Module, sizes: list[int], max_num_reqs: int, block_size: int, width: int,
                 device: torch.device, num_staging: int = 2) -> None:  # fmt: skip
        self.model, self.sizes, self.max_num_reqs = model, sorted(sizes), max_num_reqs
        self.device, self.block_size = device, block_size
        self._inputs = StaticInputs(self.sizes, width, block_size, device, num_staging, num_reqs=max_num_reqs)
        self.flags = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.plan: Callable[[ForwardContext], object] | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self._buffers: dict[str, torch.Tensor] = {}
        # (bucket, every row a prompt row) -> (pieces, fla's calls with their static outputs, the forward's output)
        self.captured: dict[tuple[int, bool], tuple[list, list, torch.Tensor]] = {}

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A static buffer shared by every bucket (the largest bucket's size, allocated at its capture)."""
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            if buf is not None and self.captured:
                raise RuntimeError(f"piecewise buffer {name!r} grew after a capture (largest bucket first)")
            assert not torch.cuda.is_current_stream_capturing(), "static buffers are allocated outside captures"
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def bucket(self, num_tokens: int, num_reqs: int) -> int | None:
        if num_reqs > self.max_num_reqs:
            return None
        return next((s for s in self.sizes if s >= num_tokens), None)

    # ---- capture -------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Dry-run and capture each bucket and variant, largest first, all on one side stream."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
            for size in reversed(self.sizes):
                for prompt_only in (False, True):
                    self._capture(size, prompt_only, stream)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # what the captures' eager sections cached on the side stream

    def _capture(self, size: int, prompt_only: bool, stream: torch.cuda.Stream) -> None:
        inputs = self._inputs.build([], [], [], size, staged=False)  # every row inert: no KV, no state written
        inputs.ctx.num_prompt_rows = self._inputs.views[size][9]  # the prefill launch (its counts: each step's)
        inputs.ctx.is_prompt_only = prompt_only
        inputs.ctx.pieces = PieceRecorder(self, capturing=False)
        with set_forward_context(inputs.ctx):
            self.model(inputs.input_ids, inputs.positions)  # compiles every kernel variant outside the capture
        torch.cuda.synchronize(self.device)
        recorder = inputs.ctx.pieces = PieceRecorder(self, capturing=True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), set_forward_context(inputs.ctx):
            try:
                recorder.begin()
                out = self.model(inputs.input_ids, inputs.positions)
            finally:  # an error inside a piece must not leave the stream capturing (and hide itself)
                if torch.cuda.is_current_stream_capturing():
                    recorder.graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.captured[size, prompt_only] = (recorder.graphs, recorder.ops, out)

    # ---- replay --------------------------------------------------------------------------------
    def run(self, rows: list[ContextRow], input_ids: list[int], positions: list[int], size: int,
            input_ids_from: torch.Tensor | None = None,
            shift: torch.Tensor | None = None) -> tuple[torch.Tensor, StepInputs]:  # fmt: skip
        """The final hidden states [T, H] of the step (a fresh tensor) and its inputs, from the bucket ``size``.
        ``shift``: the step was planned ahead and moves on the device (``shift_positions``); it has no request for
        fla's chunk kernel (whose call plans from the host's positions), so its GDN layers run the token loop."""
        num_tokens = len(input_ids)
        prompt_only = all(row.num_prompt_rows == row.query_len for row in rows)
        with torch.cuda.device(self.device):
            inputs = self._inputs.build(rows, input_ids, positions, size)
            device_inputs(inputs, num_tokens, len(rows), self.block_size, input_ids_from, shift)
            with set_forward_context(inputs.ctx):
                out = self._replay(self.captured[size, prompt_only], inputs.ctx)
            return out[:num_tokens].clone(), inputs

    def _replay(self, captured: tuple[list, list, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        graphs, ops, out = captured
        fill_flags(self.flags, self.plan, ctx)
        for graph, op in zip(graphs, ops + [None], strict=True):
            graph.replay()
            if op is not None:
                fn, static = op
                static.copy_(fn(ctx))
        return out
