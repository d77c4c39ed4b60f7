"""Prefix caching is exact: float64, hybrid (GDN + attention) and dense tiny models, every request's tokens equal
the run without the cache, for prompts that share 1 block - 1, exactly 2 blocks, 4 blocks + a few tokens, a prompt
that is a prefix of another, the same prompt again, and the next chat turn (a prompt plus its output plus more),
run one at a time and all together, with ngram / draft-model / MTP / EAGLE speculation, chunked prefill of odd
budgets, and preemption in a pool too small for all. The cached-token counts are what the design promises
(kv_cache/prefix_cache.py, kv_cache/state_checkpoints.py), and afterwards every block and state slot is free."""

from pathlib import Path

import pytest

from helpers.engine import random_prompts, spec_config
from truespec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
INTERVAL = 32  # hybrid: checkpoints every 2 blocks, and at each prompt's end


def ids(tokens: list[int]) -> dict:
    return {"prompt_token_ids": tokens}


def first_prompts() -> list[dict]:
    """Block size 16. ``base`` is 70 tokens (4 blocks + 6); ``other`` and ``third`` share nothing with it."""
    base, other, third = (p["prompt_token_ids"] for p in random_prompts([70, 40, 50], seed=5))
    return [ids(base),                      # 0: nothing cached
            ids(base[:15] + other[:20]),    # 1: shares 1 block - 1
            ids(base[:32] + other[:13]),    # 2: shares exactly 2 blocks
            ids(base + other[:5]),          # 3: shares 4 blocks + 6 tokens
            ids(base[:40]),                 # 4: a prefix of prompt 0
            ids(base),                      # 5: prompt 0 again
            ids(third),                     # 6: 50 tokens (its end, aligned down: 48)
            ids(base[:48])]                 # 7: exactly 3 blocks, all cached: the last one is computed again


def next_turns(prompts: list[dict], outputs: list[list[int]]) -> list[dict]:
    """Prompts 0 and 6 with their outputs and a new message: the next chat turn."""
    return [ids(prompts[i]["prompt_token_ids"] + outputs[i] + [7, 8, 9, 10, 11]) for i in (0, 6)]


# tokens the cache gives each request run one at a time (first_prompts, then next_turns), with the blocks of 16:
# the whole chain of full blocks before the last prompt token; on the hybrid model only up to a checkpoint (interval
# 32, prompt ends). Only prompt positions are cached (core/prefix_planner.py): turn 2 of prompt 0 (87 tokens)
# resumes at 64 on both (its 70-token first prompt's full blocks; its outputs are computed again); turn 2 of
# prompt 6: 48 on both (the first prompt's end).
EXPECTED = {"dense": [0, 0, 32, 64, 32, 64, 0, 32, 64, 48], "hybrid": [0, 0, 32, 64, 32, 64, 0, 32, 64, 48]}


def llm(model: Path, **kw: object) -> LLM:
    return LLM(str(model), dtype="float64", device="cpu", max_model_len=400, **kw)


@pytest.fixture(scope="module")
def setups(tiny_models: dict[str, Path], hybrid_with_heads: dict[str, Path]) -> dict[str, dict]:
    """Per model: the prompts (the next turns built from the reference output) and the reference tokens, computed
    without the cache, one request at a time."""
    out = {}
    for name, target, models in [("hybrid", hybrid_with_heads["target"],
                                  {"draft": tiny_models["qwen3"], "eagle": hybrid_with_heads["eagle"]}),
                                 ("dense", tiny_models["qwen3"],
                                  {"draft": tiny_models["llama"], "eagle": hybrid_with_heads["eagle_dense"]})]:
        base = llm(target, enable_prefix_caching=False)
        prompts = first_prompts()
        ref = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY, use_tqdm=False)]
        prompts += next_turns(prompts, ref)
        ref += [o.outputs[0].token_ids for o in base.generate(prompts[len(ref):], GREEDY, use_tqdm=False)]
        out[name] = {"target": target, "prompts": prompts, "ref": ref, "models": models}
    return out


def check_all_free(engine: LLM) -> None:
    info = engine.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]
    assert engine.reset_prefix_cache()
    info = engine.cache_info()
    assert info["num_cached_blocks"] == info["num_prefix_state_checkpoints"] == 0
    assert engine.llm_engine.kv.blocks.num_free == info["num_blocks"]


