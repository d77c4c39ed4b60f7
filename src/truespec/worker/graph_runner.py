"""One forward per step of a model (the target or a drafter): eager, or a replayed CUDA graph.

Graphs are keyed by the step's token count, padded up to the next capture size. A step of T tokens and R <= T
requests runs the graph of the smallest capture size S >= T with S token rows and S request rows: the rows past
the real ones are inert (input_builder.py), so the kernels write no KV and no state for them (docs/ARCHITECTURE.md,
invariant 3). Every real row runs the same kernels as eagerly; only the projections' matmuls see S rows instead of
T, which can round differently (as any change of batch shape can; tests/test_graph_runner.py, test_gpu_graphs.py).
Every per-step input lives in static buffers updated in place before the replay: one host-to-device copy
of the packed int64 metadata, plus the hidden states a draft head reads.

Which steps replay a graph (``cudagraph_mode``):
- NONE: none.
- FULL_DECODE_ONLY: steps without prefill chunks (decodes, verifies of 1 + k tokens, drafter steps), up to
  the largest capture size.
- FULL: every step up to the largest capture size, prefill chunks included.
Steps with prompt rows (query positions before a request's prompt length: prefill chunks, also a 1-token last
chunk, and the prompt part of a re-prefill) run their attention's prompt rows in the prefill kernel
(kernels/step_attention.py), which steps without them never launch. So the target (``prompt_rows=True``) in FULL
mode captures two graphs per size, one with the prefill launch and one without, and a step replays the one its rows
ask for (whether any row has prompt rows is a dispatch key, like the size; the counts themselves live in the static
buffer). FULL_DECODE_ONLY captures only the graphs without, so a step with prompt rows runs eagerly. A drafter's
rows all run split-KV, the target's rows it catches up on included (``prompt_rows=False``). A step with a row whose
GDN recurrence runs fla's chunk kernel (``ContextRow.gdn_chunked``: its launch sizes come from the host) is never one
graph: in FULL mode it replays the target's graphs in pieces between fla's calls (piecewise_graphs.py), as do the
target's steps larger than the largest capture size (where fla is in force), else eagerly.
The layers' backend says whether it can run inside a graph at all (layers/backend.py); if not, nothing is
captured and the log says why. Larger steps run eagerly; ``stats`` counts each kind.
"""

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from truespec.forward_context import set_forward_context
from truespec.layers.backend import cudagraph_unsupported_reason
from truespec.worker.input_builder import ContextRow, StepInputs, build_step, device_inputs
from truespec.worker.piecewise_graphs import PiecewiseGraphs, bucket_sizes
from truespec.worker.static_inputs import StaticInputs

logger = logging.getLogger("truespec")


@dataclass(frozen=True)
class GraphSettings:
    """What the engine decides once for the target and every drafter (the same mode for all: a drafter
    replays graphs whenever the target does)."""

    mode: str = "NONE"
    capture_sizes: list[int] = field(default_factory=list)
    block_size: int = 16
    max_blocks_per_req: int = 0  # block-table columns of a captured step


