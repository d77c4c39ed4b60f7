"""Engine configuration: frozen dataclasses, validated at construction with errors naming the field."""

import math
import os
from dataclasses import dataclass

from truespec.dtypes import DTYPES

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False  # vLLM: no tokenizer; prompts are token ids, outputs carry no text
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # prompt tokens one request computes per step (vLLM's setting): > 0 always, 0 never, None: 2048 while another
    # request is decoding (core/scheduler.py), so a long prompt does not stall running requests
    long_prefill_token_threshold: int | None = None
    # the cache's fields, validated by kv_cache.CacheConfig (the engine builds one from them first)
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space_gib: float = 4.0
    # torch threads on the CPU; None: env TRUESPEC_CPU_THREADS, else 1 for small models (worker/cpu_threads.py)
    cpu_threads: int | None = None
    # sparse-V tile skip in the attention kernels ("off" | "on" | "auto": on for rows with at least
    # sparse_v_ctx_threshold keys); None: env TRUESPEC_SPARSE_V / _THRESHOLD / _CTX_THRESHOLD, else off, 1e-3, 8192
    sparse_v: str | None = None
    sparse_v_threshold: float | None = None
    sparse_v_ctx_threshold: int | None = None
    # prefix caching (kv_cache/prefix_cache.py, kv_cache/state_checkpoints.py): full KV blocks shared between
    # requests and kept after them; on hybrid models with recurrent-state checkpoints every prefix_state_interval
    # tokens (a block multiple; None: the fewest blocks whose KV costs as much as one checkpoint, rounded up to a
    # power of two) and at each prompt's end, in a pool that takes prefix_state_budget of the cache memory.
    # On by default on every device (README, "Prefix caching", says why)
    enable_prefix_caching: bool = True
    prefix_state_interval: int | None = None
    prefix_state_budget: float = 0.1
    seed: int = 0
    speculative_config: "SpeculativeConfig | dict | None" = None
    enforce_eager: bool = False  # vLLM: never use CUDA graphs (same as cudagraph_mode NONE)
    compilation_config: "CompilationConfig | dict | None" = None
    # vLLM's async scheduling: prepare step N+1 on the host while step N runs on the device (greedy decode steps,
    # and greedy MTP / EAGLE verifies drafted on the device: engine/async_scheduler.py). None: on for CUDA
    # devices, off on CPU.
    async_scheduling: bool | None = None
    # every projection (and the logits) through the row-invariant kernel on CUDA: a row's bits do not depend on
    # the rest of its step, so speculation and batching never change a token (layers/linear.py). False: the
    # one-row skinny kernel / cuBLAS path, faster for long prefill chunks but not batch invariant in 16-bit.
    batch_invariant: bool = True
    # vLLM's structured_outputs_config: how requests' structured outputs are matched (structured_output/)
    structured_outputs_config: "StructuredOutputsConfig | dict | None" = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        object.__setattr__(self, "compilation_config", CompilationConfig.from_dict(self.compilation_config))
        object.__setattr__(self, "structured_outputs_config",
                           StructuredOutputsConfig.from_dict(self.structured_outputs_config))
        fspath(self, "model", "tokenizer")
        check(isinstance(self.skip_tokenizer_init, bool), "skip_tokenizer_init",
              f"must be a bool, got {self.skip_tokenizer_init!r}")
        check(isinstance(self.enforce_eager, bool), "enforce_eager", f"must be a bool, got {self.enforce_eager!r}")
        check(self.cpu_threads is None or (isinstance(self.cpu_threads, int) and not isinstance(self.cpu_threads, bool)
                                           and self.cpu_threads >= 1), "cpu_threads",
              f"must be a positive int or None, got {self.cpu_threads!r}")
        check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
              f"must be a bool, got {self.enable_prefix_caching!r}")
        check(isinstance(self.batch_invariant, bool), "batch_invariant",
              f"must be a bool, got {self.batch_invariant!r}")
        check(self.async_scheduling is None or isinstance(self.async_scheduling, bool), "async_scheduling",
              f"must be a bool or None, got {self.async_scheduling!r}")
        check(is_path(self.model), "model", f"must be a directory path, got {self.model!r}")
        check(self.tokenizer is None or is_path(self.tokenizer), "tokenizer",
              f"must be None or a directory path, got {self.tokenizer!r}")
        check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        check(self.device in DEVICES or str(self.device).startswith("cuda:"), "device",
              f"must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        _positive(self, "max_num_seqs", "max_num_batched_tokens")
        threshold = self.long_prefill_token_threshold
        check(threshold is None or (isinstance(threshold, int) and not isinstance(threshold, bool) and threshold >= 0),
              "long_prefill_token_threshold", f"must be None or an int >= 0, got {threshold!r}")
        check(self.max_model_len is None or is_pos_int(self.max_model_len), "max_model_len",
              f"must be a positive int, got {self.max_model_len!r}")
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed",
              f"must be an int, got {self.seed!r}")

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def cudagraph_mode(self) -> str:
        return "NONE" if self.enforce_eager else self.compilation_config.cudagraph_mode


