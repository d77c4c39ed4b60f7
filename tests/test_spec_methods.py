"""Every speculative method (ngram, draft_model, mtp, eagle) x k in {1, 3, 8} x {one request; >= 8
heterogeneous requests with max_num_batched_tokens=8, so prefill chunks, drafted verifies and plain decodes
share steps; a KV pool small enough to preempt}: float64 greedy output equals the run without speculation."""

from pathlib import Path

import pytest

from helpers.engine import BATCH_LENGTHS, random_prompts, spec_config
from truespec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SHAPES = {"single": {}, "mixed": {"max_num_batched_tokens": 8},
          "preempting": {"num_gpu_blocks_override": 28, "max_num_batched_tokens": 48}}


@pytest.fixture(scope="module")
def setups(tiny_models: dict[str, Path], hybrid_with_heads: dict[str, Path]) -> dict[str, dict]:
    """Per target (hybrid with MTP weights; dense qwen3): prompts, reference output, drafter models."""
    out = {}
    for name, target, draft, eagle in [("hybrid", hybrid_with_heads["target"], tiny_models["qwen3"],
                                        hybrid_with_heads["eagle"]),
                                       ("dense", tiny_models["qwen3"], tiny_models["llama"],
                                        hybrid_with_heads["eagle_dense"])]:
        prompts = random_prompts(BATCH_LENGTHS, seed=11)
        base = LLM(str(target), dtype="float64", device="cpu", max_model_len=400)
        ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY, use_tqdm=False)]
        out[name] = {"target": target, "prompts": prompts, "ref": ref,
                     "models": {"draft": draft, "eagle": eagle}}
    return out


@pytest.fixture(scope="module")
def setup(setups: dict[str, dict]) -> dict:
    return setups["hybrid"]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("method, target", [("ngram", "hybrid"), ("draft_model", "hybrid"), ("mtp", "hybrid"),
                                            ("eagle", "hybrid"), ("ngram", "dense"), ("draft_model", "dense"),
                                            ("eagle", "dense")])
def test_speculative_method_is_lossless(setups: dict, method: str, target: str, k: int, shape: str) -> None:
    setup = setups[target]
    llm = LLM(str(setup["target"]), dtype="float64", device="cpu", max_model_len=400,
              speculative_config=spec_config(method, k, setup["models"]), **SHAPES[shape])
    prompts, ref = (setup["prompts"][5:6], setup["ref"][5:6]) if shape == "single" else (setup["prompts"], setup["ref"])
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == ref
    metrics = llm.get_metrics()
    if method != "ngram":
        assert metrics["num_drafts"] > 0
    if shape == "preempting":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_disable_by_batch_size_drafts_only_in_small_batches(setup: dict, method: str) -> None:
    """vLLM's disable_by_batch_size: no drafts while 4 or more requests run, drafting again below that. The
    drafter keeps catching up meanwhile: with the target as its own draft model every draft is accepted, which
    fails if a catch-up-only step left its KV or recurrent state behind."""
    config = spec_config(method, 3, setup["models"]) | {"disable_by_batch_size": 4}
    if method == "draft_model":
        config["model"] = str(setup["target"])
    llm = LLM(str(setup["target"]), dtype="float64", device="cpu", max_model_len=400, max_num_batched_tokens=16,
              speculative_config=config)
    assert [o.outputs[0].token_ids for o in llm.generate(setup["prompts"], GREEDY, use_tqdm=False)] == setup["ref"]
    metrics = llm.get_metrics()
    assert metrics["num_steps_without_drafts"] > 0 and metrics["num_drafts"] > 0
    assert metrics["num_steps_without_drafts"] < metrics["num_steps"]
    if method == "draft_model":
        assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"]


@pytest.mark.parametrize("mixed", [False, True], ids=["random", "random and greedy"])
def test_seeded_random_sampling_with_a_draft_model_is_batch_invariant(setup: dict, mixed: bool) -> None:
    """Seeded random requests (and, mixed, greedy ones beside them: one step's drafts then come from an argmax and
    from each request's own drafter stream, read back together) give their solo tokens in a batch."""
    params = [SamplingParams(temperature=0 if mixed and i % 2 else 0.8, top_p=0.95, seed=40 + i, max_tokens=16,
                             ignore_eos=True) for i in range(len(setup["prompts"]))]
    llm = LLM(str(setup["target"]), dtype="float64", device="cpu", max_model_len=400, max_num_batched_tokens=16,
              speculative_config=spec_config("draft_model", 3, setup["models"]))
    together = [o.outputs[0].token_ids for o in llm.generate(setup["prompts"], params, use_tqdm=False)]
    solo = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in zip(setup["prompts"], params, strict=True)]
    assert together == solo


