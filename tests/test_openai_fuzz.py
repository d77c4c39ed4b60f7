"""The OpenAI-compatible app under random request bodies: every answer is a 2xx or an OpenAI-style 4xx (never a 5xx,
never FastAPI's 422), a stream never carries an error event, the server stays healthy, and once it is idle no KV
block or state slot is held. Bodies mix mostly-valid requests (max_tokens <= 4) with wrong types, huge and negative
numbers, nulls, nested junk, unknown and missing fields, lone surrogates, NaN and very long prompts.

The app runs in-process (the embedded model in float32, behind FastAPI's TestClient) with the qwen3_coder tool parser
and the qwen3 reasoning parser, so the tool_choice checks and the parsers see the fuzz too."""

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from truespec import LLM
from truespec.entrypoints.chat_parsing import chat_parser_factory
from truespec.entrypoints.openai_server import build_app

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

MODEL = "fuzz"
MAX_MODEL_LEN = 128  # a request with a huge max_tokens runs to here: keep it short on the 2-core CI machine
ALLOWED = {200, 400, 401, 404, 503}
FUZZ = hypothesis.settings(max_examples=50, deadline=None, database=None, derandomize=True,
                           suppress_health_check=list(hypothesis.HealthCheck))

# ---- strategies ------------------------------------------------------------------------------------------------
EDGE_INTS = st.sampled_from([0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30])
INTS = st.integers(-3, 6) | EDGE_INTS
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e-45, 3.5e38, 1e308])
TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "\x00", "<think>", "<tool_call>", "é€😀",
                                               "x " * 300])
SCALARS = st.none() | st.booleans() | INTS | FLOATS | TEXT
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
CONTENT_TYPES = st.sampled_from(["application/json"] * 6 + ["text/plain", "application/x-www-form-urlencoded", ""])
TOKEN_IDS = st.lists(st.integers(0, 2047) | EDGE_INTS, max_size=6)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | JSON},
    optional={"content": TEXT | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text") | JSON,
                                                                           "text": TEXT | JSON}), max_size=2) | JSON,
              "tool_calls": JSON, "name": JSON, "tool_call_id": JSON})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["add", "now"])},
    optional={"parameters": st.just({"type": "object", "properties": {"a": {"type": "integer"}}}) | JSON})}) | JSON

TEMPLATE_KWARGS = ["enable_thinking", "tokenize", "tools", "add_generation_prompt", "return_dict", "documents", "x"]
SAMPLING = {
    "model": st.just(MODEL) | st.none() | TEXT | JSON,
    "max_tokens": st.integers(1, 4) | INTS | JSON,
    "temperature": st.sampled_from([0.0, 0.7, 1.0]) | FLOATS | JSON,
    "top_p": st.floats(0.1, 1.0) | FLOATS,
    "top_k": INTS,
    "min_p": FLOATS,
    "seed": INTS | st.none(),
    "stop": TEXT | st.lists(TEXT, max_size=3) | JSON,
    "n": st.just(1) | INTS,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "presence_penalty": FLOATS,
    "min_tokens": INTS,
    "stop_token_ids": TOKEN_IDS | JSON,
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans() | JSON,
    "include_stop_str_in_output": st.booleans(),
    "user": TEXT | JSON,
    # output constraints: well-formed ones run constrained decoding, junk schemas / regexes / grammars are 400s
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}]) | JSON
    | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": TEXT, "schema": JSON | st.just({"type": "object", "properties": {"a": {"type": "integer"}}})})}),
    "structured_outputs": JSON | st.fixed_dictionaries({}, optional={
        "json": JSON, "regex": TEXT | st.just("[a-z]{1,3}"), "choice": st.lists(TEXT, max_size=3) | JSON,
        "grammar": TEXT | st.just('root ::= "a" | "b"'), "json_object": JSON, "disable_any_whitespace": JSON}),
}
FIELDS: dict[str, dict[str, Any]] = {
    "/v1/completions": SAMPLING | {
        "prompt": TEXT | st.lists(TEXT, max_size=3) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=2) | JSON,
        "logprobs": st.none() | INTS | JSON, "echo": st.booleans(), "suffix": st.none() | TEXT},
    "/v1/chat/completions": SAMPLING | {
        "messages": st.lists(MESSAGE, max_size=3) | JSON, "max_completion_tokens": st.integers(1, 4) | INTS,
        "logprobs": st.booleans() | JSON, "top_logprobs": st.none() | INTS,
        "tools": st.lists(TOOL, max_size=2) | JSON,
        "tool_choice": st.sampled_from(["auto", "none", "required", "bogus"]) | JSON | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["add", "x"])})
             | JSON}),
        "parallel_tool_calls": st.booleans() | JSON,
        "add_generation_prompt": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(TEMPLATE_KWARGS), JSON, min_size=1, max_size=2) | JSON},
    "/tokenize": {"model": st.just(MODEL) | JSON, "prompt": TEXT | JSON, "messages": st.lists(MESSAGE, max_size=2),
                  "add_special_tokens": st.booleans() | JSON, "add_generation_prompt": st.booleans()},
    "/detokenize": {"model": st.just(MODEL) | JSON, "tokens": TOKEN_IDS | JSON},
}
REQUIRED = {"/v1/completions": {"prompt": st.just("def fib(n):")},
            "/v1/chat/completions": {"messages": st.just([{"role": "user", "content": "hi"}])},
            "/tokenize": {"prompt": st.just("hi")}, "/detokenize": {"tokens": st.just([1, 2, 3])}}
