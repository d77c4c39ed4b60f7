"""POST /v1/completions and /v1/chat/completions: a request body -> engine requests -> a JSON body or an SSE stream.

Each prompt is one engine request (a ``Generation``); with ``n`` > 1 its n choices come back as one response's
choices (``index``: prompt i's choice j is i * n + j), or in a stream as chunks whose choice ``index`` says which.
Each chat choice has its own ``ChatOutputParser`` (tool-call / reasoning state). Usage counts the prompt once and
the completion tokens of every choice.
"""

import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from truespec.engine.llm_engine import LLMEngine, PromptType
from truespec.entrypoints.chat_template import render_chat
from truespec.entrypoints.generation import ClientDisconnectedError, Generation, add_usage
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
from truespec.entrypoints.serve_loop import EngineLoop
from truespec.outputs import RequestOutput
from truespec.sampling_params import SamplingParams, StructuredOutputsParams


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
            return await self._sse(gens[0], lambda out, g: self._completion_chunks(request_id, req, out, g),
                                   lambda g: CompletionResponse(id=request_id, model=self.model_name, choices=[],
                                                                usage=g.usage), req.include_usage)
        choices, usage = [], UsageInfo()
        for i, gen in enumerate(gens):
            try:
                collected = await gen.collect(params.n)
            except BaseException:  # one prompt failed: the others are aborted
                for other in gens:
                    other.close()
                raise
            for j, c in enumerate(collected):
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(self.engine.tokenizer, c.token_ids, c.logprobs, req.logprobs)
                choices.append(CompletionChoice(index=i * params.n + j, text=c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            usage = add_usage(usage, gen.usage)
        return _json(CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage))

    def _completion_chunks(self, request_id: str, req: CompletionRequest, out: RequestOutput,
                           gen: Generation) -> list[BaseModel]:
        """One chunk per choice that has something to stream."""
        chunks = []
        for c in out.outputs:
            lp = None
            if req.logprobs is not None and c.logprobs is not None:  # every token's, also one whose text is held
                offset = gen.text_offsets.get(c.index, 0)
                lp = completion_logprobs(self.engine.tokenizer, c.token_ids, c.logprobs, req.logprobs, offset)
                gen.text_offsets[c.index] = offset + sum(len(token) for token in lp["tokens"])
            if not c.text and not c.finished() and not (lp and lp["tokens"]):
                continue
            choice = CompletionChoice(index=c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason)
            chunks.append(CompletionResponse(id=request_id, model=self.model_name, choices=[choice]))
        return chunks

    # ---- chat ------------------------------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        params, request_id = req.sampling_params(), random_id("chatcmpl")
        parsers = [self.chat_parser(req) for _ in range(params.n)]  # a bad tool_choice: 400 before starting
        params = await self._constrained(params, req, parsers[0].structured_outputs)
        prompt = await self.loop.call(lambda engine: render_chat(engine, req))
        gen = await self._start(prompt, params, raw)
        num_top = req.top_logprobs or 0
        if req.stream:
            first = [ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]) for i in range(params.n)]
            return await self._sse(gen, lambda out, g: self._chat_chunks(request_id, req, parsers, out),
                                   lambda g: ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                                                 usage=g.usage), req.include_usage, first=first)
        choices = []
        for i, (c, parser) in enumerate(zip(await gen.collect(params.n), parsers, strict=True)):
            lp = chat_logprobs(self.engine.tokenizer, c.token_ids, c.logprobs, num_top) if req.logprobs else None
            choices.append(ChatChoice(index=i, message=parser.final(c.text), logprobs=lp,
                                      finish_reason=parser.finish_reason(c.finish_reason), stop_reason=c.stop_reason))
        return _json(ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=gen.usage))

    def _chat_chunks(self, request_id: str, req: ChatCompletionRequest, parsers: list[ChatOutputParser],
                     out: RequestOutput) -> list[BaseModel]:
        """One chunk per choice that has something to stream, each through its choice's own parser."""
        chunks = []
        for c in out.outputs:
            parser = parsers[c.index]
            delta = parser.delta(c.text, is_last=c.finished())
            lp = None
            if req.logprobs and c.logprobs is not None:  # every token's, also one whose text is held back
                lp = chat_logprobs(self.engine.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
            if delta is None and not c.finished() and not (lp and lp["content"]):
                continue
            choice = ChatStreamChoice(index=c.index, delta=delta or DeltaMessage(), logprobs=lp,
                                      finish_reason=parser.finish_reason(c.finish_reason))
            chunks.append(ChatCompletionChunk(id=request_id, model=self.model_name, choices=[choice]))
        return chunks

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

    async def _sse(self, gen: Generation, chunks_of: Callable[[RequestOutput, Generation], list[BaseModel]],
                   usage_chunk: Callable[[Generation], BaseModel], include_usage: bool,
                   first: list[BaseModel] | None = None) -> StreamingResponse:
        try:
            out = await gen.next()  # an add-time error (bad prompt) is still an HTTP error, not a stream
        except BaseException:
            gen.close()
            raise

        async def events() -> AsyncIterator[str]:
            current = out
            try:
                for chunk in first or []:
                    yield _event(chunk)
                while True:
                    for chunk in chunks_of(current, gen):
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
