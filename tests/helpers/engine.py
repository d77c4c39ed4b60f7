"""Helpers for engine-level tests: seeded random prompts, greedy generation through ``LLM``, an n-gram
speculative ``LLM``, speculative configs for the tiny drafters, and a proposer that drafts a known reference
continuation."""

import random
from pathlib import Path

import torch

from truespec import LLM, SamplingParams
from truespec.spec_decode.interface import DraftRequest, Drafts
from truespec.worker.runner_output import ModelRunnerOutput


def fla_runs() -> bool:
    """Whether fla's GDN chunk kernel runs here (CUDA and fla-core: a GdnPrefillRule is in force for bf16 / fp16)."""
    if not torch.cuda.is_available():
        return False
    from truespec.kernels import gdn_chunked  # triton: only where CUDA is

    return gdn_chunked.is_available()


# Prompt lengths from a single token to several prefill chunks (the engine tests' max_model_len is 400).
BATCH_LENGTHS = [1, 2, 5, 17, 40, 64, 129, 200, 300]


def spec_config(method: str, k: int, models: dict[str, Path], **kw: object) -> dict:
    """A speculative config for the tiny test drafters: ``models`` names the "draft" model and "eagle" head dirs."""
    config = {"method": method, "num_speculative_tokens": k, **kw}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "draft_model":
        config["model"] = str(models["draft"])
    elif method == "eagle":
        config["model"] = str(models["eagle"])
    return config


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 300) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in lengths]


def generate(llm: LLM, prompts: list[dict], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def spec_llm(model_dir: Path, k: int, **kw: object) -> LLM:
    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return LLM(str(model_dir), dtype="float64", device="cpu", max_model_len=400, speculative_config=config, **kw)


class OracleProposer:
    """Drafts the reference continuation, cut to a length that changes every step (0..k, so a request
    alternates drafts / no drafts) and with one token corrupted at a changing position: every prefix
    length gets accepted at some step, which exercises the state hand-off after each of them."""

    catches_up = False  # keeps nothing per request (spec_decode/interface.py)

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int, vocab: int) -> None:
        self.reference, self.k, self.vocab, self.calls = reference, k, vocab, 0
        self.rng = random.Random(k)

    def forget(self, request_ids: list[str]) -> None:
        pass

    def continuation(self, r: DraftRequest) -> list[int]:
        """The reference tokens after ``r``'s known ones."""
        return self.reference[tuple(r.prompt_token_ids)][len(r.output_token_ids):]

    def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                finished_req_ids: list[str]) -> dict[str, Drafts]:
        drafts = {}
        for r in requests:
            if not r.is_drafting:
                continue
            self.calls += 1
            ids = self.continuation(r)[: self.rng.choice([0, self.k, self.rng.randrange(self.k + 1)])]
            bad = self.rng.randrange(2 * self.k + 1)  # >= len(drafts) about half of the time: all accepted
            if bad < len(ids):
                ids[bad] = (ids[bad] + 1) % self.vocab
            drafts[r.request_id] = Drafts(ids)
        return drafts


def set_eos_token_ids(engine: object, ids: set[int]) -> None:
    """Give an engine another EOS set: its stop checks and its runner's min_tokens bans share this one set."""
    engine.stop_checker.eos_token_ids.clear()
    engine.stop_checker.eos_token_ids.update(ids)
