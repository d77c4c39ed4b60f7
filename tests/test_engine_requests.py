"""Request lifecycle: stop conditions, accounting after finish / abort / preemption / errors (invariant 6),
and bad input that fails alone while the same LLM keeps serving unchanged output."""

import gc
import weakref
from pathlib import Path

import pytest

from helpers.engine import random_prompts, set_eos_token_ids
from truespec import LLM, SamplingParams
from truespec.entrypoints.cli import main as cli_main

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=256,
               num_gpu_blocks_override=20, max_num_batched_tokens=32)


def assert_all_free(llm: LLM) -> None:
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"]
    assert info["num_free_state_slots"] == info["num_state_slots"]


def baseline(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(random_prompts([3, 50, 120]), GREEDY, use_tqdm=False)]


def test_accounting_after_finish_and_abort(llm: LLM) -> None:
    engine = llm.llm_engine
    ids = [engine.add_request(p, GREEDY) for p in random_prompts([10, 80, 150, 200], seed=5)]
    for _ in range(6):
        engine.step()
    assert engine.scheduler.num_preemptions > 0 or engine.cache_info()["num_free_blocks"] < 20
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert_all_free(llm)
    baseline(llm)
    assert_all_free(llm)


def test_error_inside_a_step_frees_everything_and_engine_recovers(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    before = baseline(llm)
    runner = llm.llm_engine.runner
    calls = {"n": 0}
    real_launch = runner.launch

    def failing_launch(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(runner, "launch", failing_launch)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(random_prompts([3, 50, 120]), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_all_free(llm)
    assert baseline(llm) == before


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": list(range(1, 257))}, "max_model_len"),
    ({"prompt_token_ids": [1, 99999]}, "vocabulary"),
    ({"prompt_token_ids": [-1, 3]}, "vocabulary"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
    ({"prompt_token_ids": [True, 2]}, "list of ints"),  # a bool is an int to Python, not a token
    ({"prompt_token_ids": [1, 2.0]}, "list of ints"),
    (42, "prompt must be"),
])
def test_bad_prompt_fails_alone(llm: LLM, prompt: object, message: str) -> None:
    before = baseline(llm)
    with pytest.raises(ValueError, match=message):
        llm.generate([random_prompts([4])[0], prompt], GREEDY, use_tqdm=False)
    assert_all_free(llm)
    assert baseline(llm) == before


def test_bad_sampling_params_argument(llm: LLM) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(random_prompts([4, 5]), [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(random_prompts([4]), {"temperature": 0}, use_tqdm=False)  # type: ignore[arg-type]
    assert_all_free(llm)


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = random_prompts([20], seed=9)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_at = 5
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[stop_at]],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[stop_at])
    assert out.token_ids == tokens[:first + 1] and out.finish_reason == "stop" and out.stop_reason == tokens[first]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=first + 2,
                                              stop_token_ids=[tokens[stop_at]], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2  # the stop token is banned until min_tokens
    assert tokens[stop_at] not in out.token_ids[:first + 1]


def test_stop_string_cuts_text(llm: LLM) -> None:
    prompt = random_prompts([20], seed=9)
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text[:text.find(stop)]
    for include, expected in [(False, cut), (True, cut + stop)]:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop, ignore_eos=True,
                                                  include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.text == expected and out.finish_reason == "stop" and out.stop_reason == stop
        assert full[0].outputs[0].token_ids[:len(out.token_ids)] == out.token_ids


def test_a_stop_string_inside_the_min_tokens_text_is_ignored(llm: LLM) -> None:
    """vLLM's rule: the text of the first min_tokens tokens is not searched for stop strings; a match that ends
    after it stops the request there (it may begin inside it)."""
    tokenizer, min_tokens, checked = llm.get_tokenizer(), 6, 0
    for seed in range(60):
        prompt = random_prompts([20], seed=seed)
        ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        stop = tokenizer.decode(ref.token_ids[:3])[-2:]  # occurs in the text of the first 3 tokens
        floor = len(tokenizer.decode(ref.token_ids[:min_tokens]))
        end = ref.text.find(stop, floor - len(stop) + 1)
        if len(stop) < 2 or end < 0 or ref.text.find(stop) >= floor:
            continue  # this continuation has no early match, or none after min_tokens
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=min_tokens,
                                                  stop=stop), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (ref.text[:end], "stop", stop)
        assert len(out.token_ids) > min_tokens and out.token_ids == ref.token_ids[:len(out.token_ids)]
        checked += 1
    assert checked >= 3


def test_eos_finishes_with_stop(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["qwen3"]), dtype="float64", device="cpu", max_model_len=128)
    prompt = random_prompts([7], seed=3)
    tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    set_eos_token_ids(llm.llm_engine, {tokens[4]})
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[4])
    assert out.token_ids == tokens[:first + 1] and out.finish_reason == "stop"