VALID = {  # a valid request's optional fields (max_tokens <= 4 so it finishes fast)
    "/v1/completions": {"max_tokens": st.integers(1, 4)},
    "/v1/chat/completions": {"max_tokens": st.integers(1, 4)}, "/tokenize": {}, "/detokenize": {}}
VALID_OPTIONAL = {
    "/v1/completions": {"stream": st.booleans(), "temperature": st.sampled_from([0.0, 0.8]), "stop": st.just(["\n"]),
                        "logprobs": st.integers(0, 3), "stream_options": st.just({"include_usage": True}),
                        "model": st.just(MODEL), "seed": st.integers(0, 9)},
    "/v1/chat/completions": {"stream": st.booleans(), "temperature": st.sampled_from([0.0, 0.8]),
                             "tools": st.just([{"type": "function", "function": {"name": "add", "parameters": {
                                 "type": "object", "properties": {"a": {"type": "integer"}}}}}]),
                             "tool_choice": st.sampled_from(["auto", "none"]), "logprobs": st.just(True),
                             "top_logprobs": st.integers(0, 2), "chat_template_kwargs": st.just(
                                 {"enable_thinking": False}), "model": st.just(MODEL)},
    "/tokenize": {"add_special_tokens": st.booleans(), "model": st.just(MODEL)},
    "/detokenize": {"model": st.just(MODEL)}}


