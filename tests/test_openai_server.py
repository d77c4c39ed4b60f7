"""`truespec serve` as a real process on a loopback port, driven by the real `openai` client: completions and chat,
streamed and not, with and without speculation; tokenize, metrics, OpenAI-style errors, API key, aborts on
disconnect, SIGTERM. The embedded model in float32, a few tokens per request."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

openai = pytest.importorskip("openai")

ENGINE_ARGS = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "4",
               # structured outputs: the tiny model would spend its tokens on the whitespace JSON allows
               "--structured-outputs-config", '{"disable_any_whitespace": true}']
SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
API_KEY = "sk-test-key"
PROMPT = "def fib(n):"
REPETITIVE = "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2, 3]\nd = [1, 2,"
STARTUP_TIMEOUT_S = 90


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    api_key: str = "unused"

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(truespec:\w+)\{[^}]*\} (\S+)$", text, re.M)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*extra: str) -> Server:
    port = _free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # 2-core CI: torch's thread pool contending makes it crawl
    cmd = [sys.executable, "-m", "truespec.entrypoints.cli", "serve", *ENGINE_ARGS, "--port", str(port),
           "--log-level", "warning", *extra]
    return Server(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                  f"http://127.0.0.1:{port}")


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"server exited with {server.proc.returncode}: {server.proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail("server did not become healthy")


def _stop(server: Server) -> int:
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
        return -9


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    """(plain, ngram speculation behind --api-key with tool-call and reasoning parsers), started side by side."""
    plain = _start()
    spec = _start("--speculative-config", SPEC, "--api-key", API_KEY, "--served-model-name", "spec",
                  "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3")
    spec.api_key = API_KEY
    try:
        _wait_healthy(plain)
        _wait_healthy(spec)
        yield plain, spec
    finally:
        codes = [_stop(plain), _stop(spec)]
    assert codes == [0, 0], "SIGTERM must end the server gracefully with exit code 0"


@pytest.fixture(scope="module")
def server(servers: tuple[Server, Server]) -> Server:
    return servers[0]


def _model(server: Server) -> str:
    return server.client().models.list().data[0].id


def test_models_list_the_served_name(servers: tuple[Server, Server]) -> None:
    plain, spec = servers
    assert [m.id for m in spec.client().models.list().data] == ["spec"]
    assert plain.client().models.list().data[0].max_model_len == 256


def test_streamed_completion_text_equals_non_streamed(server: Server) -> None:
    client, model = server.client(), _model(server)
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_chat_text_equals_non_streamed(server: Server) -> None:
    client, model = server.client(), _model(server)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    full = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_speculative_server_gives_the_plain_text(servers: tuple[Server, Server]) -> None:
    plain, spec = servers
    for prompt in (PROMPT, REPETITIVE):
        texts = [s.client().completions.create(model=_model(s), prompt=prompt, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text for s in servers]
        assert texts[0] == texts[1]
        streamed = spec.client().completions.create(model="spec", prompt=prompt, max_tokens=24, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == texts[0]
    assert spec.metrics()["truespec:spec_decode_num_drafts_total"] > 0


def test_chat_logprobs_in_openai_shape(server: Server) -> None:
    out = server.client().chat.completions.create(model=_model(server), messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == out.choices[0].message.content


def test_tokenize_detokenize_round_trip(server: Server) -> None:
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert tokens and httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"] == PROMPT


def test_metrics_expose_vllm_names(server: Server) -> None:
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert "truespec:" + name in text


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a " * 400}, 400, "prompt"),
    ({"prompt": PROMPT, "n": 0}, 400, "n"),
    ({"prompt": PROMPT, "n": 1.5}, 400, "n"),
    ({"prompt": PROMPT, "n": 10**6}, 400, "n"),  # more than the server queues at once (--max-waiting-requests)
    ({"prompt": PROMPT, "model": "no-such-model"}, 404, "model"),
])
def test_bad_request_gets_openai_error_and_server_goes_on(server: Server, body: dict, status: int,
                                                          param: str) -> None:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"]
    assert server.client().completions.create(model=_model(server), prompt=PROMPT, max_tokens=2).choices


def test_malformed_json_is_400(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_key_is_required_when_set(servers: tuple[Server, Server]) -> None:
    spec = servers[1]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(spec.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=spec.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(spec.url + "/health").status_code == 200  # not behind the key


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server: Server, n: int) -> None:
    """With n > 1 every choice's sequence is aborted."""
    before = server.metrics()["truespec:generation_tokens_total"]
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True, "n": n}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["truespec:num_requests_running"] == 0 and m["truespec:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert m["truespec:kv_cache_usage_perc"] == 0 and m["truespec:num_requests_running"] == 0
    assert m["truespec:generation_tokens_total"] - before < 200 * n  # aborted before its 200 tokens per choice


def test_completion_of_several_prompts_and_token_ids(server: Server) -> None:
    client, model = server.client(), _model(server)
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    out = client.completions.create(model=model, prompt=[PROMPT, REPETITIVE], max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text == alone
    assert out.usage.completion_tokens == 12
    both = client.completions.create(model=model, prompt=[PROMPT, REPETITIVE], max_tokens=6, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})  # prompt i's choice j: index i * n + j
    assert [(c.index, c.text) for c in both.choices] == [(0, alone), (1, alone), (2, out.choices[1].text),
                                                         (3, out.choices[1].text)]
    assert (both.usage.prompt_tokens, both.usage.completion_tokens) == (out.usage.prompt_tokens, 24)
    by_ids = client.completions.create(model=model, prompt=tokens, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == alone


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_tool_choice_is_checked_and_parsed_responses_stream_alike(servers: tuple[Server, Server]) -> None:
    """With the parsers on, a chat with tools streams the same content / reasoning / tool_calls as it returns at
    once; tool_choice "auto" without --enable-auto-tool-choice, an unknown function and "required" without tools
    are 400s."""
    plain, spec = servers
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    client = spec.client()
    full = client.chat.completions.create(model="spec", messages=messages, tools=TOOLS, tool_choice="auto",
                                          max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="spec", messages=messages, tools=TOOLS, tool_choice="auto",
                                                 max_tokens=16, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (full.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    unknown = {"type": "function", "function": {"name": "x"}}
    for server, choice, tools in ((plain, "auto", TOOLS), (spec, unknown, TOOLS), (plain, "required", None)):
        with pytest.raises(openai.BadRequestError) as err:
            server.client().chat.completions.create(model=_model(server), messages=messages, tools=tools,
                                                    tool_choice=choice, max_tokens=4)
        assert err.value.body["param"] == "tool_choice"
    assert plain.client().chat.completions.create(model=_model(plain), messages=messages, tools=TOOLS,
                                                  tool_choice="none", max_tokens=4).choices[0].message.content


def test_streamed_logprobs_equal_non_streamed(server: Server) -> None:
    """Completions and chat: every token's logprob reaches the stream (also a token whose text is held back
    mid-character), the streamed lists add up to the non-streamed ones, and completions text offsets continue."""
    client, model = server.client(), _model(server)
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    full = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert len(full.tokens) == 12
    for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [x for c in chunks for x in getattr(c, field)] == getattr(full, field), field
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    chat = dict(model=model, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = [(t.token, t.logprob) for t in client.chat.completions.create(**chat).choices[0].logprobs.content]
    streamed = [(t.token, t.logprob) for c in client.chat.completions.create(**chat, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == whole and len(whole) == 10


def _by_index(choices: list, text_of: Callable[[object], str | None]) -> dict[int, str]:
    """Streamed choices' text joined per choice index."""
    joined: dict[int, str] = {}
    for c in choices:
        joined[c.index] = joined.get(c.index, "") + (text_of(c) or "")
    return joined


def test_n_choices_stream_as_they_return_at_once(server: Server) -> None:
    """n=2 completions and chat: each choice's streamed text, logprobs and finish_reason equal the non-streamed
    choice of its index; usage counts the prompt once and the completion tokens of both choices."""
    client, model = server.client(), _model(server)
    prompt_tokens = client.completions.create(model=model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=3, n=2, logprobs=1,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1] and [c.finish_reason for c in full.choices] == ["length"] * 2
    assert full.choices[0].text != full.choices[1].text  # seeds 3 and 4
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 16)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert all(len(c.choices) == 1 for c in chunks if c.choices)
    assert _by_index(streamed, lambda c: c.text) == {i: c.text for i, c in enumerate(full.choices)}
    for i, choice in enumerate(full.choices):
        mine = [c for c in streamed if c.index == i]
        assert [c.finish_reason for c in mine][-1] == "length"
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == choice.logprobs.tokens
        assert [o for c in mine if c.logprobs for o in c.logprobs.text_offset] == choice.logprobs.text_offset
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens, 16)

    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    chat = dict(model=model, messages=messages, max_tokens=8, temperature=0.8, seed=5, n=2,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert [c.index for c in streamed if c.delta.role == "assistant"] == [0, 1]  # a role chunk per choice
    assert _by_index(streamed, lambda c: c.delta.content) == {i: c.message.content
                                                              for i, c in enumerate(whole.choices)}
    assert {c.index: c.finish_reason for c in streamed if c.finish_reason} == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 16


def test_each_choice_has_its_own_tool_and_reasoning_parser(servers: tuple[Server, Server]) -> None:
    """Greedy n=2 with the parsers on: both choices are the n=1 response (content, reasoning, tool calls, finish
    reason), streamed and not; one parser shared by the choices would see their text twice."""
    client = servers[1].client()
    kwargs = dict(model="spec", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
                  tool_choice="auto", max_tokens=16, temperature=0)
    one = client.chat.completions.create(**kwargs).choices[0]
    two = client.chat.completions.create(**kwargs, n=2).choices
    fields = ("content", "reasoning_content", "tool_calls")
    expected = [getattr(one.message, f, None) for f in fields] + [one.finish_reason]
    for choice in two:
        assert [getattr(choice.message, f, None) for f in fields] + [choice.finish_reason] == expected
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, n=2, stream=True) if c.choices]
    streamed = _by_index(chunks, lambda c: c.delta.content)
    assert streamed == {0: one.message.content or "", 1: one.message.content or ""}
    assert {c.index: c.finish_reason for c in chunks if c.finish_reason} == {0: one.finish_reason,
                                                                             1: one.finish_reason}


ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def _calls(message_calls: list) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in message_calls]


def _streamed_calls(chunks: list) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, ["", "", ""])
            call[0], call[1] = call[0] or delta.id or "", call[1] or delta.function.name or ""
            call[2] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_follow_the_tool_schema_and_stream_alike(servers: tuple[Server, Server],
                                                                   choice: object) -> None:
    """tool_choice "required" / named: the constrained output becomes tool_calls whose arguments follow the tool's
    schema; streamed calls add up to the non-streamed ones; the ngram-speculative server makes the same calls."""
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    kwargs = dict(messages=messages, tools=[ADD, NOW], tool_choice=choice, max_tokens=48, temperature=0,
                  parallel_tool_calls=False)  # "required": exactly one call (the tiny model would repeat it)
    made = []
    for server in servers:
        client, model = server.client(), _model(server)
        full = client.chat.completions.create(model=model, **kwargs).choices[0]
        chunks = list(client.chat.completions.create(model=model, **kwargs, stream=True))
        calls = _calls(full.message.tool_calls)
        assert _streamed_calls(chunks) == calls and full.message.content == ""
        assert full.finish_reason == chunks[-1].choices[0].finish_reason == ("tool_calls" if choice == "required"
                                                                             else "stop")  # as vLLM / OpenAI
        (call_id, name, arguments), = calls
        args = json.loads(arguments)
        assert call_id == "call_0" and name == "add" and set(args) == {"a", "b"}
        assert all(type(v) is int for v in args.values())
        made.append(calls)
    assert made[0] == made[1]


def test_response_format_json_schema_content_parses(servers: tuple[Server, Server]) -> None:
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"],
              "additionalProperties": False}
    plain, spec = servers
    kwargs = dict(messages=[{"role": "user", "content": "Add 2 and 3."}], max_tokens=32, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}})
    full = plain.client().chat.completions.create(model=_model(plain), **kwargs).choices[0]
    value = json.loads(full.message.content)
    assert full.finish_reason == "stop" and set(value) == {"sum"} and type(value["sum"]) is int
    chunks = spec.client().chat.completions.create(model="spec", **kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.message.content
    text = plain.client().completions.create(model=_model(plain), prompt=PROMPT, max_tokens=32, temperature=0,
                                             extra_body={"response_format": kwargs["response_format"]})
    assert set(json.loads(text.choices[0].text)) == {"sum"}


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "response_format"),
])
def test_bad_output_constraint_is_400_naming_the_field(server: Server, body: dict, param: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
