"""Byte-level BPE tokenizer (trained with `tokenizers`), its special tokens, chat template and task formats."""

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"  # end of a document / of an edit's updated code; eos
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn; eos
PAD = "<|pad|>"
ORIGINAL = "<|original|>"  # edit task: original code follows
INSTRUCTION = "<|instruction|>"  # edit task: the edit instruction follows
UPDATED = "<|updated|>"  # edit task: the model writes the updated code after this
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD, ORIGINAL, INSTRUCTION, UPDATED]  # ids 0..6

# Qwen2-style split: letters runs, single digits, punctuation runs, newline runs, whitespace runs.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose every byte sequence round-trips (no normalizer, no prefix space)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[1:3] + SPECIAL_TOKENS[4:],
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        chat_template=CHAT_TEMPLATE,
    )


def format_chat(user: str, assistant: str | None = None) -> str:
    """The chat template, rendered without jinja (tests check both agree)."""
    prompt = f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"
    return prompt if assistant is None else f"{prompt}{assistant}{IM_END}\n"


def format_edit(original: str, instruction: str, updated: str | None = None) -> str:
    # the instruction first: reading the original, the model already knows which lines / names will change
    prompt = f"{INSTRUCTION}{instruction}{ORIGINAL}{original}{UPDATED}"
    return prompt if updated is None else f"{prompt}{updated}{ENDOFTEXT}"
