"""EngineConfig / CacheConfig / SpeculativeConfig: a bad value raises a ValueError naming its field before
anything loads, a ``pathlib.Path`` works wherever a directory is taken, and a speculative key that the chosen
method would ignore is an error, never dropped."""

from pathlib import Path

import pytest

from truespec import LLM, SamplingParams
from truespec.config import EngineConfig, SpeculativeConfig
from truespec.kv_cache.config import CacheConfig

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7]}


def test_empty_model_is_an_error_not_the_embedded_model() -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(model="", device="cpu")


@pytest.mark.parametrize("kw, field", [
    (dict(tokenizer=""), "tokenizer"), (dict(tokenizer=5), "tokenizer"), (dict(model=5), "model"),
])
def test_bad_paths_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{"model": "some/dir", **kw})


def test_paths_become_strings() -> None:
    config = EngineConfig(model=Path("a/b"), tokenizer=Path("c"),
                          speculative_config={"method": "eagle", "model": Path("d"), "num_speculative_tokens": 2})
    assert (config.model, config.tokenizer, config.speculative_config.model) == ("a/b", "c", "d")
    assert all(type(x) is str for x in (config.model, config.tokenizer, config.speculative_config.model))


def test_path_model_tokenizer_and_drafter_load(tiny_models: dict[str, Path]) -> None:
    target = tiny_models["qwen3"]
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 2}
    by_path = LLM(target, tokenizer=target, dtype="float64", device="cpu", max_model_len=64,
                  num_gpu_blocks_override=8, speculative_config=spec)
    by_str = LLM(str(target), dtype="float64", device="cpu", max_model_len=64, num_gpu_blocks_override=8)
    assert (by_path.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            == by_str.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("field, value", [
    ("cpu_kv_cache_space_gib", float("inf")), ("cpu_kv_cache_space_gib", float("nan")),
    ("gpu_memory_utilization", float("nan")), ("gpu_memory_utilization", float("inf")),
])
def test_non_finite_cache_sizes_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_llm_with_infinite_cpu_kv_space_names_the_field(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="cpu_kv_cache_space_gib"):
        LLM(str(tiny_models["qwen3"]), device="cpu", cpu_kv_cache_space_gib=float("inf"))


@pytest.mark.parametrize("method, key, value", [
    ("mtp", "model", "some/dir"), ("ngram", "model", "some/dir"), ("ngram", "enforce_eager", True),
    ("mtp", "prompt_lookup_min", 2), ("mtp", "prompt_lookup_max", 4), ("eagle", "prompt_lookup_min", 2),
    ("draft_model", "prompt_lookup_max", 4), ("mtp", "draft_on_device", True),
])
def test_speculative_key_the_method_ignores_is_rejected(method: str, key: str, value: object) -> None:
    config = {"method": method, "num_speculative_tokens": 2, key: value}
    if method in ("eagle", "draft_model"):
        config.setdefault("model", "some/dir")
    with pytest.raises(ValueError, match=rf"speculative_config\.{key} is not used by method '{method}'"):
        SpeculativeConfig.from_dict(config)


@pytest.mark.parametrize("config", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
    {"method": "ngram", "num_speculative_tokens": 4, "draft_on_device": True},
    {"method": "mtp", "num_speculative_tokens": 2, "enforce_eager": True},
    {"method": "eagle", "num_speculative_tokens": 2, "model": "d", "enforce_eager": False},
    {"method": "draft_model", "num_speculative_tokens": 2, "model": "d"},
    {"method": "draft_model", "num_speculative_tokens": 2, "model": "d", "draft_on_device": True},
])
def test_speculative_keys_each_method_takes_are_accepted(config: dict) -> None:
    assert SpeculativeConfig.from_dict(config).method == config["method"]


@pytest.mark.parametrize("value", ["yes", 1])
def test_draft_on_device_must_be_a_bool(value: object) -> None:
    with pytest.raises(ValueError, match="speculative_config.draft_on_device"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "draft_on_device": value})


def test_empty_drafter_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2, "model": ""})


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_batch_invariant_must_be_a_bool(value: object) -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(model="some/dir", batch_invariant=value)


def test_cli_batch_invariant_flag_reaches_the_engine_kwargs() -> None:
    import argparse

    from truespec.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["batch_invariant"] is True
    assert engine_kwargs(parser.parse_args(["--no-batch-invariant"]))["batch_invariant"] is False


def test_batch_invariant_false_reaches_every_projection_of_target_and_drafter() -> None:
    from truespec.layers.linear import Linear

    llm = LLM(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2, batch_invariant=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    engine = llm.llm_engine
    target = engine.loaded.model
    modules = list(target.modules()) + list(engine.proposer.head.modules())
    linears = [m for m in modules if isinstance(m, Linear)]
    assert linears and not any(m.batch_invariant for m in linears) and not target.batch_invariant


@pytest.mark.parametrize("value, field", [
    ({"backend": "guidance"}, "structured_outputs_config.backend"),
    ({"disable_any_whitespace": "yes"}, "structured_outputs_config.disable_any_whitespace"),
    ({"whitespace_pattern": " "}, "structured_outputs_config has unknown keys"), ("{}", "structured_outputs_config"),
])
def test_bad_structured_outputs_config_names_the_field(value: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="some/dir", structured_outputs_config=value)
    assert EngineConfig(model="d", structured_outputs_config={"disable_any_whitespace": True}) \
        .structured_outputs_config.disable_any_whitespace