def is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def is_finite(x: object) -> bool:
    return is_number(x) and math.isfinite(x)


def is_path(x: object) -> bool:
    return isinstance(x, str) and x != ""  # "" would name the working directory


def fspath(cfg: object, *names: str) -> None:
    """A ``pathlib.Path`` field as the str every loader takes."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, os.PathLike):
            object.__setattr__(cfg, name, os.fspath(value))


def is_pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        check(is_pos_int(value), name, f"must be a positive int, got {value!r}")


def check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


SPEC_METHODS = ("ngram", "draft_model", "mtp", "eagle")
# The optional keys each method reads; one that its method would ignore is an error, never silently dropped
# (mtp reads its layer from the target's checkpoint, ngram has no network to run eagerly).
METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max", "draft_on_device"),
               "draft_model": ("model", "enforce_eager", "draft_on_device"),
               "eagle": ("model", "enforce_eager"), "mtp": ("enforce_eager",)}
MAX_SPECULATIVE_TOKENS = 64
DRAFT_LENGTHS = ("adaptive", "fixed")
# "adaptive" drafts position i only while the chance that positions 1..i are all accepted is at least this: the
# cost of drafting one more position, in target steps (spec_decode/draft_length.py). ngram drafts are free to make,
# so a position costs only its query row in the verify (a few % of a memory-bound decode step). A model drafter
# adds a forward for each position after the first and an lm_head for every one, ~10-35% of a target step (an
# EAGLE layer on a large target at the low end, MTP on Qwen3.5-0.8B with its 248k-token lm_head at the high end).
DEFAULT_MIN_DRAFT_ACCEPTANCE = {"ngram": 0.1, "draft_model": 0.2, "mtp": 0.2, "eagle": 0.2}
# "auto": per batch size, a step drafts only while drafting's measured throughput beats not drafting's
# (spec_decode/governor.py); "off": steps always draft (as the draft length allows)
GOVERNOR_MODES = ("auto", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model / eagle: the drafter's directory
    prompt_lookup_min: int | None = None  # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: int | None = None  # ngram: longest
    enforce_eager: bool | None = None  # True: the drafter runs without CUDA graphs (None: the target's mode)
    # ngram and draft_model (truespec's key): True, drafts made on the device behind each greedy step, so that
    # verifies queue ahead with async scheduling (spec_decode/ngram_on_device.py, ModelDrafter.draft_on_device);
    # False: on the host after each step's read. None: ngram on the host (faster on the embedded model,
    # BENCHMARKS.md session 17), a draft model without recurrent state on the device (1.3-2.1x faster, session 19).
    # MTP and EAGLE always draft on the device.
    draft_on_device: bool | None = None
    # vLLM's key: no drafts in a step after which this many requests or more are running (None: always draft)
    disable_by_batch_size: int | None = None
    # drafts per request and step: "adaptive" (as many as pay for themselves, per request, 0 to k) or "fixed"
    # (always up to num_speculative_tokens)
    draft_length: str = "adaptive"
    # adaptive: least chance that a drafted position is accepted with all before it (None: the method's default)
    min_draft_acceptance: float | None = None
    # the speculation governor, one of GOVERNOR_MODES; None: "off" (opt-in until measured on a GPU: BENCHMARKS.md)
    governor: str | None = None

    def __post_init__(self) -> None:
        check(self.method in SPEC_METHODS, "speculative_config.method",
              f"must be one of {SPEC_METHODS}, got {self.method!r}")
        fspath(self, "model")
        for key in ("model", "prompt_lookup_min", "prompt_lookup_max", "enforce_eager", "draft_on_device"):
            value, takes = getattr(self, key), ", ".join(METHOD_KEYS[self.method])
            check(value is None or key in METHOD_KEYS[self.method], f"speculative_config.{key}",
                  f"is not used by method {self.method!r} (it takes num_speculative_tokens, {takes}); leave it "
                  f"out, got {value!r}")
        k = self.num_speculative_tokens
        check(is_pos_int(k) and k <= MAX_SPECULATIVE_TOKENS, "speculative_config.num_speculative_tokens",
              f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        check(self.enforce_eager is None or isinstance(self.enforce_eager, bool), "speculative_config.enforce_eager",
              f"must be a bool, got {self.enforce_eager!r}")
        check(self.draft_on_device is None or isinstance(self.draft_on_device, bool),
              "speculative_config.draft_on_device", f"must be a bool, got {self.draft_on_device!r}")
        check(self.disable_by_batch_size is None or is_pos_int(self.disable_by_batch_size),
              "speculative_config.disable_by_batch_size", f"must be a positive int, got {self.disable_by_batch_size!r}")
        self._check_draft_length()
        check(self.governor is None or self.governor in GOVERNOR_MODES, "speculative_config.governor",
              f"must be one of {GOVERNOR_MODES} or None, got {self.governor!r}")
        needs_model = self.method in ("draft_model", "eagle")
        check(not needs_model or is_path(self.model), "speculative_config.model",
              f"is required for method {self.method!r} (the drafter's directory), got {self.model!r}")
        if self.method == "ngram":  # vLLM: both default to 5; one given sets the other
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            object.__setattr__(self, "prompt_lookup_min", lo if lo is not None else (hi or 5))
            object.__setattr__(self, "prompt_lookup_max", hi if hi is not None else (lo or 5))
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            check(is_pos_int(lo) and is_pos_int(hi) and lo <= hi, "speculative_config.prompt_lookup_min",
                   f"and prompt_lookup_max must satisfy 1 <= min <= max, got {lo!r}, {hi!r}")

    def _check_draft_length(self) -> None:
        check(self.draft_length in DRAFT_LENGTHS, "speculative_config.draft_length",
              f"must be one of {DRAFT_LENGTHS}, got {self.draft_length!r}")
        value = self.min_draft_acceptance
        if self.draft_length == "fixed":
            check(value is None, "speculative_config.min_draft_acceptance",
                  f"is not used with draft_length 'fixed'; leave it out, got {value!r}")
            return
        check(value is None or is_finite(value) and 0 < value < 1, "speculative_config.min_draft_acceptance",
              f"must be a number in (0, 1), got {value!r}")
        if value is None:
            object.__setattr__(self, "min_draft_acceptance", DEFAULT_MIN_DRAFT_ACCEPTANCE[self.method])

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
                 "enforce_eager", "disable_by_batch_size", "draft_length", "min_draft_acceptance", "governor",
                 "draft_on_device"}
        unknown = sorted(set(d) - known)
        check(not unknown, "speculative_config", f"has unknown keys {unknown}; known: {sorted(known)}")
        check("method" in d and "num_speculative_tokens" in d, "speculative_config",
              "needs 'method' and 'num_speculative_tokens'")
        return cls(**d)


CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")
DEFAULT_MAX_CAPTURE_SIZE = 512


@dataclass(frozen=True)
class CompilationConfig:
    """vLLM's ``compilation_config`` keys that apply here (truespec does not use torch.compile).

    cudagraph_mode: NONE (eager), FULL_DECODE_ONLY (graphs for steps without prefill chunks: decodes and
    verifies), FULL (every step up to the largest capture size, prefill chunks included). Graphs are keyed by
    the step's token count, padded up to the next capture size with inert rows.
    """

    cudagraph_mode: str = "FULL"
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, then every 8 up to the max
    max_cudagraph_capture_size: int | None = None  # None: 512 (or the largest given capture size)

    def __post_init__(self) -> None:
        mode = self.cudagraph_mode
        hint = " (PIECEWISE modes need torch.compile's graph splitting, which truespec does not use)" \
            if isinstance(mode, str) and "PIECEWISE" in mode else ""
        check(mode in CUDAGRAPH_MODES, "compilation_config.cudagraph_mode",
              f"must be one of {CUDAGRAPH_MODES}, got {mode!r}{hint}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            check(isinstance(sizes, list | tuple) and len(sizes) > 0 and all(is_pos_int(x) for x in sizes),
                   "compilation_config.cudagraph_capture_sizes", f"must be a non-empty list of positive ints, "
                   f"got {sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        top = self.max_cudagraph_capture_size
        check(top is None or is_pos_int(top), "compilation_config.max_cudagraph_capture_size",
              f"must be a positive int, got {top!r}")

    def capture_sizes(self, max_num_tokens: int) -> list[int]:
        """The ladder of token counts to capture, none above ``max_num_tokens`` (the most a step can hold)."""
        top = self.max_cudagraph_capture_size
        if self.cudagraph_capture_sizes is not None:
            sizes = list(self.cudagraph_capture_sizes)
            top = top or sizes[-1]
        else:
            top = top or DEFAULT_MAX_CAPTURE_SIZE
            sizes = [1, 2, 4] + list(range(8, top + 1, 8))
        return [s for s in sizes if s <= min(top, max_num_tokens)]

    @classmethod
    def from_dict(cls, d: "dict | CompilationConfig | None") -> "CompilationConfig":
        if d is None:
            return cls()
        if isinstance(d, CompilationConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"compilation_config must be a dict, got {type(d).__name__}")
        known = {"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"}
        unknown = sorted(set(d) - known)
        check(not unknown, "compilation_config", f"has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's ``structured_outputs_config`` keys that apply here. backend: "auto" or "xgrammar" (the one truespec
    has). disable_any_whitespace: JSON constraints allow no free whitespace between tokens (one space after ``:``
    and ``,``), for every request; a small model can otherwise spend its tokens on whitespace."""

    backend: str = "auto"
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        check(self.backend in ("auto", "xgrammar"), "structured_outputs_config.backend",
              f'must be "auto" or "xgrammar", got {self.backend!r}')
        check(isinstance(self.disable_any_whitespace, bool), "structured_outputs_config.disable_any_whitespace",
              f"must be a bool, got {self.disable_any_whitespace!r}")

    @classmethod
    def from_dict(cls, d: "dict | StructuredOutputsConfig | None") -> "StructuredOutputsConfig":
        if d is None or isinstance(d, StructuredOutputsConfig):
            return d or cls()
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs_config must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - {"backend", "disable_any_whitespace"})
        check(not unknown, "structured_outputs_config", f"has unknown keys {unknown}; known: "
              "['backend', 'disable_any_whitespace']")
        return cls(**d)