class GraphRunner:
    def __init__(self, model: torch.nn.Module, name: str, settings: GraphSettings, device: torch.device,
                 hidden_size: int | None = None, hidden_dtype: torch.dtype | None = None, num_staging: int = 4,
                 prompt_rows: bool = False) -> None:
        self.model, self.name, self.block_size, self.device = model, name, settings.block_size, device
        self.prompt_rows = prompt_rows  # prompt rows go to the prefill kernel (the target's; a drafter's never do)
        self.hidden_size, self.hidden_dtype = hidden_size, hidden_dtype
        self.uses_hidden = bool(getattr(model, "uses_target_hidden", False))
        self.width = settings.max_blocks_per_req
        self.mode = mode = settings.mode
        self.sizes = sorted(settings.capture_sizes) if mode != "NONE" else []
        reason = cudagraph_unsupported_reason(device) if self.sizes else None
        if (reason is None and self.sizes and model.dtype == torch.float64
                and any(layer.kv_format is not None for layer in model.attention_layers())):
            reason = ("a float64 model reads a compressed kv_cache_dtype through the torch reference attention, which "
                      "reads its metadata on the host")
        if reason is not None:
            logger.info("%s: cudagraph_mode=%s but every step runs eagerly: %s", name, mode, reason)
            self.sizes = []
        # keyed by (capture size, has prompt rows): FULL mode's steps with prompt rows need the prefill launch
        self.variants = (False, True) if prompt_rows and mode == "FULL" else (False,)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.piecewise: PiecewiseGraphs | None = None  # steps with fla's chunk kernel (capture_piecewise)
        self.stats: Counter[str] = Counter()  # "graph" / "piecewise" / "piecewise_ahead" (moved) / "eager" forwards
        if not self.sizes:
            return
        top = self.sizes[-1]
        self._inputs = StaticInputs(self.sizes, self.width, self.block_size, device, num_staging)
        self._hidden = torch.zeros(top, hidden_size, dtype=hidden_dtype, device=device) if self.uses_hidden else None
        eager = "steps with prefill chunks or prompt rows, and " if mode == "FULL_DECODE_ONLY" else ""
        logger.info("%s: cudagraph_mode=%s, capture sizes %s; %ssteps over %d tokens run eagerly",
                    name, mode, self.sizes, eager, top)

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    # ---- capture -------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size and variant (with and without the prefill launch), largest first, all in one
        memory pool (replays never overlap)."""
        if not self.sizes:
            return
        with torch.cuda.device(self.device):
            self._capture()

    def _capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):
            for has_prompt_rows in self.variants:
                inputs = self._inputs.build([], [], [], size, staged=False)
                if has_prompt_rows:  # the static counts (all 0 now) are the step's when it replays
                    inputs.ctx.num_prompt_rows = self._inputs.views[size][9]
                with set_forward_context(inputs.ctx):
                    self._call(inputs, size)  # compile / autotune the kernels outside the capture
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._call(inputs, size)
                pool = graph.pool()
                self.graphs[size, has_prompt_rows] = (graph, out)
        torch.cuda.synchronize(self.device)

    def capture_piecewise(self, max_num_tokens: int, max_num_reqs: int, prompt_cap: int | None = None) -> None:
        """Capture the steps whose GDN prefill runs fla's chunk kernel in pieces (worker/piecewise_graphs.py), up to
        ``max_num_tokens`` tokens (``prompt_cap``: see ``bucket_sizes``): the target in FULL mode, after ``warm_up``."""
        sizes = bucket_sizes(max_num_tokens, prompt_cap)
        if self.mode != "FULL" or not self.sizes or not self.prompt_rows or self.uses_hidden or not sizes:
            return
        self.piecewise = PiecewiseGraphs(self.model, sizes, max_num_reqs, self.block_size, self.width, self.device)
        self.piecewise.capture()
        logger.info("%s: steps with fla's chunk kernel replay piecewise graphs of %s tokens", self.name, sizes)

    # ---- warm-up -------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int, num_blocks: int, gdn_chunked: bool = False) -> None:
        """Run eager forwards of one request at the row counts whose kernels nothing else compiles (on CUDA):
        the largest step (``max_num_tokens`` rows, and one fewer: Triton specialises integer arguments on
        divisibility by 16) and one row count per matmul tile, so no user's long prompt waits for a Triton compile or
        an fla autotune. ``gdn_chunked`` (a GdnPrefillRule is in force): each row count through the token loop and
        through fla, and a step of a decode beside a long prompt's chunk (the token loop then takes its gates as
        tensors: its own kernel variant, compiled in the first such step otherwise, ~1.1 s on an H200). Writes KV
        into blocks 0.. and no recurrent state (slot -1): nothing a request reads before writing it itself."""
        if self.device.type != "cuda":
            return
        max_num_tokens = min(max_num_tokens, num_blocks * self.block_size)
        sizes = sorted({n for n in (1, 16, 17, 65, 513, max_num_tokens - 1, max_num_tokens) if 0 < n <= max_num_tokens})
        with torch.cuda.device(self.device):
            for n, path in ((n, path) for n in sizes for path in ((False, True) if gdn_chunked else (None,))):
                self._warm_up_step([self._warm_up_prompt(n, path)])
            if gdn_chunked and max_num_tokens > 1:
                decode = ContextRow([0], 0, 1, -1, -1, 0, 1, 0, False)
                self._warm_up_step([decode, self._warm_up_prompt(max_num_tokens - 1, True)])
            torch.cuda.synchronize(self.device)

    def _warm_up_prompt(self, n: int, gdn_chunked: bool | None) -> ContextRow:
        """A prompt of ``n`` tokens from position 0 (the target's prefill kernel compiles), state slot -1."""
        return ContextRow(list(range(-(-n // self.block_size))), 0, n, -1, -1, n - 1, 1, n if self.prompt_rows else 0,
                          gdn_chunked)  # fmt: skip

    def _warm_up_step(self, rows: list[ContextRow]) -> None:
        positions = [row.start + i for row in rows for i in range(row.query_len)]
        inputs = build_step(rows, [0] * len(positions), positions, self.block_size, self.device)
        hidden = (torch.zeros(len(positions), self.hidden_size, dtype=self.hidden_dtype, device=self.device)
                  if self.uses_hidden else None)  # fmt: skip
        with set_forward_context(inputs.ctx):
            self._call(inputs, None, hidden)

    # ---- one forward ---------------------------------------------------------------------------
    def run(self, rows: list[ContextRow], input_ids: list[int], positions: list[int],
            hidden: torch.Tensor | None = None, decode_only: bool = False,
            input_ids_from: torch.Tensor | None = None,
            shift: torch.Tensor | None = None) -> tuple[torch.Tensor, StepInputs]:
        """The model's final hidden states [T, H] for the step's T tokens (a fresh tensor), and its inputs.
        ``input_ids_from``: a device tensor whose first T values are the input ids (copied on the device, in
        stream order, over the host's ``input_ids``). ``shift``: [R] device tensor, request r's positions move
        that far (``shift_positions``)."""
        num_tokens = len(input_ids)
        chunked = any(row.gdn_chunked for row in rows)
        if shift is not None and chunked:  # fla plans from the host's positions, which a shift leaves behind
            raise ValueError("a step planned ahead (shift) holds a request for fla's chunk kernel: such requests join "
                             "only steps planned on the host (engine/verify_plan.may_admit)")
        # piecewise: steps with fla's chunk kernel, and every step above the full graphs' sizes (a step planned ahead,
        # ``shift``, never holds an fla request: its GDN layers take the token loop on the device's metadata)
        if self.piecewise is not None and (num_tokens > self.sizes[-1] or chunked):
            size = self.piecewise.bucket(num_tokens, len(rows))
            if size is not None:
                self.stats["piecewise" if shift is None else "piecewise_ahead"] += 1
                return self.piecewise.run(rows, input_ids, positions, size, input_ids_from, shift)
        # a drafter reading the target's rows (draft_on_device) runs them all split-KV, prompt rows or not
        has_prompt_rows = self.prompt_rows and any(row.num_prompt_rows for row in rows)
        size = self._graph_size(rows, num_tokens, decode_only, has_prompt_rows)
        if size is None:
            self.stats["eager"] += 1
            inputs = build_step(rows, input_ids, positions, self.block_size, self.device)
            if not has_prompt_rows:
                inputs.ctx.num_prompt_rows = None
            inputs.ctx.is_prompt_only = has_prompt_rows and all(row.num_prompt_rows == row.query_len for row in rows)
            device_inputs(inputs, num_tokens, len(rows), self.block_size, input_ids_from, shift)
            with set_forward_context(inputs.ctx):
                return self._call(inputs, None, hidden), inputs
        self.stats["graph"] += 1
        with torch.cuda.device(self.device):  # the stream of this device, also for device="cuda:N"
            inputs = self._inputs.build(rows, input_ids, positions, size)
            device_inputs(inputs, num_tokens, len(rows), self.block_size, input_ids_from, shift)
            if hidden is not None:
                self._hidden[:len(input_ids)].copy_(hidden)
            graph, out = self.graphs[size, has_prompt_rows]
            graph.replay()
            return out[:num_tokens].clone(), inputs

    def _graph_size(self, rows: list[ContextRow], num_tokens: int, decode_only: bool,
                    has_prompt_rows: bool) -> int | None:
        """The capture size whose graph runs the step; None: eager."""
        if not self.graphs or (self.mode == "FULL_DECODE_ONLY" and not decode_only):
            return None
        if any(row.gdn_chunked for row in rows):  # fla's launch sizes come from the host: never captured
            return None
        if has_prompt_rows not in self.variants:  # FULL_DECODE_ONLY: a 1-token last prompt chunk runs eagerly
            return None
        return next((s for s in self.sizes if s >= num_tokens), None)

    def _call(self, inputs: StepInputs, size: int | None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if not self.uses_hidden:
            return self.model(inputs.input_ids, inputs.positions)
        return self.model(inputs.input_ids, inputs.positions, hidden if size is None else self._hidden[:size])

