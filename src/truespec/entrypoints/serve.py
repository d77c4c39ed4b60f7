"""``truespec serve [MODEL]``: build the engine, then serve it over HTTP with uvicorn until SIGINT / SIGTERM.

cli.py adds the engine flags and calls ``run_server``; the server's own flags are here. fastapi and uvicorn are
imported only when a server starts, so the other commands do not load them.
"""

import argparse
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from truespec.entrypoints.arg_types import at_least
from truespec.llm import LLM

GRACEFUL_SHUTDOWN_S = 5  # open streams get this long after SIGTERM before the server closes them


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF-format model directory (the same as --model; default: embedded model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    parser.add_argument("--max-waiting-requests", type=at_least(1), default=1024,
                        help="requests waiting for the engine beyond this get HTTP 503")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='parse the tool calls of requests with tools and tool_choice "auto" '
                             "(needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", default=None, help="qwen3_coder | hermes")
    parser.add_argument("--reasoning-parser", default=None, help="qwen3: <think>...</think> -> message.reasoning")


def resolve_model(args: argparse.Namespace) -> str | None:
    """The model directory from ``MODEL`` or ``--model`` (not both)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: MODEL {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag if args.model_tag is not None else args.model


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, object]) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    import uvicorn

    from truespec.entrypoints.chat_parsing import chat_parser_factory
    from truespec.entrypoints.openai_server import build_app

    chat_parser = chat_parser_factory(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    model = resolve_model(args)
    llm = LLM(**(engine_kwargs | {"model": model}))
    name = args.served_model_name or model or "truespec-default"
    root = model or str(Path(llm.llm_engine.config.model))
    app = build_app(llm.llm_engine, name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                    model_root=root, chat_parser=chat_parser)
    with _exit_quietly_after_signals():
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0


class _exit_quietly_after_signals:  # noqa: N801 - used as a context manager
    """uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for the handler that was
    installed before it: a no-op here, so a graceful shutdown exits with code 0 (not -15 or a KeyboardInterrupt)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> None:
        self.saved: dict[int, Callable | int | None] = {}
        if threading.current_thread() is threading.main_thread():
            self.saved = {sig: signal.signal(sig, lambda *_: None) for sig in self.SIGNALS}

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