@st.composite
def request_bodies(draw: Callable, path: str) -> bytes:
    """A body for ``path``: mostly a valid request (a few fields fuzzed), sometimes anything at all."""
    kind = draw(st.sampled_from(["valid", "valid", "fuzzed", "fuzzed", "fuzzed", "fuzzed", "junk", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40) | st.sampled_from([b"", b"{", b'{"prompt": "\xff\xfe"}', b"null"]))
    if kind == "junk":
        return json.dumps(draw(JSON)).encode()
    body = draw(st.fixed_dictionaries(REQUIRED[path] | VALID[path], optional=VALID_OPTIONAL[path]))
    if body.get("stream") is False:
        body.pop("stream_options", None)
    if kind == "fuzzed":
        own = sorted(set(FIELDS[path]) - set(SAMPLING))  # the endpoint's own fields: fuzzed 3x as often
        names = draw(st.lists(st.sampled_from(sorted(FIELDS[path]) + own * 2), min_size=1, max_size=3, unique=True))
        body |= {name: draw(FIELDS[path][name]) for name in names}
        body |= draw(st.dictionaries(TEXT, JSON, max_size=1))  # unknown fields
        for name in draw(st.lists(st.sampled_from(sorted(REQUIRED[path])), max_size=1)):
            body.pop(name, None)  # a missing required field
    return json.dumps(body).encode()  # NaN / Infinity and escaped lone surrogates, as a lax client sends them


# ---- the app ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    torch.set_num_threads(1)
    llm = LLM(None, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    app = build_app(llm.llm_engine, MODEL, chat_parser=chat_parser_factory("qwen3_coder", "qwen3", True))
    with TestClient(app, raise_server_exceptions=False) as c:  # its context runs the app's lifespan: engine thread
        yield c
    assert not app.state.engine_loop.is_alive, "the engine thread must stop with the app"


def _engine_state(client: TestClient) -> tuple[bool, dict[str, int]]:
    """(has unfinished requests, cache info), read on the engine thread between steps."""
    loop = client.app.state.engine_loop
    return client.portal.call(loop.call, lambda e: (e.has_unfinished_requests(), e.cache_info()))


# 500s the fuzz once found, each now a 400 naming the field: (path, a minimal request, the field)
FOUND_BY_FUZZ: dict[str, tuple[str, dict[str, Any], str]] = {
    # a lone surrogate must not reach tokenizer.encode (chat template, /tokenize)
    "lone_surrogate_chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
                            "messages[0].content"),
    "lone_surrogate_tokenize": ("/tokenize", {"prompt": "a\udfffb"}, "prompt"),
    # a tool_choice / tools "function" that is not an object
    "tool_choice_function_not_object": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                  "tool_choice": {"function": "x"}}, "tool_choice"),
    "tools_function_not_object": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "tools": [{"function": "x"}],
                                                            "tool_choice": {"function": {"name": "x"}}}, "tools"),
    # chat_template_kwargs: a key the server sets itself, and a keyword of the wrong type
    "template_kwargs_reserved": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "chat_template_kwargs": {"tokenize": True}},
                                 "chat_template_kwargs"),
    "template_kwargs_wrong_type": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "chat_template_kwargs": {"documents": 5}},
                                   "chat_template_kwargs"),
    # a request's own template (refused, as vLLM does without --trust-request-chat-template)
    "own_template": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "chat_template_kwargs": {"chat_template": "{{ 1 / 0 }}"}},
                     "chat_template_kwargs"),
}


def _post(client: TestClient, path: str, body: bytes, content_type: str = "application/json") -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": content_type})


def _check(client: TestClient, path: str, body: bytes, content_type: str = "application/json") -> None:
    r = _post(client, path, body, content_type)
    assert r.status_code in ALLOWED, f"{path} {body[:300]!r} -> {r.status_code}: {r.text[:500]}"
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["code"] == r.status_code and isinstance(error["message"], str), r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", f"{path} {body[:300]!r}: a stream that did not end: {r.text[-500:]}"
        assert not any(e.startswith('{"error"') for e in events), f"{path} {body[:300]!r}: {r.text[-500:]}"


@pytest.mark.parametrize("path", list(FIELDS))
def test_random_bodies_get_openai_errors_and_never_a_5xx(client: TestClient, path: str) -> None:
    @hypothesis.given(body=request_bodies(path), content_type=CONTENT_TYPES)
    @FUZZ
    def fuzz(body: bytes, content_type: str) -> None:
        _check(client, path, body, content_type)

    fuzz()


@pytest.mark.parametrize("case", list(FOUND_BY_FUZZ))
def test_requests_the_fuzz_found_are_400s_naming_the_field(client: TestClient, case: str) -> None:
    path, body, field = FOUND_BY_FUZZ[case]
    r = _post(client, path, json.dumps(body | {"max_tokens": 1}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_chat_template_that_raises_on_the_messages_is_a_400(client: TestClient) -> None:
    """A template that rejects a request's messages (as Qwen templates raise on a misplaced system message) makes
    that request a 400 naming messages, never a 500; the next request is served."""
    loop = client.app.state.engine_loop
    tokenizer = client.portal.call(loop.call, lambda e: e.tokenizer)
    template = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('System message must be at the beginning.') }}"
    try:
        r = _post(client, "/v1/chat/completions",
                  json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode())
    finally:
        tokenizer.chat_template = template
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "System message must be at the beginning" in r.json()["error"]["message"]
    ok = _post(client, "/v1/chat/completions",
               json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode())
    assert ok.status_code == 200, ok.text


def test_server_is_healthy_and_holds_no_blocks_after_the_fuzz(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    busy, info = _engine_state(client)
    assert not busy
    assert info["num_free_blocks"] == info["num_blocks"]
    assert info["num_free_state_slots"] == info["num_state_slots"]


def test_an_empty_prompt_list_is_a_400(client: TestClient) -> None:
    r = _post(client, "/v1/completions", json.dumps({"prompt": [], "max_tokens": 1}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
