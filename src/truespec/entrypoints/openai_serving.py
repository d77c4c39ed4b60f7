"""POST /v1/completions and /v1/chat/completions: a request body -> engine requests -> a JSON body or an SSE stream.

Each engine request is one ``Generation``: its DELTA outputs in order; closing it before the request finished
(the client went away, an error) aborts the request, so its blocks and state slots go back to the pools.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from truespec.engine.llm_engine import LLMEngine, PromptType
from truespec.entrypoints.chat_template import render_chat
from truespec.entrypoints.openai_logprobs import chat_logprobs, completion_logprobs
from truespec.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingRequest,
    UnsupportedError,
    UsageInfo,
    random_id,
)
from truespec.entrypoints.response_format import check_constraint, constrained_params
from truespec.entrypoints.serve_loop import EngineLoop, RequestStream
from truespec.outputs import RequestOutput
from truespec.sampling_params import SamplingParams, StructuredOutputsParams

DISCONNECT_POLL_S = 1.0  # how often a request waiting for tokens checks that its client is still there


class ClientDisconnectedError(Exception):
    pass


class Generation:
    """One engine request's outputs, as its handler reads them."""

    def __init__(self, loop: EngineLoop, stream: RequestStream, raw: Request) -> None:
        self.loop, self.stream, self.raw = loop, stream, raw
        self.is_finished = False
        self.num_prompt_tokens = self.num_output_tokens = 0
        self.text_offset = 0  # completions logprobs: where the next streamed token's text starts

    async def next(self) -> RequestOutput:
        """The next output (raises the request's error, or ClientDisconnectedError)."""
        while True:
            try:
                out = await asyncio.wait_for(self.stream.get(), DISCONNECT_POLL_S)
                break
            except TimeoutError:
                if await self.raw.is_disconnected():
                    raise ClientDisconnectedError from None
            except BaseException:
                self.is_finished = self.stream.request_id is None  # an add-time error: nothing to abort
                raise
        self.is_finished = out.finished
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.num_output_tokens += len(out.outputs[0].token_ids)
        return out

    def close(self) -> None:
        if not self.is_finished:
            self.loop.abort(self.stream)
            self.is_finished = True

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_output_tokens,
                         total_tokens=self.num_prompt_tokens + self.num_output_tokens)


class ChatOutputParser:
    """Turns generated text into a chat message (or a streamed delta). The hook where tool-call and reasoning
    parsing plug in (``--tool-call-parser`` / ``--reasoning-parser``: tool_parsers.py, reasoning_parser.py):
    a subclass fills ``tool_calls`` / ``reasoning_content``. This one passes the text through as content.
    ``structured_outputs``: the constraint the output must follow for this parser (forced tool calls' JSON)."""

    structured_outputs: StructuredOutputsParams | None = None

    def delta(self, text: str, is_last: bool = False) -> DeltaMessage | None:
        """The streamed delta for ``text`` (``is_last``: the request's last output, flush what is held)."""
        return DeltaMessage(content=text) if text else None

    def final(self, text: str) -> DeltaMessage:
        return DeltaMessage(role="assistant", content=text)

    def finish_reason(self, reason: str | None) -> str | None:
        return reason


