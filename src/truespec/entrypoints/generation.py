"""One engine request as a server handler reads it: its DELTA outputs in order (``Generation``), and the choices they
add up to (``Choice``, one per completion index of a request with ``n`` > 1).

Closing a ``Generation`` before its request finished (the client went away, an error) aborts the request, every
child of an ``n`` > 1 request included, so its blocks and state slots go back to the pools.
"""

import asyncio
from dataclasses import dataclass, field

from fastapi import Request

from truespec.entrypoints.openai_protocol import UsageInfo
from truespec.entrypoints.serve_loop import EngineLoop, RequestStream
from truespec.outputs import CompletionOutput, RequestOutput

DISCONNECT_POLL_S = 1.0  # how often a request waiting for tokens checks that its client is still there


class ClientDisconnectedError(Exception):
    pass


class Generation:
    """One engine request's outputs, as its handler reads them."""

    def __init__(self, loop: EngineLoop, stream: RequestStream, raw: Request) -> None:
        self.loop, self.stream, self.raw = loop, stream, raw
        self.is_finished = False
        self.num_prompt_tokens = self.num_output_tokens = 0  # the prompt once, the output tokens of every choice
        self.text_offsets: dict[int, int] = {}  # completions logprobs: per choice, where its next token's text starts

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
        self.num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
        return out

    async def collect(self, n: int) -> list["Choice"]:
        """Read the request to its end: its ``n`` choices, by index. Closes it (aborts it if it failed)."""
        choices = [Choice() for _ in range(n)]
        try:
            while True:
                out = await self.next()
                for c in out.outputs:
                    choices[c.index].add(c)
                if out.finished:
                    return choices
        finally:
            self.close()

    def close(self) -> None:
        if not self.is_finished:
            self.loop.abort(self.stream)
            self.is_finished = True

    @property
    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_output_tokens,
                         total_tokens=self.num_prompt_tokens + self.num_output_tokens)


@dataclass
class Choice:
    """One completion's whole text, tokens and logprobs, and how it ended."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        """Append a DELTA output of this choice."""
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def add_usage(a: UsageInfo, b: UsageInfo) -> UsageInfo:
    return UsageInfo(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                     completion_tokens=a.completion_tokens + b.completion_tokens,
                     total_tokens=a.total_tokens + b.total_tokens)