def one_at_a_time(engine: LLM, prompts: list[dict], params: SamplingParams = GREEDY) -> tuple[list, list]:
    outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_cached_prefixes_give_the_same_tokens_one_at_a_time(setups: dict, model: str) -> None:
    setup = setups[model]
    engine = llm(setup["target"], prefix_state_interval=INTERVAL)
    tokens, cached = one_at_a_time(engine, setup["prompts"])
    assert tokens == setup["ref"]
    assert cached == EXPECTED[model]
    metrics = engine.get_metrics()
    assert metrics["prefix_cache_queries"] == sum(len(p["prompt_token_ids"]) for p in setup["prompts"])
    assert metrics["prefix_cache_hits"] == sum(EXPECTED[model])
    check_all_free(engine)


SHAPES = {"together": {}, "odd chunks": {"max_num_batched_tokens": 13},
          "preempting": {"num_gpu_blocks_override": 30, "max_num_batched_tokens": 48}}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_cached_prefixes_give_the_same_tokens_in_batches(setups: dict, model: str, shape: str) -> None:
    """All prompts twice in one batch (a copy admitted after another computed its blocks hits them), then again with
    the cache warm."""
    setup = setups[model]
    engine = llm(setup["target"], prefix_state_interval=INTERVAL, **SHAPES[shape])
    for _ in range(2):
        outs = engine.generate(setup["prompts"] * 2, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == setup["ref"] * 2
    assert engine.get_metrics()["prefix_cache_hits"] > 0
    if shape == "preempting":
        assert engine.llm_engine.scheduler.num_preemptions > 0
    check_all_free(engine)


METHODS = [("ngram", "hybrid"), ("draft_model", "hybrid"), ("mtp", "hybrid"), ("eagle", "hybrid"),
           ("ngram", "dense"), ("draft_model", "dense"), ("eagle", "dense")]


@pytest.mark.parametrize(("method", "model"), METHODS)
def test_cached_prefixes_with_speculation_give_the_same_tokens(setups: dict, method: str, model: str) -> None:
    setup = setups[model]
    spec = spec_config(method, 3, setup["models"])
    engine = llm(setup["target"], prefix_state_interval=INTERVAL, speculative_config=spec)
    tokens, cached = one_at_a_time(engine, setup["prompts"])
    assert tokens == setup["ref"]
    if method in ("ngram", "draft_model"):  # keys as without a drafter
        assert cached[:8] == EXPECTED[model][:8]
    else:  # an MTP / EAGLE head's KV at a block's last position needs the token after it: prompt 2 shares 32 tokens
        # but not the 33rd, so only its first block (dense) or nothing (hybrid: no checkpoint at 16) is reused
        assert cached[:8] == [0, 0, 16 if model == "dense" else 0, 64, 32, 64, 0, 32]
    assert engine.get_metrics()["num_drafts"] > 0
    outs = engine.generate(setup["prompts"] * 2, GREEDY, use_tqdm=False)  # and all together, with a warm cache
    assert [o.outputs[0].token_ids for o in outs] == setup["ref"] * 2
    check_all_free(engine)


@pytest.mark.parametrize(("method", "model"), [("draft_model", "hybrid"), ("mtp", "hybrid"), ("draft_model", "dense"),
                                               ("eagle", "dense")])
def test_seeded_random_speculation_is_unchanged_by_cached_drafter_kv(setups: dict, method: str, model: str) -> None:
    """Random verification draws depend on the drafter's probabilities: a reused block whose drafter KV were not
    those of the same tokens would change them. One at a time (each prompt reuses the others' blocks), then all
    together with the cache warm."""
    setup = setups[model]
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(setup["prompts"]))]
    spec = spec_config(method, 3, setup["models"])
    outputs = []
    for enable in (False, True):
        engine = llm(setup["target"], prefix_state_interval=INTERVAL, speculative_config=spec,
                     enable_prefix_caching=enable, max_num_batched_tokens=16)
        tokens = [engine.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                  for p, sp in zip(setup["prompts"], params, strict=True)]
        tokens += [o.outputs[0].token_ids for o in engine.generate(setup["prompts"], params, use_tqdm=False)]
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


