"""The engine on the CPU with and without the compiled kernels (cpu_kernels/): the embedded model's float64 greedy
tokens are the same on both paths, with and without speculation, so a machine without a C compiler (the torch ops)
generates what CI's machine does (the kernels)."""

import pytest

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.cpu_kernels import build

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: only the torch path exists here")
PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "for i in range(10):\n    ", "import os\n"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}


def tokens(spec: dict | None) -> list[list[int]]:
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=512, speculative_config=spec)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_float64_tokens_do_not_depend_on_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    with_kernels = [tokens(None), tokens(NGRAM)]
    monkeypatch.setenv("TRUESPEC_NATIVE", "0")
    build.load.cache_clear()
    try:
        assert build.load() is None
        with_torch = [tokens(None), tokens(NGRAM)]
    finally:
        monkeypatch.delenv("TRUESPEC_NATIVE")
        build.load.cache_clear()
    assert with_kernels[0] == with_kernels[1] == with_torch[0] == with_torch[1]
