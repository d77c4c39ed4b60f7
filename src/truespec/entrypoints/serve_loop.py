"""The server's engine loop: one thread owns the engine and steps it; asyncio handlers talk to it through a queue.

Handlers ``submit`` a request (or ``abort`` it, or ``call`` a function on the engine thread) from the event loop.
The engine thread takes every queued command between steps (so requests that arrive mid-step join the next one),
steps while there is work and hands each request's DELTA outputs to its handler's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``. The engine and its tokenizer are touched only by this thread (LLMEngine is not
thread-safe). A request that fails validation gets its ``ValueError`` back; a step that raises fails the requests
it was running, and the loop goes on.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TypeVar

from truespec.engine.llm_engine import LLMEngine, PromptType
from truespec.entrypoints.openai_protocol import UnsupportedError
from truespec.entrypoints.server_metrics import ServerMetrics
from truespec.outputs import RequestOutput
from truespec.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("truespec.serve")
T = TypeVar("T")


class ServerBusyError(Exception):
    """Too many requests are waiting: the client should retry later (HTTP 503)."""


@dataclass(eq=False)
class RequestStream:
    """One request's outputs as the engine thread hands them out: RequestOutputs, then a finished one, or an
    exception. ``request_id`` is the engine's id, set when the engine thread adds the request."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: str | None = None

    def put(self, item: RequestOutput | BaseException) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self) -> RequestOutput:
        """The next output; raises the request's error."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class _Add:
    prompt: PromptType
    params: SamplingParams
    stream: RequestStream


@dataclass
class _Abort:
    stream: RequestStream


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    future: Future


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting_requests: int = 1024) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet taken by the engine thread
        self._num_engine_waiting = 0  # in the scheduler's waiting queue after the last step
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="truespec-engine", daemon=True)

    # ---- event-loop side -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)  # wakes a thread waiting for work
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt: PromptType, params: SamplingParams) -> RequestStream:
        """Queue a request; its DELTA outputs arrive on the returned stream. Each of its ``n`` sequences counts as a
        waiting request: ServerBusyError when they would pass ``max_waiting_requests``, a ValueError naming ``n``
        when they could never fit."""
        if params.n > self.max_waiting_requests:
            raise UnsupportedError("n", f"n={params.n} is more than this server queues at once "
                                        f"(--max-waiting-requests {self.max_waiting_requests})")
        with self._lock:
            if self._num_queued + self._num_engine_waiting + params.n > self.max_waiting_requests:
                raise ServerBusyError(f"{self.max_waiting_requests} requests are already waiting; retry later")
            self._num_queued += params.n
        stream = RequestStream(asyncio.get_running_loop())
        self._commands.put(_Add(prompt, replace(params, output_kind=RequestOutputKind.DELTA), stream))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort the request (a client that went away): its blocks and state slots go back to the pools."""
        self._commands.put(_Abort(stream))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` run on the engine thread between steps (the tokenizer lives there too)."""
        future: Future = Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._take_commands(block=not self.engine.has_unfinished_requests())
            if self._stopping.is_set() or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the server keeps serving; the step's requests fail
                logger.exception("engine step failed: failing the running requests")
                self._fail_all(e)
                outputs = []
            for out in outputs:
                self._deliver(out)
            self._publish_stats()
        self._fail_all(RuntimeError("the server is shutting down"))

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        self._publish_stats()

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            request_id = command.stream.request_id
            if request_id is not None and self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                self.metrics.forget(request_id)
        elif command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                command.future.set_exception(e)

    def _add(self, command: _Add) -> None:
        with self._lock:
            self._num_queued -= command.params.n
        try:
            request = self.engine.make_request(command.prompt, command.params)
            self.engine.add(request)
        except Exception as e:  # noqa: BLE001 - ValueError: bad input (HTTP 400); anything else fails it alone
            command.stream.put(e)
            return
        command.stream.request_id = request.request_id
        self._streams[request.request_id] = command.stream

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:  # aborted while its step ran
            return
        self.metrics.observe_output(out)
        if out.finished:
            del self._streams[out.request_id]
        stream.put(out)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            self.metrics.forget(request_id)
            stream.put(error)
        self._streams.clear()

    def _publish_stats(self) -> None:
        scheduler = self.engine.scheduler
        with self._lock:
            self._num_engine_waiting = len(scheduler.waiting)
        info = self.engine.cache_info()
        self.metrics.set_engine_stats(len(scheduler.running), len(scheduler.waiting) + self._num_queued,
                                      1.0 - info["num_free_blocks"] / max(info["num_blocks"], 1),
                                      self.engine.get_metrics())
