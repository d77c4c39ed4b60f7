"""Grammar masks on the logits (structured outputs): a [rows, ceil(vocab / 32)] int32 bitmask whose bit t % 32 of
word t // 32 is set when token t is allowed (xgrammar's layout) sends every other token's logit to -inf, before a
token is sampled or a draft verified, so greedy, random and rejection sampling all see the masked distribution.
An all-ones row changes nothing (``masked_fill`` writes only where a token is disallowed), bit for bit."""

import torch

_BITS = torch.tensor([[(byte >> bit) & 1 for bit in range(8)] for byte in range(256)], dtype=torch.bool)  # [256, 8]
_tables: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [rows, vocab] in place; bitmask [rows, >= ceil(vocab / 32)] int32 on the logits' device."""
    logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool from the packed bitmask: each int32 word read as its 4 bytes, least significant first
    (little-endian, as on x86 and CUDA devices), each byte looked up as its 8 bits (1 byte per token, no int32 temps
    of the vocabulary's size)."""
    table = _tables.get(bitmask.device)
    if table is None:
        table = _tables[bitmask.device] = _BITS.to(bitmask.device)
    words = bitmask.contiguous().view(torch.uint8)  # [rows, 4 * words]
    return table[words.int()].flatten(1)[:, :vocab_size]
