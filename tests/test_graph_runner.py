"""CUDA-graph plumbing that needs no GPU: the padded step layout, padding inertness through the Triton kernels
(interpreted on CPU), the runner's eager fallback, and compilation_config validation.

The graph-vs-eager runs themselves are in tests/test_gpu_graphs.py (``@pytest.mark.gpu``).
"""

import logging
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter (see tests/helpers/kernels.py)
    os.environ["TRITON_INTERPRET"] = "1"

from truespec import LLM, SamplingParams  # noqa: E402
from truespec.config import CompilationConfig, EngineConfig  # noqa: E402
from truespec.core.scheduler_output import ScheduledRequest  # noqa: E402
from truespec.forward_context import set_forward_context  # noqa: E402
from truespec.kv_cache.layout import allocate_caches  # noqa: E402
from truespec.models.loader import load_model  # noqa: E402
from truespec.worker.graph_runner import GraphRunner, GraphSettings  # noqa: E402
from truespec.worker.input_builder import ContextRow, build_step, packed_size  # noqa: E402
from truespec.worker.model_runner import ModelRunner  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_eager_steps_inputs_go_to_the_device_without_waiting_for_it() -> None:
    """An eager step's packed inputs (no static buffer) go through pinned memory: a copy from pageable memory would
    wait for every kernel queued before it (torch's sync debug mode raises on such a copy), and equal the CPU's."""
    rows = [ContextRow([3, 4, 5], 14, 3, 5, 6, 0, 3), ContextRow([7], 2, 1, -1, 9, 0, 1)]
    cuda = torch.device("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = build_step(rows, [11, 12, 13, 14], [14, 15, 16, 2], 8, cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = build_step(rows, [11, 12, 13, 14], [14, 15, 16, 2], 8, CPU)
    assert step.input_ids.cpu().tolist() == expected.input_ids.tolist()
    assert torch.equal(step.ctx.block_tables.cpu(), expected.ctx.block_tables)


def test_build_step_pads_with_inert_rows() -> None:
    rows = [ContextRow([3, 4, 5], 14, 3, 5, 6, 0, 3), ContextRow([7], 2, 1, -1, 9, 0, 1)]
    step = build_step(rows, [11, 12, 13, 14], [14, 15, 16, 2], 8, CPU, pad_to=6, width=3)
    ctx = step.ctx
    assert step.input_ids.tolist() == [11, 12, 13, 14, 0, 0]
    assert step.positions.tolist() == [14, 15, 16, 2, 0, 0]
    assert ctx.slot_mapping.tolist() == [4 * 8 + 6, 4 * 8 + 7, 5 * 8, 7 * 8 + 2, -1, -1]  # padding writes nothing
    assert ctx.query_start_loc.tolist() == [0, 3, 4, 4, 4, 4, 4]  # padded requests own no tokens
    assert ctx.seq_lens.tolist() == [17, 3, 0, 0, 0, 0]
    assert ctx.state_src.tolist() == [5, -1, -1, -1, -1, -1]
    assert ctx.state_dst.tolist() == [6, 9, -1, -1, -1, -1]  # and no state
    assert ctx.block_tables.tolist() == [[3, 4, 5], [7, -1, -1]] + [[-1, -1, -1]] * 4
    assert ctx.logits_indices.tolist() == [0, 1, 2, 3]
    assert ctx.query_start_loc_cpu == [0, 3, 4] and ctx.seq_lens_cpu == [17, 3]
    # host copies of the real requests' values, for eager paths that choose a kernel per request
    assert ctx.state_cpu == ([5, -1], [6, 9], [0, 0]) and ctx.max_query_len == 3


def test_build_step_into_a_static_buffer_writes_the_used_table_cells() -> None:
    """A graph's static buffer: metadata as for a fresh buffer; of the block table, the real rows' used columns
    (the kernels read nothing else), whatever an earlier, wider step left in the other cells."""
    out = torch.full((packed_size(6, 6, 5),), 77, dtype=torch.int64)
    wide = [ContextRow([1, 2, 3, 4], 20, 2, 0, 1, 0, 1), ContextRow([5, 6, 7], 9, 1, 2, 3, 0, 1)]
    build_step(wide, [1, 2, 3], [20, 21, 9], 8, CPU, pad_to=6, width=5, out=out)
    rows = [ContextRow([3, 4, 5], 14, 3, 5, 6, 0, 3), ContextRow([7], 2, 1, -1, 9, 0, 1)]
    step = build_step(rows, [11, 12, 13, 14], [14, 15, 16, 2], 8, CPU, pad_to=6, width=5, out=out)
    fresh = build_step(rows, [11, 12, 13, 14], [14, 15, 16, 2], 8, CPU, pad_to=6, width=5)
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "state_src", "state_dst", "state_write_start",
                 "logits_indices"):
        assert torch.equal(getattr(step.ctx, name), getattr(fresh.ctx, name)), name
    assert torch.equal(step.input_ids, fresh.input_ids) and torch.equal(step.positions, fresh.positions)
    assert step.ctx.block_tables[:2, :3].tolist() == [[3, 4, 5], [7, -1, -1]]
    assert step.ctx.block_tables[0, 3].item() == 4  # left from the wider step: beyond every real seq_len