def test_length_limit_is_max_model_len(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": list(range(1, 251))}, SamplingParams(temperature=0, max_tokens=None,
                                                                                ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"


def test_missing_model_dir_and_corrupt_weights(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope"), device="cpu")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_models["qwen3"].iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(broken), device="cpu")


def test_invalid_engine_config_names_the_field(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(tiny_models["qwen3"]), max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_models["qwen3"]), dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_models["qwen3"]), device="cpu", max_model_len=4096)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        LLM(str(tiny_models["qwen3"]), device="cpu", max_model_len=512, num_gpu_blocks_override=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(tiny_models["qwen3"]), gpu_memory_utilization="0.5")
    with pytest.raises(ValueError, match="seed"):
        LLM(str(tiny_models["qwen3"]), seed=True)


def test_cli_generate(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "--model", str(tiny_models["qwen3"]), "--max-tokens", "5", "--dtype", "float32",
                     "def f(x):"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def f(x):") and "tokens/s" in captured.err
    assert cli_main(["generate", "--model", "/no/such/dir", "x"]) == 2


def test_failure_after_the_forward_leaves_other_requests_exact(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails after the forward wrote state slots must not let a request run on from a half-written
    state: the engine preempts (recomputes) the step's requests, so their output is unchanged."""
    prompts = random_prompts([30, 70], seed=21)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    seqs = [engine.seqs[i] for i in ids]
    for _ in range(5):
        engine.step()
    real_collect = runner.collect

    def collect_then_fail(*args: object, **kwargs: object) -> object:
        real_collect(*args, **kwargs)  # the forward ran and wrote KV and state slots
        raise RuntimeError("injected failure after the forward")

    monkeypatch.setattr(runner, "collect", collect_then_fail)
    with pytest.raises(RuntimeError, match="after the forward"):
        engine.step()
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.output_token_ids for s in seqs] == reference
    assert_all_free(llm)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6]), "stop_token_ids"),
])
def test_request_values_checked_against_the_model(llm: LLM, params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate(random_prompts([4]), params, use_tqdm=False)
    assert_all_free(llm)


def test_bool_token_ids_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [True, 2]}, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("method", [None, "mtp"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_dropped_llm_frees_its_cache_at_once(tiny_models: dict[str, Path], hybrid_with_heads: dict[str, Path],
                                               async_scheduling: bool, method: str | None) -> None:
    """No reference cycle keeps an engine and its caches alive once its LLM is dropped (a test run or a server that
    replaces its LLM gets the memory back without waiting for the garbage collector), with or without a drafter
    and verifies queued ahead."""
    model = tiny_models["hybrid"] if method is None else hybrid_with_heads["target"]
    spec = None if method is None else {"method": method, "num_speculative_tokens": 2}
    llm = LLM(str(model), dtype="float64", device="cpu", max_model_len=128, async_scheduling=async_scheduling,
              speculative_config=spec)
    llm.generate(random_prompts([5, 9]), GREEDY, use_tqdm=False)
    engine = weakref.ref(llm.llm_engine)
    gc.disable()
    try:
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_a_checkpoint_without_a_tokenizer_is_named_and_skip_tokenizer_init_serves_token_ids(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_models["qwen3"], bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    with pytest.raises(ValueError, match="has no tokenizer.*skip_tokenizer_init=True"):
        LLM(str(bare), dtype="float64", device="cpu", max_model_len=128)
    llm = LLM(str(bare), dtype="float64", device="cpu", max_model_len=128, skip_tokenizer_init=True)
    with_tokenizer = LLM(str(tiny_models["qwen3"]), dtype="float64", device="cpu", max_model_len=128)
    prompts = random_prompts([5, 9], seed=1)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in with_tokenizer.generate(
        prompts, GREEDY, use_tqdm=False)]
    assert all(o.outputs[0].text == "" for o in outs) and llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="text prompt needs a tokenizer"):
        llm.generate("def f():", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        llm.generate(prompts, SamplingParams(max_tokens=4, stop="x"), use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(str(bare), device="cpu", skip_tokenizer_init="yes")
    assert_all_free(llm)


def test_a_prompt_with_a_lone_surrogate_fails_alone(llm: LLM) -> None:
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(["def f():", "x\ud800y"], GREEDY, use_tqdm=False)
    assert_all_free(llm)
    assert len(llm.generate("def f():", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


def test_concurrent_generate_calls_each_get_their_own_tokens(llm: LLM) -> None:
    """Two threads on one LLM, different batches, several rounds: each output equals its batch run alone."""
    import threading

    batches = [random_prompts([3, 17, 40], seed=31), random_prompts([25, 6], seed=32)]
    alone = [[o.outputs[0].token_ids for o in llm.generate(b, GREEDY, use_tqdm=False)] for b in batches]
    results: list[list] = [[], []]
    errors: list[BaseException] = []

    def hammer(i: int) -> None:
        try:
            for _ in range(4):
                results[i].append([o.outputs[0].token_ids for o in llm.generate(batches[i], GREEDY, use_tqdm=False)])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [[alone[0]] * 4, [alone[1]] * 4]
    assert_all_free(llm)


def test_a_second_thread_inside_engine_step_gets_a_clear_error(llm: LLM) -> None:
    engine = llm.llm_engine
    assert engine._stepping.acquire(blocking=False)  # as if another thread were inside step()
    try:
        with pytest.raises(RuntimeError, match="another thread"):
            engine.step()
    finally:
        engine._stepping.release()


def test_an_interrupt_while_adding_requests_leaves_nothing_queued(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, calls = llm.llm_engine, []
    real_add = engine.add_sequence

    def add_then_interrupt(seq: object) -> None:
        calls.append(seq)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_add(seq)

    monkeypatch.setattr(engine, "add_sequence", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(random_prompts([4, 5, 6]), GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert_all_free(llm)


@pytest.mark.parametrize("prompts, params, message", [
    (None, GREEDY, "prompts must be"), (b"def f():", GREEDY, "prompts must be"), (5, GREEDY, "prompts must be"),
    ("def f():", {"temperature": 0}, "sampling_params must be"), ("def f():", ["x"], "must hold SamplingParams"),
])
def test_generate_names_a_wrong_argument(llm: LLM, prompts: object, params: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert_all_free(llm)


def test_a_failure_inside_the_launch_after_the_forward_leaves_outputs_exact(llm: LLM,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The logits fail once after the forward wrote KV and state slots: the step's requests restart from their
    tokens, so their outputs equal the reference."""
    prompts = random_prompts([30, 70], seed=22)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    engine, model = llm.llm_engine, llm.llm_engine.runner.model
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    seqs = [engine.seqs[i] for i in ids]
    for _ in range(6):
        engine.step()
    real_logits = model.compute_logits

    def fail_once(*args: object) -> object:
        monkeypatch.setattr(model, "compute_logits", real_logits)
        raise RuntimeError("injected failure inside launch")

    monkeypatch.setattr(model, "compute_logits", fail_once)
    with pytest.raises(RuntimeError, match="inside launch"):
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.output_token_ids for s in seqs] == reference
    assert_all_free(llm)


def test_random_streams_are_dropped_even_after_an_idle_step(llm: LLM) -> None:
    """A finished request's generator goes when the runner hears of it, also if a step with nothing to run
    came between."""
    engine = llm.llm_engine
    llm.generate(random_prompts([5]), SamplingParams(temperature=1.0, seed=3, max_tokens=4), use_tqdm=False)
    assert engine.step() == []  # idle
    llm.generate(random_prompts([6, 7]), GREEDY, use_tqdm=False)
    assert engine.runner._generators == {}