class OpenAIServing:
    def __init__(self, loop: EngineLoop, engine: LLMEngine, model_name: str,
                 chat_parser: Callable[[ChatCompletionRequest], ChatOutputParser] = lambda r: ChatOutputParser()):
        self.loop, self.engine, self.model_name = loop, engine, model_name
        self.chat_parser = chat_parser

    # ---- completions -----------------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        params, prompts = await self._constrained(req.sampling_params(), req), req.prompts()
        if req.stream and len(prompts) != 1:
            raise UnsupportedError("prompt", "streaming several prompts in one request is not supported yet")
        gens: list[Generation] = []
        try:
            for p in prompts:
                gens.append(await self._start(p, params, raw))
        except BaseException:  # 503 for a later prompt: the earlier ones are aborted
            for gen in gens:
                gen.close()
            raise
        request_id = random_id("cmpl")
        if req.stream:
            return await self._sse(gens[0], lambda out, g: self._completion_chunk(request_id, req, out, g),
                                   lambda g: CompletionResponse(id=request_id, model=self.model_name, choices=[],
                                                                usage=g.usage), req.include_usage)
        choices, usage = [], UsageInfo()
        for i, gen in enumerate(gens):
            try:
                text, token_ids, logprobs, last = await self._collect(gen)
            except BaseException:  # one prompt failed: the others are aborted
                for other in gens:
                    other.close()
                raise
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(self.engine.tokenizer, token_ids, logprobs, req.logprobs)
            choices.append(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=last.finish_reason,
                                            stop_reason=last.stop_reason))
            usage = _add_usage(usage, gen.usage)
        return _json(CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage))

    def _completion_chunk(self, request_id: str, req: CompletionRequest, out: RequestOutput,
                          gen: Generation) -> BaseModel | None:
        c = out.outputs[0]
        lp = None
        if req.logprobs is not None and c.logprobs is not None:  # every token's, also one whose text is held back
            lp = completion_logprobs(self.engine.tokenizer, c.token_ids, c.logprobs, req.logprobs, gen.text_offset)
            gen.text_offset += sum(len(token) for token in lp["tokens"])
        if not c.text and not c.finished() and not (lp and lp["tokens"]):
            return None
        choice = CompletionChoice(index=0, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                                  stop_reason=c.stop_reason)
        return CompletionResponse(id=request_id, model=self.model_name, choices=[choice])

    # ---- chat ------------------------------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        parser, request_id = self.chat_parser(req), random_id("chatcmpl")  # a bad tool_choice: 400 before starting
        params = await self._constrained(req.sampling_params(), req, parser.structured_outputs)
        prompt = await self.loop.call(lambda engine: render_chat(engine, req))
        gen = await self._start(prompt, params, raw)
        num_top = req.top_logprobs or 0
        if req.stream:
            chunk = ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
            return await self._sse(gen, lambda out, g: self._chat_chunk(request_id, req, parser, out),
                                   lambda g: ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                                                 usage=g.usage), req.include_usage, first=chunk)
        text, token_ids, logprobs, last = await self._collect(gen)
        lp = chat_logprobs(self.engine.tokenizer, token_ids, logprobs, num_top) if req.logprobs else None
        message, reason = parser.final(text), parser.finish_reason(last.finish_reason)
        choice = ChatChoice(index=0, message=message, logprobs=lp, finish_reason=reason, stop_reason=last.stop_reason)
        return _json(ChatCompletionResponse(id=request_id, model=self.model_name, choices=[choice], usage=gen.usage))

    def _chat_chunk(self, request_id: str, req: ChatCompletionRequest, parser: ChatOutputParser,
                    out: RequestOutput) -> BaseModel | None:
        c = out.outputs[0]
        delta = parser.delta(c.text, is_last=c.finished())
        lp = None
        if req.logprobs and c.logprobs is not None:  # every token's, also one whose text is held back
            lp = chat_logprobs(self.engine.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
        if delta is None and not c.finished() and not (lp and lp["content"]):
            return None
        choice = ChatStreamChoice(index=0, delta=delta or DeltaMessage(), logprobs=lp,
                                  finish_reason=parser.finish_reason(c.finish_reason))
        return ChatCompletionChunk(id=request_id, model=self.model_name, choices=[choice])

    # ---- shared ----------------------------------------------------------------------------------
    async def _constrained(self, params: SamplingParams, req: SamplingRequest,
                           tool_calls: StructuredOutputsParams | None = None) -> SamplingParams:
        """``params`` with the request's output constraint, compiled on the engine thread (a 400 naming the field
        that set it if it does not compile)."""
        params, field = constrained_params(params, req, tool_calls)
        if field is not None:
            await self.loop.call(lambda engine: check_constraint(engine, params, field))
        return params

    async def _start(self, prompt: PromptType, params: SamplingParams, raw: Request) -> Generation:
        return Generation(self.loop, self.loop.submit(prompt, params), raw)

    @staticmethod
    async def _collect(gen: Generation) -> tuple[str, list[int], list, object]:
        """The request's whole text, tokens, logprobs and last CompletionOutput."""
        texts, token_ids, logprobs = [], [], []
        try:
            while True:
                c = (await gen.next()).outputs[0]
                texts.append(c.text)
                token_ids += c.token_ids
                logprobs += c.logprobs or []
                if c.finished():
                    return "".join(texts), token_ids, logprobs, c
        finally:
            gen.close()

    async def _sse(self, gen: Generation, chunk_of: Callable[[RequestOutput, Generation], BaseModel | None],
                   usage_chunk: Callable[[Generation], BaseModel], include_usage: bool,
                   first: BaseModel | None = None) -> StreamingResponse:
        try:
            out = await gen.next()  # an add-time error (bad prompt) is still an HTTP error, not a stream
        except BaseException:
            gen.close()
            raise

        async def events() -> AsyncIterator[str]:
            current = out
            try:
                if first is not None:
                    yield _event(first)
                while True:
                    chunk = chunk_of(current, gen)
                    if chunk is not None:
                        yield _event(chunk)
                    if current.finished:
                        break
                    current = await gen.next()
                if include_usage:
                    yield _event(usage_chunk(gen))
                yield "data: [DONE]\n\n"
            except ClientDisconnectedError:
                return
            except Exception as e:  # noqa: BLE001 - headers are sent: the error goes into the stream
                yield "data: " + json.dumps({"error": {"message": str(e), "type": type(e).__name__,
                                                       "param": None, "code": 500}}) + "\n\n"
            finally:
                gen.close()  # the client went away (the body iterator is cancelled): abort

        return StreamingResponse(events(), media_type="text/event-stream")


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_unset=False)}\n\n"


def _json(body: BaseModel) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"))


def _add_usage(a: UsageInfo, b: UsageInfo) -> UsageInfo:
    return UsageInfo(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                     completion_tokens=a.completion_tokens + b.completion_tokens,
                     total_tokens=a.total_tokens + b.total_tokens)
