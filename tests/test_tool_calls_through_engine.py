"""Tool-call streaming with a scripted token source: a fixed model output (reasoning, then tool calls), tokenized by
the embedded model's tokenizer, fed through the engine's real OutputProcessor (stop checker + incremental
detokenizer, DELTA outputs as the server asks for them) k tokens per step as a speculative step emits them, then
through the server's chat parser as ``OpenAIServing._chat_chunk`` does. The streamed deltas add up to the message
the non-streamed response returns, for every step size, and the response finishes with "tool_calls"."""

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from transformers import AutoConfig, PreTrainedTokenizerBase

from truespec.assets import DEFAULT_MODEL_DIR
from truespec.core.sequence import Sequence, SequenceStatus
from truespec.engine.output_processor import OutputProcessor
from truespec.engine.stop_checker import StopChecker
from truespec.entrypoints.chat_parsing import chat_parser_factory
from truespec.entrypoints.openai_protocol import ChatCompletionRequest
from truespec.entrypoints.openai_serving import ChatOutputParser
from truespec.sampling_params import RequestOutputKind, SamplingParams
from truespec.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
# the characters after "note" span several byte-level tokens: the detokenizer holds them back mid-character
QWEN3 = ("<think>\nThe user wants a sum.\n</think>\n\nLet me add.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n"
         "</parameter>\n<parameter=b>\n3.5\n</parameter>\n<parameter=note>\nx < y ≤ z 😀\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>")
HERMES = ('<think>plan é</think>Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "note": "€😀"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
CASES = {"qwen3_coder": QWEN3, "hermes": HERMES}
EXPECTED_CALLS = {"qwen3_coder": [("add", {"a": 2, "b": 3.5, "note": "x < y ≤ z 😀"}), ("now", {})],
                  "hermes": [("add", {"a": 1, "note": "€😀"}), ("now", {})]}
EXPECTED_REASONING = {"qwen3_coder": "\nThe user wants a sum.\n", "hermes": "plan é"}
IM_END = "<|im_end|>"  # the chat model's end of turn: one of the embedded model's EOS tokens


@dataclass
class Message:
    """A chat message as a client sees it: the streamed deltas added up, or the non-streamed message."""

    content: str = ""
    reasoning: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    finish_reason: str | None = None

    def add(self, delta: Any) -> None:  # a DeltaMessage
        self.content += delta.content or ""
        self.reasoning += delta.reasoning or ""
        assert delta.reasoning == delta.reasoning_content
        for call in delta.tool_calls or []:
            entry = self.calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            assert not (entry["id"] and call["id"]), "a call's id comes in its first delta only"
            entry["id"] += call["id"] or ""
            entry["name"] += call["function"]["name"] or ""
            entry["arguments"] += call["function"]["arguments"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(str(DEFAULT_MODEL_DIR))


@pytest.fixture(scope="module")
def stop_checker(tokenizer: PreTrainedTokenizerBase) -> StopChecker:
    return StopChecker(tokenizer, AutoConfig.from_pretrained(DEFAULT_MODEL_DIR), str(DEFAULT_MODEL_DIR))


def _request() -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "add 2 and 3.5"}], tools=TOOLS,
                                 tool_choice="auto")


def _stream(processor: OutputProcessor, parser: ChatOutputParser, token_ids: list[int], steps: list[int],
            max_tokens: int) -> tuple[Message, list[str]]:
    """Feed ``token_ids`` ``steps[i]`` tokens at a time as engine steps; the added-up stream and the DELTA texts
    (the server's non-streaming path joins the same texts into the whole output)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    seq = Sequence("0", None, [1, 2, 3], params, max_output_len=max_tokens)
    message, texts, start = Message(), [], 0
    for size in steps:
        reason = processor.process(seq, token_ids[start:start + size], None)
        start += size
        if reason is not None:  # what Scheduler.finish does to a stopped request
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        out = processor.make_output(seq)
        c = out.outputs[0]
        texts.append(c.text)
        delta = parser.delta(c.text, is_last=c.finished())  # as OpenAIServing._chat_chunk
        if delta is not None:
            message.add(delta)
        if out.finished:
            message.finish_reason = parser.finish_reason(c.finish_reason)
            assert start >= len(token_ids) or reason == "length"
            return message, texts
    raise AssertionError("the scripted output never finished")


def _at_once(parser: ChatOutputParser, text: str, reason: str) -> Message:
    message = Message()
    final = parser.final(text)
    assert final.role == "assistant"
    message.add(final)
    message.finish_reason = parser.finish_reason(reason)
    return message


def _steps(num_tokens: int, k: int | None, seed: int) -> list[int]:
    """Step sizes: k every step, or (k None) seeded random sizes in 1..5 as a speculative engine mixes them."""
    rng = random.Random(seed)
    return [k or rng.randint(1, 5) for _ in range(num_tokens)]


@pytest.mark.parametrize("ending", ["eos", "length", "cut_mid_tag"])
@pytest.mark.parametrize("parser_name", list(CASES))
def test_streamed_tool_calls_through_the_output_processor_add_up_to_the_message(
        tokenizer: PreTrainedTokenizerBase, stop_checker: StopChecker, parser_name: str, ending: str) -> None:
    """``eos``: the model ends its turn with <|im_end|> (finish "stop"); ``length``: max_tokens cuts it right after
    the last call; ``cut_mid_tag``: max_tokens cuts it inside the last ``</tool_call>`` (the parsers' held text is
    flushed by the last delta). Whenever a call was made the response finishes with "tool_calls"."""
    token_ids = tokenizer.encode(CASES[parser_name], add_special_tokens=False)
    assert tokenizer.decode(token_ids) == CASES[parser_name]
    if ending == "cut_mid_tag":
        token_ids = token_ids[:-3]
    text = tokenizer.decode(token_ids)
    if ending == "eos":
        token_ids += tokenizer.encode(IM_END, add_special_tokens=False)
        assert token_ids[-1] in stop_checker.eos_token_ids
    max_tokens = len(token_ids) + 10 if ending == "eos" else len(token_ids)
    make = chat_parser_factory(parser_name, "qwen3", enable_auto_tool_choice=True)
    reason = "stop" if ending == "eos" else "length"
    expected = _at_once(make(_request()), text, reason)
    assert expected.reasoning == EXPECTED_REASONING[parser_name] and expected.finish_reason == "tool_calls"
    if ending != "cut_mid_tag":
        calls = [(c["name"], json.loads(c["arguments"])) for c in expected.calls.values()]
        assert calls == EXPECTED_CALLS[parser_name]
    for k, seed in [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (None, 1), (None, 2), (None, 3)]:
        processor = OutputProcessor(tokenizer, stop_checker)
        streamed, texts = _stream(processor, make(_request()), token_ids, _steps(len(token_ids), k, seed), max_tokens)
        assert "".join(texts) == text, k  # the DELTA texts join to the output, without the EOS token
        assert k != 1 or "" in texts[:-1], "a step that ends mid-character hands out no text"
        assert streamed == expected, (k, seed)
