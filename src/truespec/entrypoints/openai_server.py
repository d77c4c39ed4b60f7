"""The OpenAI-compatible HTTP app: routes, API key, and OpenAI-style errors (``{"error": {message, type, param,
code}}``). ``build_app`` takes a built engine; serve.py builds it from the command line and runs uvicorn."""

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from truespec.engine.llm_engine import LLMEngine
from truespec.entrypoints.chat_template import check_unicode, render_chat
from truespec.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnsupportedError,
)
from truespec.entrypoints.openai_serving import ChatOutputParser, OpenAIServing
from truespec.entrypoints.serve_loop import EngineLoop, ServerBusyError
from truespec.entrypoints.server_metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("truespec.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or _ERROR_TYPES.get(status, HTTPStatus(status).phrase.replace(" ", ""))


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              max_waiting_requests: int = 1024, model_root: str | None = None,
              chat_parser: Callable[[ChatCompletionRequest], ChatOutputParser] | None = None) -> FastAPI:
    """The app serving ``engine`` as ``served_model_name``. Its engine thread starts and stops with the app."""
    metrics = ServerMetrics(served_model_name)
    loop = EngineLoop(engine, metrics, max_waiting_requests)
    serving = OpenAIServing(loop, engine, served_model_name, chat_parser or (lambda r: ChatOutputParser()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            loop.shutdown()

    app = FastAPI(title="truespec OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_loop = loop
    _add_error_handlers(app)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(APIError(401, "invalid or missing API key (Authorization: Bearer <key>)"))
        return await call_next(request)

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if loop.is_alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(id=served_model_name, root=model_root, max_model_len=engine.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        return await serving.create_chat_completion(req, raw)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        tokens = await loop.call(lambda e: _tokenize(e, req))
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {engine.vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await loop.call(lambda e: e.tokenizer.decode(req.tokens)))

    return app


def _tokenize(engine: LLMEngine, req: TokenizeRequest) -> list[int]:
    if req.prompt is not None:
        check_unicode(req.prompt, "prompt")
        return engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
    return render_chat(engine, chat)["prompt_token_ids"]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx", {}).get("error", "")
            return _error(APIError(400, f"the request body is not valid JSON: {ctx}".rstrip(": ")))
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid request"))
        return _error(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(ValueError)  # SamplingParams, the prompt (too long, bad ids), UnsupportedError
    async def bad_value(request: Request, e: ValueError) -> JSONResponse:
        return _error(APIError(400, str(e), getattr(e, "param", None) or _param_of(str(e))))

    @app.exception_handler(ServerBusyError)
    async def busy(request: Request, e: ServerBusyError) -> JSONResponse:
        return _error(APIError(503, str(e)))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}"))


def _param_of(message: str) -> str | None:
    """The field a ValueError names: ``SamplingParams.temperature must ...`` -> temperature."""
    head = message.split(" ", 1)[0]
    if head.startswith("SamplingParams."):
        return head.removeprefix("SamplingParams.")
    return "prompt" if message.startswith("prompt") else None


def _error(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}}
    return JSONResponse(body, status_code=e.status)


__all__ = ["APIError", "UnsupportedError", "build_app"]
