"""Held-out evaluation: loss (nats/token), top-1 accuracies incl. MTP, greedy edit / completion / chat tasks."""

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3ForCausalLM

from .models import MTPHead
from .train import edit_prompt_weights, mtp_logits


@dataclass(frozen=True)
class Prompt:
    kind: str  # "completion" | "edit" | "chat"
    prompt: str  # already formatted (chat through the template)
    reference: str
    signature: str = ""  # completion only: the def line(s) ending the prompt (not written to jsonl)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "prompt": self.prompt, "reference": self.reference})


def write_prompts(prompts: list[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in prompts), encoding="utf-8")


@torch.no_grad()
def heldout_metrics(
    model: Qwen3_5ForCausalLM, mtp: MTPHead, draft: Qwen3ForCausalLM, stream: torch.Tensor, seq_len: int, batch: int,
    mask_edit_prompts: bool = False,
) -> dict[str, float]:
    """Non-overlapping seq_len windows over the held-out stream (documents joined by eos).

    With mask_edit_prompts, the two losses leave out the prompt side of edit tasks (as training does then)."""
    device = model.device
    windows = [stream[i : i + seq_len] for i in range(0, len(stream) - 2, seq_len)]
    windows = [w for w in windows if len(w) >= 3]
    sums = torch.zeros(9, dtype=torch.float64, device=device)
    for i in range(0, len(windows), batch):
        group = windows[i : i + batch]
        length = min(len(w) for w in group)
        ids = torch.stack([w[:length] for w in group]).long().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            hidden = model.model(input_ids=ids).last_hidden_state
            logits = model.lm_head(hidden[:, :-1]).float()
            mtp_out = mtp_logits(model, mtp, ids, hidden)[:, :-1].float()
            draft_logits = draft(input_ids=ids[:, :-1]).logits.float()
        labels, labels2 = ids[:, 1:], ids[:, 2:]
        pred, draft_pred = logits.argmax(-1), draft_logits.argmax(-1)
        w = edit_prompt_weights(ids)[:, 1:].flatten() if mask_edit_prompts else torch.ones_like(labels.flatten())
        sums += torch.stack(
            [
                (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none") * w).sum(),
                (F.cross_entropy(draft_logits.flatten(0, 1), labels.flatten(), reduction="none") * w).sum(),
                (pred == labels).sum(),
                (draft_pred == labels).sum(),
                (draft_pred == pred).sum(),
                torch.tensor(labels.numel(), device=device),
                (mtp_out.argmax(-1) == labels2).sum(),
                torch.tensor(labels2.numel(), device=device),
                w.sum(),
            ]
        ).double()
    loss, dloss, acc, dacc, agree, n, mtp_hits, mtp_n, loss_n = sums.tolist()
    loss_n = max(loss_n, 1.0)
    return {
        "target_loss_nats_per_token": loss / loss_n,
        "draft_loss_nats_per_token": dloss / loss_n,
        "target_top1": acc / n,
        "draft_top1": dacc / n,
        "draft_target_argmax_agreement": agree / n,
        "mtp_top1_next_next": mtp_hits / mtp_n,
        "num_tokens": n,
    }


@torch.no_grad()
def greedy_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    max_new_tokens: int,
    stop_ids: set[int],
    batch_size: int = 256,
) -> list[tuple[list[int], bool]]:
    """Greedy decode with transformers' generate (KV cache + GDN state), left-padded batches of similar length.

    Returns (generated ids without the stop token, whether a stop token ended it) per prompt.
    """
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    results: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    pad = tokenizer.pad_token_id
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[r, width - len(encoded[i]) :] = 1
        out = model.generate(  # in the model's own dtype: the shipped checkpoint is what gets measured
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=sorted(stop_ids), pad_token_id=pad,
        )
        for r, i in enumerate(rows):
            new = out[r, width:].tolist()
            cut = next((j for j, t in enumerate(new) if t in stop_ids), None)
            results[i] = (new, False) if cut is None else (new[:cut], True)
    return results


def complete_function(signature: str, generated: str, stopped: bool) -> str:
    """The dedented function: signature + generated body, cut where a non-blank line comes back to the
    def's indentation or left of it (the function ended)."""
    indent = len(signature) - len(signature.lstrip())
    body: list[str] = []
    ended = stopped
    for line in generated.splitlines(keepends=True):
        if body and line.strip() and len(line) - len(line.lstrip()) <= indent:
            ended = True
            break
        body.append(line)
    if not ended and body and not body[-1].endswith("\n"):
        body.pop()  # the token limit cut the last line
    prefix = signature[:indent]
    lines = (signature + "".join(body)).splitlines(keepends=True)
    return "".join(line[indent:] if line.startswith(prefix) else line for line in lines)


def parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def task_metrics(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[Prompt],
    stop_ids: set[int],
    max_new: int = 512,
) -> tuple[dict[str, float], list[dict]]:
    """Greedy outputs for every held-out prompt; edit exact match, completion/chat parse rates."""
    outputs: dict[int, tuple[list[int], bool]] = {}
    for kind in ("edit", "completion", "chat"):
        idx = [i for i, p in enumerate(prompts) if p.kind == kind]
        if not idx:
            continue
        refs = [len(tokenizer.encode(prompts[i].reference, add_special_tokens=False)) for i in idx]
        budget = min(max_new, max(refs) + 32) if kind == "edit" else max_new
        outs = greedy_generate(model, tokenizer, [prompts[i].prompt for i in idx], budget, stop_ids)
        for i, ref_len, (ids, stopped) in zip(idx, refs, outs, strict=True):
            limit = ref_len + 32 if kind == "edit" else max_new  # edits: stop a run-on copy early
            outputs[i] = (ids[:limit], stopped and len(ids) <= limit)
    samples, hits = [], {"edit": [], "completion": [], "chat": []}
    for i, p in enumerate(prompts):
        ids, stopped = outputs[i]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if p.kind == "edit":
            ok = stopped and text == p.reference
        elif p.kind == "completion":
            ok = parses(complete_function(p.signature, text, stopped))
        else:
            ok = stopped and parses(text)
        hits[p.kind].append(ok)
        samples.append({"kind": p.kind, "ok": ok, "output": text})
    metrics = {
        "edit_exact_match": _mean(hits["edit"]),
        "completion_parse_rate": _mean(hits["completion"]),
        "chat_reply_parse_rate": _mean(hits["chat"]),
        **{f"num_{k}": len(v) for k, v in hits.items()},
    }
    return metrics, samples


def _mean(xs: list[bool]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