@pytest.mark.parametrize("arch", ["hybrid", "qwen3"])
def test_draft_model_equal_to_target_accepts_everything(tiny_models: dict[str, Path], arch: str) -> None:
    model = str(tiny_models[arch])
    prompts = random_prompts(BATCH_LENGTHS, seed=12)
    base = LLM(model, dtype="float64", device="cpu", max_model_len=400)
    llm = LLM(model, dtype="float64", device="cpu", max_model_len=400, max_num_batched_tokens=16,
              speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY, use_tqdm=False)]
    m = llm.get_metrics()
    per_pos = [a / d for a, d in zip(m["num_accepted_tokens_per_pos"], m["num_draft_tokens_per_pos"], strict=True)]
    assert min(per_pos) >= 0.98, per_pos  # acceptance of the drafts that reached each position


def test_bad_speculative_configs_name_the_problem(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = str(tiny_models["qwen3"])
    cases = [({"method": "medusa", "num_speculative_tokens": 2}, "method"),
             ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
             ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens"),
             ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
             ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
              "prompt_lookup"),
             ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown keys"),
             ({"method": "mtp", "num_speculative_tokens": 2}, "mtp")]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(model, device="cpu", max_model_len=128, speculative_config=config)
    with pytest.raises(FileNotFoundError):
        LLM(model, device="cpu", max_model_len=128,
            speculative_config={"method": "eagle", "model": str(tmp_path / "none"), "num_speculative_tokens": 2})


def test_a_bad_drafter_is_refused_before_anything_is_allocated(tiny_models: dict[str, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing directory, vocabulary mismatch, no mtp.* weights, not an EAGLE head: each is refused from the files'
    configs and headers, before the target's weights load (and so before its KV pool is allocated)."""
    import json
    import shutil

    import truespec.engine.model_setup as model_setup

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target was loaded before the drafter was checked")

    monkeypatch.setattr(model_setup, "load_model", no_loading)
    other_vocab = tmp_path / "other_vocab"
    shutil.copytree(tiny_models["qwen3"], other_vocab)
    config = json.loads((other_vocab / "config.json").read_text())
    (other_vocab / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 1}))
    cases = [({"method": "draft_model", "model": str(tmp_path / "none")}, FileNotFoundError, "model directory"),
             ({"method": "draft_model", "model": str(other_vocab)}, ValueError, "vocab_size"),
             ({"method": "mtp"}, ValueError, "mtp.* weights"),
             ({"method": "eagle", "model": str(tiny_models["qwen3"])}, ValueError, "not an EAGLE head")]
    for config, error, message in cases:
        with pytest.raises(error, match=message):
            LLM(str(tiny_models["qwen3"]), device="cpu", max_model_len=128,
                speculative_config=config | {"num_speculative_tokens": 2})


class DraftRecorder:
    """Wraps a proposer and records, per request, the first draft proposed for each next position."""

    def __init__(self, inner: object) -> None:
        self.inner, self.first_drafts = inner, {}

    def __getattr__(self, name: str) -> object:  # the rest of the proposer interface: the wrapped one's
        return getattr(self.inner, name)

    def propose(self, requests: list, output: object, finished_req_ids: list[str]) -> dict:
        drafts = self.inner.propose(requests, output, finished_req_ids)
        for r in requests:
            if r.request_id in drafts and drafts[r.request_id].token_ids:
                self.first_drafts.setdefault(r.request_id, {})[r.num_tokens] = drafts[r.request_id].token_ids[0]
        return drafts


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_head_drafts_equal_a_one_shot_reference(setup: dict, method: str) -> None:
    """The first draft for position N, made incrementally across chunked prefill and verify steps, equals the
    head run once over the whole sequence on the target's hidden states (positions, KV and hidden rows line up)."""
    import torch

    from truespec.forward_context import set_forward_context
    from truespec.worker.input_builder import ContextRow, build_forward_context

    # "fixed": a draft after every step (the adaptive length would stop drafting for these random heads)
    llm = LLM(str(setup["target"]), dtype="float64", device="cpu", max_model_len=400, max_num_batched_tokens=8,
              speculative_config=spec_config(method, 3, setup["models"]) | {"draft_length": "fixed"})
    engine = llm.llm_engine
    recorder = DraftRecorder(engine.proposer)
    engine.proposer = recorder
    prompts = setup["prompts"][:5]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    head, runner = recorder.inner.head, engine.runner
    checked = 0
    for out in outs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        n = len(tokens)
        # fresh single-request caches: blocks 0.. of a scratch pool, one state group
        blocks = list(range(-(-n // engine.kv.block_size)))
        ctx = build_forward_context([ContextRow(blocks, 0, n, -1, 0, n - 1, 0)], engine.kv.block_size,
                                    engine.device)
        with torch.inference_mode(), set_forward_context(ctx):
            hidden = runner.model(torch.tensor(tokens), torch.arange(n))
        hctx = build_forward_context([ContextRow(blocks, 0, n - 1, -1, 0, n - 2, 0)], engine.kv.block_size,
                                     engine.device)
        with torch.inference_mode(), set_forward_context(hctx):
            ref = head.compute_logits(head(torch.tensor(tokens[1:]), torch.arange(n - 1), hidden[:-1])).argmax(-1)
        for position, draft in recorder.first_drafts.get(out.request_id, {}).items():
            if position < n:  # head at t = position - 2 predicts token `position`
                assert draft == int(ref[position - 2]), (out.request_id, position)
                checked += 1
    assert checked > 40
