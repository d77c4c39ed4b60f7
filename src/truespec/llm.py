"""The offline API, shaped like vLLM's ``LLM``."""

import threading
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from truespec.config import EngineConfig
from truespec.engine.llm_engine import LLMEngine, PromptType
from truespec.outputs import RequestOutput
from truespec.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.llm_engine = LLMEngine(_engine_config(model, kwargs))
        self._lock = threading.Lock()  # one generate() at a time: the engine steps one batch

    @staticmethod
    def check_args(model: str | None = None, **kwargs: object) -> None:
        """Raise the configuration error ``LLM(model, **kwargs)`` would, without loading or allocating anything."""
        LLMEngine.check_config(_engine_config(model, kwargs))

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.llm_engine.tokenizer

    def cache_info(self) -> dict[str, int]:
        return self.llm_engine.cache_info()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and state checkpoint (vLLM's ``LLM.reset_prefix_cache``); False, and nothing
        forgotten, while a request holds a cached block."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> dict[str, object]:
        """Speculative-decoding counters since the engine was built: num_drafts, num_draft_tokens,
        num_accepted_tokens, num_accepted_tokens_per_pos, num_draft_tokens_per_pos, mean_acceptance_length
        (= 1 + accepted / drafts), num_steps, num_steps_without_drafts, num_draft_skips, and the governor's
        num_steps_drafting_off and governor_drafting (README, "Speculative decoding"); and the prefix cache's
        prefix_cache_queries and prefix_cache_hits (prompt tokens looked up and found, once per request, as vLLM's)."""
        return self.llm_engine.get_metrics()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order, one per prompt (with ``SamplingParams.n`` > 1 it holds
        n completions, ``index`` 0..n-1). Calls from several threads run one after another (each gets the tokens it
        would get alone)."""
        prompts = _prompt_list(prompts)
        params = [replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)  # one output per request, at its end
                  for sp in _per_prompt(sampling_params, len(prompts))]
        with self._lock:
            return self._generate(prompts, params, use_tqdm)

    def _generate(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        requests = [engine.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]  # validate all first
        outputs: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                engine.add(request)
            with _progress_bar(len(requests), use_tqdm and len(requests) >= 2) as bar:
                while any(not request.is_finished for request in requests):
                    done = engine.step()
                    outputs.update((out.request_id, out) for out in done)
                    bar.update(len(done))
        except BaseException:
            for request in requests:  # a failed or interrupted call leaves nothing behind: blocks and slots come back
                engine.abort_request(request.request_id)
            raise
        # a request aborted from elsewhere finished without a step: its output is built here
        return [outputs.get(request.request_id) or engine.final_output(request) for request in requests]


class _NoBar:
    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    """tqdm's bar for a batch, imported only when one is shown (it costs ~0.1 s of ``import truespec``)."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate")


def _engine_config(model: str | None, kwargs: dict[str, object]) -> EngineConfig:
    return EngineConfig(model=model if model is not None else _default_model_dir(), **kwargs)


def _prompt_list(prompts: object) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, Seq) or isinstance(prompts, bytes | bytearray):
        raise ValueError("prompts must be a string, a {'prompt': ...} / {'prompt_token_ids': [...]} dict, or a list "
                         f"of them, got {type(prompts).__name__}")
    return list(prompts)


def _per_prompt(sampling_params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if not isinstance(sampling_params, Seq) or isinstance(sampling_params, str | bytes):
        raise ValueError("sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                         f"{type(sampling_params).__name__}")
    params = list(sampling_params)
    bad = [type(p).__name__ for p in params if not isinstance(p, SamplingParams)]
    if bad:
        raise ValueError(f"sampling_params must hold SamplingParams, got {bad[0]}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
    return params


def _default_model_dir() -> str:
    try:
        from truespec.assets import DEFAULT_MODEL_DIR
    except ImportError as e:
        raise ValueError("LLM() needs a model directory: the embedded default model is not installed "
                         "in this copy of truespec; pass model='path/to/hf_dir'") from e
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; "
                         "pass model='path/to/hf_dir'")
    return str(DEFAULT_MODEL_DIR)
