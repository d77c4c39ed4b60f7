"""SamplingParams reject bad values with a ValueError naming the field (invariant 6), accept numpy scalars as
vLLM does, and every value they accept samples a valid token (no NaN from float32 overflow)."""

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from truespec import LLM, SamplingParams
from truespec.layers.rejection_sampler import rejection_sample_draws
from truespec.layers.sampler import probabilities
from truespec.sampling_params import MIN_TEMPERATURE


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("seed", 1.5), ("stop", [""]),
    ("stop_token_ids", [-1]), ("temperature", "hot"), ("seed", 2**64), ("seed", True), ("logprobs", 21),
    ("logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", True),
])
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_n_must_be_an_int_of_at_least_one(value: object) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be an int >= 1"):
        SamplingParams(n=value)


def test_n_above_one_is_accepted() -> None:
    assert SamplingParams(n=3).n == 3 and SamplingParams(n=np.int64(2)).n == 2


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_stop_string_normalised_to_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]


@pytest.mark.parametrize("field, value", [
    ("stop", 5), ("stop", [5]), ("stop_token_ids", 5), ("stop_token_ids", "7"), ("ignore_eos", "no"),
    ("include_stop_str_in_output", "no"), ("skip_special_tokens", "no"), ("ignore_eos", 1),
    ("temperature", float("inf")), ("temperature", 1e39),  # 1e39 is inf in float32
])
def test_wrong_types_and_non_finite_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_numpy_scalars_become_python_numbers() -> None:
    p = SamplingParams(temperature=np.float32(0.0), top_p=np.float64(0.5), top_k=np.int64(5),
                       max_tokens=np.int64(5), min_tokens=np.int32(2), seed=np.uint64(7), logprobs=np.int64(1),
                       prompt_logprobs=np.int64(2), stop_token_ids=[np.int64(3)], ignore_eos=np.bool_(True))
    assert p.is_greedy and p.max_tokens == 5 and p.stop_token_ids == [3] and p.ignore_eos is True
    for name in ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs",
                 "ignore_eos"):
        assert type(getattr(p, name)) in (int, float, bool), name
    assert type(p.stop_token_ids[0]) is int
    assert SamplingParams(temperature=np.float32(0.5)).temperature == 0.5


def test_tiny_temperature_is_raised_to_vllms_minimum_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="truespec"):
        assert SamplingParams(temperature=1e-38).temperature == MIN_TEMPERATURE == 1e-2
    assert "temperature" in caplog.text
    assert SamplingParams(temperature=0).temperature == 0  # 0 stays greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


# Values that overflow or underflow in float32; token 0 is banned (stop_token_ids before min_tokens)
EXTREME = [dict(temperature=1e-38), dict(temperature=1e-45), dict(top_p=1e-46), dict(top_p=1e-46, top_k=3),
           dict(temperature=3e38), dict(temperature=1e-38, top_p=1e-46, min_p=1.0)]


@pytest.mark.parametrize("kw", EXTREME)
def test_extreme_values_give_finite_probabilities_without_banned_tokens(kw: dict) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=g) * 30  # [rows, vocab] float32, large margins
    logits[:, 0] = float("-inf")  # a min_tokens ban
    params = SamplingParams(**kw)
    draws = rejection_sample_draws(logits, [5, 9, 11], None, params, torch.Generator().manual_seed(1))
    for row in logits:
        p = probabilities(row, params)
        assert torch.isfinite(p).all() and p[0] == 0 and p.sum() == pytest.approx(1.0)
    assert (draws[3:] != 0).all()


@pytest.fixture(scope="module")
def float32_llm(tiny_models: dict[str, Path]) -> LLM:
    """float32 logits: where 1e-46 is 0 and 1e39 is inf."""
    return LLM(str(tiny_models["hybrid"]), dtype="float32", device="cpu", max_model_len=64, num_gpu_blocks_override=8)


@pytest.mark.parametrize("kw", EXTREME)
def test_extreme_values_sample_valid_tokens_in_the_engine(float32_llm: LLM, kw: dict) -> None:
    params = SamplingParams(**kw, seed=3, max_tokens=6, min_tokens=6, stop_token_ids=[0], ignore_eos=True)
    out = float32_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and all(0 < t < float32_llm.llm_engine.vocab_size for t in out.token_ids)