def test_num_prompt_rows_of_each_kind_of_row_and_inert_padding() -> None:
    """ScheduledRequest.num_prompt_rows = clamp(prompt_len - start, 0, query_len) reaches the packed step (fresh and
    a graph's static buffer) for every kind of row; padding requests have 0; a step without prompt rows has None."""
    params = SamplingParams(temperature=0)

    def scheduled(start: int, n: int, prompt_len: int, drafts: list[int] | None = None) -> ScheduledRequest:
        drafts = drafts or []
        blocks = list(range(-(-(start + n + len(drafts)) // 8)))
        return ScheduledRequest("r", params, start, n + len(drafts), [1] * n + drafts, drafts, None, blocks, 0, 0, 0,
                                True, prompt_len)  # fmt: skip

    step = [scheduled(6, 19, 40),  # a prefill chunk starting mid-block over cached context
            scheduled(12, 1, 13),  # a 1-token last prompt chunk
            scheduled(97, 1, 30),  # a plain decode
            scheduled(80, 1, 50, [5, 6, 7]),  # a 1+3 verify
            scheduled(66, 12, 70)]  # a re-prefill after preemption: prompt positions 66..69, outputs 70..77
    assert [r.num_prompt_rows for r in step] == [19, 1, 0, 0, 4]
    rows, ids, positions = ModelRunner.prepare(step)
    assert [row.num_prompt_rows for row in rows] == [19, 1, 0, 0, 4]
    expected = [19, 1, 0, 0, 4] + [0] * 35  # padded requests: no prompt rows
    assert build_step(rows, ids, positions, 8, CPU).ctx.num_prompt_rows.tolist() == expected[:5]
    assert build_step(rows, ids, positions, 8, CPU, pad_to=40, width=13).ctx.num_prompt_rows.tolist() == expected
    out = torch.full((packed_size(40, 40, 13),), 77, dtype=torch.int64)  # a graph's static buffer, stale values
    assert build_step(rows, ids, positions, 8, CPU, pad_to=40, width=13, out=out).ctx.num_prompt_rows.tolist() == \
        expected
    rows, ids, positions = ModelRunner.prepare(step[2:4])
    assert build_step(rows, ids, positions, 8, CPU, pad_to=8, width=13).ctx.num_prompt_rows is None


def test_fla_chunk_flags_reach_the_forward_context_and_padding_is_false() -> None:
    """A GdnPrefillRule's path (ScheduledRequest.gdn_chunked) reaches ForwardContext.gdn_chunked_cpu for a chunk of a
    long prompt's prompt rows only: not for its rows past the prompt (a re-prefill's outputs), a decode, or a short
    prompt; padding requests False; without a rule None (the layer's length rule)."""
    params = SamplingParams(temperature=0)

    def scheduled(start: int, n: int, prompt_len: int, path: bool | None) -> ScheduledRequest:
        return ScheduledRequest("r", params, start, n, [1] * n, [], None, list(range(-(-(start + n) // 8))), 0, 0, 0,
                                True, prompt_len, [], path)  # fmt: skip

    step = [scheduled(0, 64, 1100, True),  # a long prompt's first chunk
            scheduled(1088, 12, 1100, True),  # its 12-token last chunk
            scheduled(1100, 5, 1100, True),  # its outputs recomputed after preemption
            scheduled(1200, 1, 1100, True),  # its decode
            scheduled(0, 300, 500, False)]  # a short prompt's chunk
    rows, ids, positions = ModelRunner.prepare(step)
    assert [row.gdn_chunked for row in rows] == [True, True, False, False, False]
    assert build_step(rows, ids, positions, 8, CPU).ctx.gdn_chunked_cpu == [True, True, False, False, False]
    padded = build_step(rows, ids, positions, 8, CPU, pad_to=400, width=200).ctx.gdn_chunked_cpu
    assert padded == [True, True, False, False, False] + [False] * 395
    rows, ids, positions = ModelRunner.prepare([scheduled(0, 2000, 2000, None)])
    assert build_step(rows, ids, positions, 8, CPU).ctx.gdn_chunked_cpu is None


def test_a_step_with_an_fla_chunk_never_replays_a_graph(tiny_models: dict[str, Path]) -> None:
    """fla's launch sizes come from the host, so a step with a row for it runs eagerly (its size would fit a graph)."""
    model = load_model(tiny_models["qwen3"], "float64", CPU).model
    runner = GraphRunner(model, "target", GraphSettings(block_size=4), CPU, prompt_rows=True)
    runner.mode, runner.sizes, runner.variants = "FULL", [4, 8], (False, True)  # as if captured on a GPU
    runner.graphs = {(size, variant): None for size in runner.sizes for variant in runner.variants}
    rows = [ContextRow([0], 0, 3, -1, 0, 2, 1, 3, gdn_chunked) for gdn_chunked in (None, False, True)]
    assert [runner._graph_size([row], 3, False, True) for row in rows] == [4, 4, None]
    assert runner._graph_size(rows[:2], 6, False, True) == 8
    # a step planned ahead (shift) never holds one: its GDN layers would silently take the token loop
    with pytest.raises(ValueError, match="planned ahead"):
        runner.run(rows[2:], [1, 2, 3], [0, 1, 2], shift=torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("pad_to", [None, 7, 8])
def test_every_step_tensor_starts_16_byte_aligned(pad_to: int | None) -> None:
    """Triton compiles a kernel apart for a pointer that is not 16-byte aligned: odd token and request counts (an
    eager step's, a graph size's) must not shift the later segments of the packed step off alignment."""
    for num_reqs in (1, 2, 3):
        rows = [ContextRow([2 * r, 2 * r + 1], 3, 1 + r % 2, 2 * r, 2 * r, 0, 1) for r in range(num_reqs)]
        n = sum(row.query_len for row in rows)
        step = build_step(rows, [5] * n, [3] * n, 8, CPU, pad_to=pad_to)
        ctx = step.ctx
        tensors = [step.input_ids, step.positions, ctx.query_start_loc, ctx.seq_lens, ctx.slot_mapping,
                   ctx.block_tables, ctx.state_src, ctx.state_dst, ctx.state_write_start, ctx.logits_indices]
        assert all(t.data_ptr() % 16 == 0 for t in tensors)
        assert ctx.query_start_loc.shape[0] == (pad_to or num_reqs) + 1 and step.input_ids.shape[0] == (pad_to or n)


def test_build_step_unpadded_and_errors() -> None:
    rows = [ContextRow([3, 4, 5], 14, 3, 5, 6, 0, 1)]
    step = build_step(rows, [1, 2, 3], [14, 15, 16], 8, CPU)
    assert step.ctx.slot_mapping.tolist() == [38, 39, 40]
    assert step.ctx.logits_indices.tolist() == [2]
    assert step.ctx.block_tables.tolist() == [[3, 4, 5]]
    assert packed_size(6, 6, 3) == 4 * 6 + (7 + 1) + 5 * 6 + 18  # query_start_loc's 7 take 8: the next starts aligned
    with pytest.raises(ValueError, match="does not fit pad_to"):
        build_step(rows, [1, 2, 3], [14, 15, 16], 8, CPU, pad_to=2)
    with pytest.raises(ValueError, match="more than the 1 a step allows"):
        build_step(rows, [1, 2, 3], [14, 15, 16], 8, CPU, pad_to=4, width=1)


def _run(model: torch.nn.Module, rows: list[ContextRow], ids: list[int], pos: list[int], pad_to: int | None,
         width: int) -> torch.Tensor:
    step = build_step(rows, ids, pos, 4, CPU, pad_to=pad_to, width=width if pad_to else None)
    with set_forward_context(step.ctx):
        return model(step.input_ids, step.positions)


def _caches(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [layer.kv_cache.clone() for layer in model.attention_layers()]
    for layer in model.gdn_layers():
        out += [layer.conv_state.clone(), layer.ssm_state.clone()]
    return out


def _restore(model: torch.nn.Module, caches: list[torch.Tensor]) -> None:
    it = iter(caches)
    for layer in model.attention_layers():
        layer.kv_cache.copy_(next(it))
    for layer in model.gdn_layers():
        layer.conv_state.copy_(next(it))
        layer.ssm_state.copy_(next(it))


@torch.inference_mode()
def test_padded_step_equals_unpadded_through_the_kernels(tiny_models: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What a replayed graph computes: the same step padded with inert rows gives bitwise the same hidden
    states for the real rows and bitwise the same KV cache and recurrent states (the kernels on CPU)."""
    pytest.importorskip("triton")
    import truespec.layers.attention as attention
    import truespec.layers.gdn as gdn

    monkeypatch.setattr(attention, "use_kernels", lambda t: True)
    monkeypatch.setattr(gdn, "use_kernels", lambda t: True)
    model = load_model(tiny_models["hybrid"], "float64", CPU).model
    allocate_caches(model, num_blocks=12, block_size=4, num_state_slots=8, device=CPU)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=gen).tolist() for n in (6, 3, 5)]
    blocks = [[0, 1, 2], [3, 4], [5, 6, 7]]
    # step 1: three prefills (state groups of 2 slots each start at 0, 2, 4)
    rows = [ContextRow(b, 0, len(p), -1, 2 * i, len(p) - 1, 1)
            for i, (b, p) in enumerate(zip(blocks, prompts, strict=True))]
    _run(model, rows, sum(prompts, []), [q for p in prompts for q in range(len(p))], None, 3)
    before = _caches(model)
    # step 2, mixed: a decode, a verify of 1 + 1 drafts (states kept after each), a continued prefill chunk
    rows = [ContextRow(blocks[0], 6, 1, 0, 0, 0, 1), ContextRow(blocks[1], 3, 2, 2, 2, 0, 2),
            ContextRow(blocks[2], 5, 4, 4, 4, 3, 1)]
    ids = torch.randint(5, 300, (7,), generator=gen).tolist()
    pos = [6, 3, 4, 5, 6, 7, 8]
    eager = _run(model, rows, ids, pos, None, 3)
    eager_caches = _caches(model)
    for pad_to in (7, 8, 16):
        _restore(model, before)
        padded = _run(model, rows, ids, pos, pad_to, 3)
        assert padded.shape[0] == pad_to
        padded_caches = _caches(model)
        if pad_to == 7:  # padded requests only (the same matmul shapes): bitwise
            assert torch.equal(padded[:7], eager)
            assert all(torch.equal(a, b) for a, b in zip(padded_caches, eager_caches, strict=True))
        else:  # padded tokens too: the projections' matmuls see more rows, which may round differently
            torch.testing.assert_close(padded[:7], eager, rtol=0, atol=1e-12)
            for a, b in zip(padded_caches, eager_caches, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        for a, b, old in zip(padded_caches, eager_caches, before, strict=True):  # padding wrote nothing
            assert torch.equal(a != old, b != old)


def test_runner_without_cuda_runs_eagerly_and_says_why(tiny_models: dict[str, Path],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    model = load_model(tiny_models["qwen3"], "float64", CPU).model
    settings = GraphSettings(mode="FULL", capture_sizes=[1, 2, 4], block_size=4, max_blocks_per_req=4)
    with caplog.at_level(logging.INFO, logger="truespec"):
        runner = GraphRunner(model, "target", settings, CPU)
    assert not runner.enabled and "has no CUDA graphs" in caplog.text
    runner.capture()  # nothing to capture
    allocate_caches(model, 4, 4, 1, CPU)
    hidden, inputs = runner.run([ContextRow([0], 0, 2, -1, -1, 1, 1)], [5, 6], [0, 1], decode_only=False)
    assert hidden.shape[0] == 2 and inputs.ctx.logits_indices.tolist() == [1]
    assert runner.stats == {"eager": 1}


def test_only_the_target_runner_routes_prompt_rows(tiny_models: dict[str, Path]) -> None:
    """The target's forward carries its rows' prompt counts; a drafter's (prompt_rows=False), handed the same rows
    by draft_on_device, runs every row split-KV (num_prompt_rows None)."""
    model = load_model(tiny_models["qwen3"], "float64", CPU).model
    allocate_caches(model, 4, 4, 1, CPU)
    rows = [ContextRow([0], 0, 1, -1, -1, 0, 1, 1), ContextRow([1], 0, 2, -1, -1, 1, 1, 0)]
    for prompt_rows, expected in ((True, [1, 0]), (False, None)):
        runner = GraphRunner(model, "target", GraphSettings(block_size=4), CPU, prompt_rows=prompt_rows)
        _, inputs = runner.run(rows, [5, 6, 7], [0, 0, 1], decode_only=False)
        counts = inputs.ctx.num_prompt_rows
        assert (counts if counts is None else counts.tolist()) == expected


def test_compilation_config_validation() -> None:
    assert EngineConfig(model="m").cudagraph_mode == "FULL"
    assert EngineConfig(model="m", enforce_eager=True).cudagraph_mode == "NONE"
    cfg = EngineConfig(model="m", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                      "cudagraph_capture_sizes": [8, 1, 2]})
    assert cfg.cudagraph_mode == "FULL_DECODE_ONLY"
    assert cfg.compilation_config.capture_sizes(1000) == [1, 2, 8]
    assert cfg.compilation_config.capture_sizes(4) == [1, 2]
    assert CompilationConfig().capture_sizes(20) == [1, 2, 4, 8, 16]
    assert CompilationConfig(max_cudagraph_capture_size=24).capture_sizes(10_000)[-1] == 24
    for bad, match in [({"cudagraph_mode": "PIECEWISE"}, "torch.compile"), ({"cudagraph_mode": "full"}, "one of"),
                       ({"level": 3}, "unknown keys"), ({"cudagraph_capture_sizes": [0]}, "positive ints"),
                       ({"cudagraph_capture_sizes": []}, "non-empty"), ({"max_cudagraph_capture_size": -1}, "positive"),
                       ("FULL", "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model="m", compilation_config=bad)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model="m", enforce_eager="yes")


def test_full_cudagraph_mode_is_recorded_and_runs_eagerly_on_cpu(tiny_models: dict[str, Path]) -> None:
    """vLLM's graph arguments are accepted and recorded (FULL asked, FULL by default, NONE with enforce_eager);
    without CUDA the graph runner captures nothing and every step runs eagerly, so the tokens are the same."""
    params = SamplingParams(temperature=0, max_tokens=8)
    runs = [("FULL", {"compilation_config": {"cudagraph_mode": "FULL"}}), ("NONE", {"enforce_eager": True}),
            ("FULL", {})]
    outs = []
    for mode, kwargs in runs:
        llm = LLM(str(tiny_models["hybrid"]), dtype="float64", **kwargs)
        outs.append([o.outputs[0].token_ids for o in llm.generate(["def f(x):", "import os"], params)])
        config = llm.llm_engine.config
        assert config.cudagraph_mode == mode, kwargs
        assert config.compilation_config.cudagraph_mode == "FULL", kwargs  # enforce_eager overrides, not rewrites
        stats = llm.llm_engine.runner.graphs.stats
        assert stats["graph"] == 0 and stats["eager"] > 0, (kwargs, stats)
    assert outs[0] == outs[1] == outs[2]