def test_a_restored_checkpoint_is_the_state_of_its_own_prefix_bitwise(setups: dict) -> None:
    """The state a hybrid request starts from after a hit of 64 tokens is bit for bit the state a fresh engine
    without the cache computes over those 64 tokens (with the same chunk ends, 32 and 64): not the state of a
    neighbouring position, nor another prompt's."""
    setup = setups["hybrid"]
    x = setup["prompts"][0]["prompt_token_ids"]  # 70 tokens
    engine = llm(setup["target"], prefix_state_interval=INTERVAL)
    engine.generate([ids(x)], GREEDY, use_tqdm=False)
    runner, seen = engine.llm_engine.runner, []
    run = runner.graphs.run

    def snapshot(rows: list, *args: object, **kw: object) -> object:
        seen.extend(states(runner.model, row.state_src) for row in rows if row.start == 64 and not seen)
        return run(rows, *args, **kw)

    runner.graphs.run = snapshot
    out = engine.generate([ids(x[:64] + [3, 4, 5, 6])], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and len(seen) == 1
    fresh = llm(setup["target"], enable_prefix_caching=False, max_num_batched_tokens=32, max_num_seqs=1)
    fresh.generate([ids(x[:64])], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    expected = states(fresh.llm_engine.runner.model, 0)  # its one state slot: the state after its last chunk
    assert any(t.abs().sum() > 0 for t in expected)
    assert all(a.equal(b) for a, b in zip(seen[0], expected, strict=True))


def states(model: object, slot: int) -> list:
    return [t[slot].clone() for layer in model.gdn_layers() for t in (layer.conv_state, layer.ssm_state)]


@pytest.mark.parametrize(("flag", "value", "field"), [("--prefix-state-interval", "24", "prefix_state_interval"),
                                                     ("--prefix-state-budget", "1.5", "prefix_state_budget")])
def test_bad_prefix_state_flags_fail_in_one_line_naming_the_field(tiny_models: dict[str, Path], flag: str, value: str,
                                                                  field: str, capsys: pytest.CaptureFixture) -> None:
    from truespec.entrypoints.cli import main as cli_main

    argv = ["generate", "--model", str(tiny_models["hybrid"]), "--dtype", "float32", "--device", "cpu",
            "--max-model-len", "128", "--max-tokens", "2", flag, value, "hi"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field} ") and err.count("\n") == 1


def test_prefix_caching_flags_reach_the_engine(tiny_models: dict[str, Path]) -> None:
    import argparse

    from truespec.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "enable_prefix_caching" not in engine_kwargs(parser.parse_args([]))  # the engine's default: on
    kwargs = engine_kwargs(parser.parse_args(["--no-enable-prefix-caching", "--prefix-state-interval", "32"]))
    assert kwargs["enable_prefix_caching"] is False and kwargs["prefix_state_interval"] == 32
    engine = llm(tiny_models["qwen3"], enable_prefix_caching=False)
    assert engine.llm_engine.kv.cache is None and engine.reset_prefix_cache()  # nothing cached
    outs = engine.generate([ids(list(range(1, 40)))] * 2, GREEDY, use_tqdm=False)
    assert engine.get_metrics()["prefix_cache_queries"] == 0 and outs[1].num_cached_tokens == 0


@pytest.mark.parametrize("method", [None, "mtp", "eagle"])
def test_cached_prefixes_with_async_scheduling_give_the_same_tokens(setups: dict, method: str | None) -> None:
    """Steps queued ahead (decodes; with MTP verifies drafted on the device, whose progress the host learns a step
    late and which save no checkpoint): the tokens without the cache, one at a time and all together."""
    setup = setups["hybrid"]
    spec = spec_config(method, 3, setup["models"]) if method is not None else None
    engine = llm(setup["target"], prefix_state_interval=INTERVAL, speculative_config=spec, async_scheduling=True)
    tokens, cached = one_at_a_time(engine, setup["prompts"])
    assert tokens == setup["ref"] and cached[:5] == ([0, 0, 32, 64, 32] if method is None else [0, 0, 0, 64, 32])
    outs = engine.generate(setup["prompts"] * 2, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == setup["ref"] * 2
    assert engine.llm_engine.overlap.num_async_steps > 0
    check_all_free(engine)


def test_a_draft_model_with_recurrent_state_turns_prefix_caching_off(setups: dict, tiny_models: dict[str, Path],
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Its GDN state is not checkpointed, so reused blocks would leave it wrong: the engine says so and caches
    nothing (and reserves no checkpoint memory)."""
    setup = setups["hybrid"]
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(tiny_models["hybrid"])}
    with caplog.at_level("WARNING", logger="truespec"):
        engine = llm(setup["target"], speculative_config=spec)
    assert "prefix caching is off" in caplog.text
    assert engine.llm_engine.kv.cache is None and engine.cache_info()["num_prefix_state_slots"] == 0
    tokens, cached = one_at_a_time(engine, setup["prompts"][:3])
    assert tokens == setup["ref"][:3] and cached == [0, 0, 0]
