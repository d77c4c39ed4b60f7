"""Structured outputs on the embedded model, in float64: the output follows its JSON schema / regex / choices, and
the constraint changes nothing else. Speculation (ngram, MTP) gives the tokens of the run without it under the
same constraint (greedy), a seeded sampled request its tokens whatever the batch; an unconstrained request beside
constrained ones gets its tokens alone; async scheduling changes no token and never queues a constrained step
ahead; a bad constraint is a ValueError naming the field, and fails alone."""

import json
import re

import pytest

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "lines", "public"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "kind": {"enum": ["function", "class", "module"]},
                         "lines": {"type": "integer", "minimum": 0, "maximum": 999},
                         "public": {"type": "boolean"}}}
# an example in the prompt gives ngram drafts to accept; after the object closes they propose the prompt's next
# line, which the grammar rejects (only EOS may follow)
EXAMPLE = 'record = {"name": "parse", "kind": "function", "lines": 12, "public": true}\n'
PROMPTS = [EXAMPLE + "record = ", "def load(path):\n    return json.loads(", EXAMPLE * 2 + "# the class\nrecord = "]
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)  # the tiny model loops on free whitespace


def follows_schema(value: object) -> bool:
    """A hand check of SCHEMA (jsonschema is not a dependency)."""
    p = SCHEMA["properties"]
    return (isinstance(value, dict) and set(value) == set(p) and isinstance(value["name"], str)
            and len(value["name"]) <= 12 and value["kind"] in p["kind"]["enum"] and type(value["lines"]) is int
            and 0 <= value["lines"] <= 999 and isinstance(value["public"], bool))


def llm_of(**kwargs: object) -> LLM:
    return LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=512, **kwargs)


def constrained(temperature: float = 0.0, seed: int | None = None, so: StructuredOutputsParams = JSON,
                **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=64, structured_outputs=so, **kwargs)


