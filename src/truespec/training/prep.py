"""CPU-side preparation, parallel over processes: functions, edit tasks, held-out prompts, token streams."""

import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

from .corpus import Corpus, SourceFile
from .data import encode_documents, encode_with_boosts, join
from .evaluate import Prompt, complete_function, parses
from .tasks import (
    Completion,
    EditTask,
    Function,
    changed_spans,
    chat_pairs,
    edit_pools,
    extract_completions,
    extract_functions,
    make_edit_tasks,
)
from .tokenizer import ENDOFTEXT, format_chat, format_edit

_FILES: list[SourceFile] = []  # inherited by forked workers instead of being pickled per task
_POOLS: tuple[list[str], list[str]] = ([], [])


@dataclass
class PreparedData:
    streams: dict[str, torch.Tensor]  # "plain" | "edit" | "chat" -> joined token ids
    boosts: dict[str, torch.Tensor]  # "edit" -> per-token loss multiplier (``edit_point_boost`` != 1 only)
    val_stream: torch.Tensor  # validation files (checkpoint selection)
    val_edit_stream: torch.Tensor  # edit tasks on validation files (checkpoint selection: copying)
    heldout_stream: torch.Tensor  # held-out files (final numbers only)
    prompts: list[Prompt]
    counts: dict[str, int]


def _completions(index: int) -> list[Completion]:
    return extract_completions(_FILES[index])


def _functions(args: tuple[int, bool]) -> list[Function]:
    index, documented_only = args
    return extract_functions(_FILES[index], documented_only)


def _edits(args: tuple[int, int, int]) -> list[tuple[EditTask, list[tuple[int, int]]]]:
    chunk, num, seed = args
    tasks = make_edit_tasks(_FILES, num, random.Random(seed * 100_003 + chunk), *_POOLS, augment=True)
    return [(t, changed_spans(t.original, t.updated)) for t in tasks]


def _pool(num_workers: int) -> ProcessPoolExecutor:
    import multiprocessing as mp

    return ProcessPoolExecutor(num_workers, mp_context=mp.get_context("fork"))


def parallel_functions(files: list[SourceFile], documented_only: bool, workers: int) -> list[Function]:
    global _FILES
    _FILES = files
    with _pool(workers) as ex:
        parts = ex.map(_functions, [(i, documented_only) for i in range(len(files))], chunksize=8)
        return [fn for part in parts for fn in part]


def parallel_edits(
    files: list[SourceFile], num: int, seed: int, workers: int
) -> list[tuple[EditTask, list[tuple[int, int]]]]:
    """Edit tasks with their edit points (``changed_spans`` of the updated code). Deterministic for a given seed:
    fixed chunks, each with its own derived RNG, gathered in order."""
    global _FILES, _POOLS
    _FILES, _POOLS = files, edit_pools(files, random.Random(seed))
    num_chunks = 64
    with _pool(workers) as ex:
        parts = ex.map(_edits, [(c, -(-num // num_chunks), seed) for c in range(num_chunks)])
        return [t for part in parts for t in part][:num]


def heldout_prompts(corpus: Corpus, seed: int, num_each: int, workers: int) -> list[Prompt]:
    """Completion (file context + signature -> body), edit and chat prompts from held-out files only."""
    global _FILES
    rng = random.Random(seed + 1)
    _FILES = corpus.heldout
    with _pool(workers) as ex:
        completions = [c for part in ex.map(_completions, range(len(_FILES))) for c in part]
    completions = [c for c in completions if parses(complete_function(c.signature, c.body, True))]
    rng.shuffle(completions)
    completion = [Prompt("completion", c.context + c.signature, c.body, c.signature) for c in completions[:num_each]]
    fns = [f for f in parallel_functions(corpus.heldout, True, workers) if len(f.body) <= 1200]
    rng.shuffle(fns)
    chats = [Prompt("chat", format_chat(doc), fn) for doc, fn in chat_pairs(fns)[: num_each * 2 // 3]]
    names, lines = edit_pools(corpus.heldout, rng)
    edits = [
        Prompt("edit", format_edit(t.original, t.instruction), t.updated)
        for t in make_edit_tasks(corpus.heldout, num_each, rng, names, lines)
    ]
    seen: set[str] = set()
    return [p for p in completion + edits + chats if not (p.prompt in seen or seen.add(p.prompt))]


def prepare(
    corpus: Corpus, tokenizer: PreTrainedTokenizerFast, seed: int, num_edits: int, num_prompts_each: int,
    edit_point_boost: float = 1.0,
) -> PreparedData:
    workers = min(16, os.cpu_count() or 1)
    eos = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    documented = parallel_functions(corpus.train, True, workers)
    chats = [format_chat(u, a) for u, a in chat_pairs(documented)]
    edits, edit_spans = [], []
    for t, spans in parallel_edits(corpus.train, num_edits, seed, workers):
        edits.append(format_edit(t.original, t.instruction, t.updated))
        offset = len(edits[-1]) - len(t.updated) - len(ENDOFTEXT)  # where the updated code starts
        edit_spans.append([(a + offset, b + offset) for a, b in spans])
    if edit_point_boost == 1.0:  # no boost: skip the per-token pass over ~45 M edit tokens (~50 s)
        edit_ids, edit_boosts = encode_documents(tokenizer, edits, None), None
    else:
        edit_ids, edit_boosts = encode_with_boosts(tokenizer, edits, edit_spans, edit_point_boost)
    rng = random.Random(seed + 2)
    rng.shuffle(chats)
    plain_files = list(corpus.train)
    rng.shuffle(plain_files)
    prompts = heldout_prompts(corpus, seed, num_prompts_each, workers)
    streams = {
        "plain": join(encode_documents(tokenizer, [f.text for f in plain_files], eos)),
        "edit": join(edit_ids),  # formatted edits already end with eos
        "chat": join(encode_documents(tokenizer, chats, eos)),
    }
    val = join(encode_documents(tokenizer, [f.text for f in corpus.val], eos))
    val_names, val_lines = edit_pools(corpus.val, random.Random(seed + 3))
    val_edits = [format_edit(t.original, t.instruction, t.updated)
                 for t in make_edit_tasks(corpus.val, 600, random.Random(seed + 3), val_names, val_lines)]
    val_edit = join(encode_documents(tokenizer, val_edits, None))
    heldout = join(encode_documents(tokenizer, [f.text for f in corpus.heldout], eos))
    counts = {
        "num_train_files": len(corpus.train),
        "num_val_files": len(corpus.val),
        "num_heldout_files": len(corpus.heldout),
        "num_edit_tasks": len(edits),
        "num_chat_examples": len(chats),
        **{f"num_{k}_tokens": len(v) for k, v in streams.items()},
        "num_val_tokens": len(val),
        "num_val_edit_tokens": len(val_edit),
        "num_heldout_tokens": len(heldout),
    }
    boosts = {} if edit_boosts is None else {
        "edit": torch.tensor([b for doc in edit_boosts for b in doc], dtype=torch.float16)}
    return PreparedData(streams, boosts, val, val_edit, heldout, prompts, counts)
