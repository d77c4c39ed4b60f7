"""A chat request -> its prompt: the tokenizer's chat template (engine thread), and the request checks that keep a
bad request a 400 (strings that are not valid Unicode, template arguments the server sets itself, a template that
raises on the request's messages)."""

from truespec.engine.llm_engine import LLMEngine
from truespec.entrypoints.openai_protocol import ChatCompletionRequest, UnsupportedError


def render_chat(engine: LLMEngine, req: ChatCompletionRequest) -> dict:
    """The chat prompt (engine thread): the tokenizer's chat template, tokenized without adding special tokens
    (the template holds them)."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise UnsupportedError("messages", "this model's tokenizer has no chat template: use /v1/completions")
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:  # the server sets these (a request's own template would run its code: vLLM refuses it too)
        raise UnsupportedError("chat_template_kwargs", f"chat_template_kwargs may not set {reserved}")
    messages = [m.for_template() for m in req.messages]
    check_unicode(messages, "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                                             tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - the template rejected these messages / kwargs: the request's fault
        raise UnsupportedError("messages", f"the chat template failed on this request: {type(e).__name__}: {e}") from e
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


# apply_chat_template arguments the server passes itself, and a template of the request's own
RESERVED_TEMPLATE_KWARGS = {"conversation", "tools", "add_generation_prompt", "tokenize", "chat_template",
                            "return_dict", "return_tensors", "padding", "truncation", "max_length", "documents",
                            "continue_final_message", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def check_unicode(value: object, field: str) -> None:
    """A 400 naming ``field`` if any string in ``value`` (nested lists / dicts) is not valid Unicode (a lone
    surrogate from a JSON escape: no tokenizer can take it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UnsupportedError(field, f"{field} is not valid Unicode: {e.reason} at index {e.start}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(item, f"{field}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_unicode(item, f"{field}[{i}]")