def outputs(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return llm_of()


@pytest.fixture(scope="module")
def greedy_reference(plain: LLM) -> list[tuple]:
    return outputs(plain, PROMPTS, constrained())


def test_json_schema_output_parses_and_follows_the_schema(plain: LLM, greedy_reference: list[tuple]) -> None:
    for tokens, text, reason in greedy_reference:
        assert reason == "stop" and follows_schema(json.loads(text)), text  # EOS right where the object closed
        assert tokens[-1] in (0, 2)
    # the grammar's stop tokens are the engine's EOS ids (config, generation config and tokenizer together)
    engine = plain.llm_engine
    assert engine.structured_outputs.compiler.stop_token_ids == sorted(engine.stop_checker.eos_token_ids) == [0, 2]


def grammar_accepts(llm: LLM, so: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of ``so``'s grammar accepts every token (a prefix of the language)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(llm.llm_engine.structured_outputs.compiler.compile(so))
    return all(matcher.accept_token(t) for t in token_ids)


REGEX = r"[a-z_]{1,8}\(\d{1,3}\)"


def test_json_object_regex_and_choice_constrain_the_text(plain: LLM) -> None:
    cases = [(StructuredOutputsParams(json_object=True, disable_any_whitespace=True), None),  # runs to max_tokens
             (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
             (StructuredOutputsParams(choice=["True", "False", "None"]), lambda t: t in ("True", "False", "None"))]
    for so, ok in cases:
        for tokens, text, reason in outputs(plain, PROMPTS, constrained(so=so)):
            assert grammar_accepts(plain, so, tokens), (so, text)
            assert text.startswith("{") if ok is None else reason == "stop" and ok(text), (so, text)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_under_a_constraint_gives_the_plain_tokens(greedy_reference: list[tuple], plain: LLM,
                                                               method: str) -> None:
    config = {"method": method, "num_speculative_tokens": 3} | ({"prompt_lookup_min": 1} if method == "ngram" else {})
    llm = llm_of(speculative_config=config, max_num_batched_tokens=32)  # prefill chunks beside verifies
    assert outputs(llm, PROMPTS, constrained()) == greedy_reference
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    # seeded sampling: the same tokens whatever the batch, and every output follows the schema (a draft the grammar
    # forbids has probability 0 under the masked target: the rejection sampler never accepts it)
    params = [constrained(0.8, seed=3 + i) for i in range(len(PROMPTS))]
    together = outputs(llm, PROMPTS, params)
    assert together == [outputs(llm, [p], sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]
    for _, text, reason in together:
        assert reason == "stop" and follows_schema(json.loads(text)), text


def test_unconstrained_requests_beside_constrained_ones_get_their_tokens(plain: LLM,
                                                                         greedy_reference: list[tuple]) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = outputs(plain, PROMPTS, free)
    mixed = outputs(plain, PROMPTS + PROMPTS, [free] * len(PROMPTS) + [constrained()] * len(PROMPTS))
    assert mixed == alone + greedy_reference
    assert alone != greedy_reference


@pytest.mark.parametrize("speculative_config", [None, {"method": "mtp", "num_speculative_tokens": 2}])
def test_async_scheduling_changes_no_token_and_never_queues_a_constrained_step(
        plain: LLM, greedy_reference: list[tuple], speculative_config: dict | None) -> None:
    free = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # outlives the constrained ones
    prompts, params = PROMPTS * 2, [constrained()] * len(PROMPTS) + [free] * len(PROMPTS)
    reference = outputs(plain, prompts, params)
    llm = llm_of(async_scheduling=True, speculative_config=speculative_config)
    runner, queued = llm.llm_engine.runner, []
    launch = runner.launch

    def recording_launch(sched: object, input_ids_from: object = None, shift: object = None) -> object:
        queued.append((input_ids_from is not None, any(r.params.structured_outputs for r in sched.scheduled)))
        return launch(sched, input_ids_from, shift)

    runner.launch = recording_launch
    assert outputs(llm, prompts, params) == reference
    assert reference[:len(PROMPTS)] == greedy_reference
    assert (True, False) in queued and (True, True) not in queued  # the free requests ran ahead once alone


BAD = [(dict(json={"type": "foo"}), "structured_outputs.json"),
       (dict(json={"properties": 5}), "structured_outputs.json"),
       (dict(regex="("), "structured_outputs.regex"), (dict(grammar="root ::= "), "structured_outputs.grammar")]


def test_a_constraint_that_does_not_compile_fails_alone_naming_the_field(plain: LLM,
                                                                        greedy_reference: list[tuple]) -> None:
    engine = plain.llm_engine
    good = engine.add_request(PROMPTS[0], constrained())
    for so, field in BAD:
        with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{field} is not a valid")):
            engine.add_request(PROMPTS[1], constrained(so=StructuredOutputsParams(**so)))
    texts = {}
    while engine.has_unfinished_requests():
        texts |= {o.request_id: o.outputs[0].text for o in engine.step()}
    assert texts[good] == greedy_reference[0][1]
    assert not engine.structured_outputs.matchers
    info = plain.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({}, "structured_outputs"), ({"json": "{"}, "structured_outputs.json"),
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs"), ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"), ({"regex": ""}, "structured_outputs.regex"),
    ({"json": 5}, "structured_outputs.json"), ({"json_object": True, "disable_any_whitespace": 1},
                                               "structured_outputs.disable_any_whitespace"),
])
def test_malformed_structured_outputs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"SamplingParams.{field} ")):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def test_compiled_once_per_schema_and_no_matcher_left(plain: LLM, greedy_reference: list[tuple]) -> None:
    manager = plain.llm_engine.structured_outputs
    before = manager.compiler.num_compiled
    same = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2), disable_any_whitespace=True)  # as text
    manager.check(constrained(so=same))
    assert manager.compiler.num_compiled == before and not manager.matchers  # every request dropped its matcher


def test_without_a_tokenizer_structured_outputs_are_refused() -> None:
    llm = llm_of(skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, constrained(), use_tqdm=False)
