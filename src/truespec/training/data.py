"""Token streams (documents joined by eos) and the seeded sampler that mixes them into training batches."""

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str], eos_id: int | None) -> list[list[int]]:
    """Token ids of each text (special-token strings in it become special tokens), eos appended if given."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    tail = [] if eos_id is None else [eos_id]
    return [e.ids + tail for e in encodings]


def join(docs: list[list[int]]) -> torch.Tensor:
    return torch.tensor([t for doc in docs for t in doc], dtype=torch.int32)


def encode_with_boosts(
    tokenizer: PreTrainedTokenizerFast, texts: list[str], spans: list[list[tuple[int, int]]], boost: float
) -> tuple[list[list[int]], list[list[float]]]:
    """Token ids of each text and a per-token loss multiplier: ``boost`` for tokens overlapping one of the text's
    character ``spans``, else 1 (edit tasks: their edit points; training/tasks.py ``changed_spans``)."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    boosts = []
    for enc, text_spans in zip(encodings, spans, strict=True):
        boosts.append([boost if any(a < end and start < b for a, b in text_spans) else 1.0
                       for start, end in enc.offsets])
    return [e.ids for e in encodings], boosts


@dataclass
class BatchSampler:
    """Each row is a window of `seq_len` tokens at a random offset of one stream, the stream drawn by weight."""

    streams: dict[str, torch.Tensor]  # name -> [num_tokens] int32 (on the training device)
    weights: dict[str, float]
    seq_len: int
    batch_size: int
    seed: int
    boosts: dict[str, torch.Tensor] | None = None  # name -> [num_tokens] per-token loss multiplier (default 1)

    def __post_init__(self) -> None:
        self.names = sorted(self.streams)
        self.gen = torch.Generator().manual_seed(self.seed)
        self.probs = torch.tensor([self.weights[n] for n in self.names], dtype=torch.float64)
        self.offsets = torch.arange(self.seq_len)

    def next(self) -> torch.Tensor:  # [batch_size, seq_len] int64
        return self.next_with_boosts()[0]

    def next_with_boosts(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[batch_size, seq_len] token ids (int64) and the per-token loss multipliers of the same windows
        (None when no stream has boosts)."""
        which = torch.multinomial(self.probs, self.batch_size, replacement=True, generator=self.gen)
        rows, boosts = [], []
        for i, name in enumerate(self.names):
            n = int((which == i).sum())
            if n == 0:
                continue
            stream = self.streams[name]
            starts = torch.randint(0, len(stream) - self.seq_len, (n,), generator=self.gen)
            index = (starts[:, None] + self.offsets).to(stream.device)
            rows.append(stream[index])
            if self.boosts:
                boost = self.boosts.get(name)
                boosts.append(torch.ones(index.shape, device=stream.device) if boost is None else boost[index].float())
        return torch.cat(rows).long(), torch.cat(boosts) if self.boosts else None
