"""SamplingParams reject bad values with a ValueError naming the field (invariant 6)."""

import pytest

from truespec import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("seed", 1.5), ("stop", [""]),
    ("stop_token_ids", [-1]), ("n", 2), ("temperature", "hot"), ("seed", 2**64), ("seed", True), ("logprobs", 21),
    ("logprobs", -1),
])
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_stop_string_normalised_to_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
