"""Compressed KV caches in the engine (kv_cache/formats.py, layout.py; the torch reference store and read): every
``kv_cache_dtype`` gives, in its own dtype, the same tokens with and without speculation, chunked prefill and
preemption (float64); the layers a preset compresses; the bytes a token takes; bad combinations named."""

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from helpers import VOCAB_SIZE
from helpers.engine import random_prompts, spec_config
from helpers.tokenizer import save_tokenizer
from truespec import LLM, SamplingParams
from truespec.kv_cache.formats import FORMATS, KV_CACHE_DTYPES
from truespec.kv_cache.layout import layer_formats

COMPRESSED = [d for d in KV_CACHE_DTYPES if d != "auto"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def generate(model: Path, prompts: list[dict], **kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), **({"dtype": "float64", "device": "cpu", "max_model_len": 100} | kwargs))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm


def assert_all_free(llm: LLM) -> None:
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]


@pytest.mark.parametrize("kv_cache_dtype", COMPRESSED)
def test_each_dtype_gives_its_tokens_whatever_the_batch_and_speculation(
        tiny_models: dict[str, Path], hybrid_with_heads: dict[str, Path], kv_cache_dtype: str) -> None:
    """Hybrid target with MTP weights: no speculation, one request at a time, is the reference; a mixed batch
    with chunked prefill, ngram and MTP verifies (and a KV pool small enough to preempt) give the same tokens."""
    target = hybrid_with_heads["target"]
    prompts = random_prompts([3, 40, 17, 9, 60], seed=5)
    reference, base = generate(target, prompts, kv_cache_dtype=kv_cache_dtype, max_num_seqs=1)
    auto, _ = generate(target, prompts)
    assert reference != auto  # the cache really is compressed
    for spec in (None, spec_config("ngram", 3, {}), spec_config("mtp", 2, {})):
        out, llm = generate(target, prompts, kv_cache_dtype=kv_cache_dtype, speculative_config=spec,
                            max_num_batched_tokens=16, num_gpu_blocks_override=8, max_model_len=100)
        assert out == reference, spec
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_all_free(llm)
    assert all(layer.kv_format is FORMATS[kv_cache_dtype] for layer in base.llm_engine.loaded.model.attention_layers())


@pytest.fixture(scope="module")
def dense_six_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense model of 6 attention layers (head_dim 16), for the TurboQuant boundary rule."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB_SIZE, max_position_embeddings=512, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         initializer_range=0.3, eos_token_id=None)
    path = tmp_path_factory.mktemp("dense6") / "model"
    Qwen3ForCausalLM(config).to(torch.float64).save_pretrained(path)
    save_tokenizer(path, VOCAB_SIZE - 8)
    return path


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_which_layers_compress_and_the_bytes_a_token_takes(dense_six_layers: Path, tiny_models: dict[str, Path],
                                                           kv_cache_dtype: str) -> None:
    """Dense: TurboQuant presets keep the first and last two attention layers in the model dtype, fp8 compresses
    all; hybrid: every attention layer. cache_info's kv_bytes_per_token is the sum over layers and KV heads."""
    prompts = random_prompts([12, 30], seed=2)
    fmt = FORMATS[kv_cache_dtype]
    for name, path in (("dense", dense_six_layers), ("hybrid", tiny_models["hybrid"])):
        _, llm = generate(path, prompts, kv_cache_dtype=kv_cache_dtype)
        model = llm.llm_engine.loaded.model
        formats = layer_formats(model, kv_cache_dtype)
        kept = [f.name for f in formats]
        if name == "dense" and fmt.keeps_boundary_layers:
            assert kept == ["auto"] * 2 + [kv_cache_dtype] * 2 + ["auto"] * 2
        else:
            assert kept == [kv_cache_dtype] * len(formats)
        layers = model.attention_layers()
        expected = sum(layer.num_kv_heads * f.bytes_per_token(layer.head_dim, 8)
                       for layer, f in zip(layers, formats, strict=True))
        assert llm.cache_info()["kv_bytes_per_token"] == expected
        if kv_cache_dtype == "auto":
            assert expected == sum(2 * layer.num_kv_heads * layer.head_dim * 8 for layer in layers)


def test_a_head_dim_a_format_cannot_store_is_named(tiny_models: dict[str, Path]) -> None:
    """The tiny qwen3 has head_dim 10: the rotated TurboQuant keys need a power of two; fp8 and k8v4 store it."""
    with pytest.raises(ValueError, match="kv_cache_dtype 'turboquant_4bit_nc' needs a power-of-two head_dim"):
        LLM(str(tiny_models["qwen3"]), dtype="float64", device="cpu", max_model_len=64,
            kv_cache_dtype="turboquant_4bit_nc")
    for kv_cache_dtype in ("fp8", "turboquant_k8v4"):
        out, llm = generate(tiny_models["qwen3"], random_prompts([5], seed=1), kv_cache_dtype=kv_cache_dtype)
        assert len(out[0]) == GREEDY.max_tokens
        assert_all_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_3bit_nc"])
def test_sparse_v_rows_skip_alike_with_and_without_speculation(
        hybrid_with_heads: dict[str, Path], kv_cache_dtype: str) -> None:
    """Sparse-V (a large threshold so tiles are skipped; "auto" gated at 32 keys): a verify row skips the tiles its
    decode row skips, so a mixed batch with chunked prefill, ngram and MTP gives the tokens of one request at a time
    without speculation; threshold 0 gives the tokens of off."""
    target = hybrid_with_heads["target"]
    prompts = random_prompts([3, 40, 17, 9, 60], seed=5)
    sparse = dict(kv_cache_dtype=kv_cache_dtype, sparse_v="auto", sparse_v_threshold=0.2, sparse_v_ctx_threshold=32)
    reference, llm = generate(target, prompts, max_num_seqs=1, **sparse)
    assert all(layer.sparse_v.min_keys == 32 for layer in llm.llm_engine.loaded.model.attention_layers())
    off, _ = generate(target, prompts, kv_cache_dtype=kv_cache_dtype)
    assert reference != off  # tiles really were skipped
    for spec in (None, spec_config("ngram", 3, {}), spec_config("mtp", 2, {})):
        out, _ = generate(target, prompts, speculative_config=spec, max_num_batched_tokens=16, **sparse)
        assert out == reference, spec
    zero, _ = generate(target, prompts, **(sparse | {"sparse_v": "on", "sparse_v_threshold": 0.0}))
    assert zero == off
