"""Joint training loop: target LM + MTP (next-next-token, shared embed/lm_head) and the draft LM."""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

from .data import BatchSampler
from .models import MTPHead


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int
    time_budget_s: float  # training stops (schedule shortened once, at calibration) to fit this
    lr: float = 3e-3
    draft_lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 60
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    grad_clip: float = 1.0
    warm_steps: int = 4  # the first steps compile/autotune kernels: excluded from the step-time estimate
    calibrate_steps: int = 12
    log_every: int = 10
    num_evals: int = 12  # validation passes over the run; the best one (per model) is kept
    mask_edit_prompts: bool = False  # no loss on the prompt side of edit tasks (original code + instruction)
    keep: str = "best"  # "best": the weights of the best validation pass; "last": the final (annealed) weights

    def __post_init__(self) -> None:
        if self.keep not in ("best", "last"):
            raise ValueError(f"keep must be 'best' or 'last', got {self.keep!r}")


@dataclass
class TrainLog:
    num_steps: int = 0
    num_tokens: int = 0
    train_seconds: float = 0.0
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    mtp_loss: list[float] = field(default_factory=list)
    draft_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_draft_loss: list[float] = field(default_factory=list)
    best_step: int = 0
    best_draft_step: int = 0


def lr_factor(step: int, num_steps: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at num_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, num_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(modules: list[nn.Module], lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = {id(p): p for m in modules for p in m.parameters()}.values()  # tied weights once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in decay)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


EDIT_MARKER_IDS = (0, 4, 5, 6)  # <|endoftext|>, <|original|>, <|instruction|>, <|updated|> (fixed ids)


def edit_prompt_weights(ids: torch.Tensor) -> torch.Tensor:
    """[B, L] float: 0 where token j is on the prompt side of an edit task, else 1.

    An edit task reads ``<|instruction|>{instruction}<|original|>{code}<|updated|>{updated}<|endoftext|>``. Token j
    is prompt-side iff the last marker strictly before it is <|instruction|> or <|original|>: the instruction, the
    original code and the <|original|>/<|updated|> markers themselves. The updated code, its <|endoftext|> and
    everything outside edit tasks (plain files, chat: no markers 4-6) keep weight 1. Before a row's first marker
    (rows start at random offsets), the first marker at or after j decides: <|original|> or <|updated|> means j
    is prompt-side."""
    length = ids.shape[1]
    pos = torch.arange(length, device=ids.device).expand_as(ids)
    is_marker = torch.zeros_like(ids, dtype=torch.bool)
    for m in EDIT_MARKER_IDS:
        is_marker |= ids == m
    last = torch.where(is_marker, pos, -1).cummax(1).values
    last_before = F.pad(last[:, :-1], (1, 0), value=-1)
    prev_tok = ids.gather(1, last_before.clamp(min=0))
    nxt = torch.where(is_marker, pos, length).flip(1).cummin(1).values.flip(1)
    next_tok = ids.gather(1, nxt.clamp(max=length - 1))
    in_prompt = torch.where(
        last_before >= 0, (prev_tok == 4) | (prev_tok == 5), (nxt < length) & ((next_tok == 4) | (next_tok == 6))
    )
    return (~in_prompt).float()


def _ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    if weights is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    w = weights.flatten()
    return (ce * w).sum() / w.sum().clamp(min=1.0)


def target_losses(
    model: Qwen3_5ForCausalLM, mtp: MTPHead, ids: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # (next-token CE, MTP next-next-token CE); weights: [B, L] per token
    hidden = model.model(input_ids=ids).last_hidden_state  # [B, L, H], final-normed
    loss = _ce(model.lm_head(hidden[:, :-1]), ids[:, 1:], None if weights is None else weights[:, 1:])
    return loss, mtp_loss(model, mtp, ids, hidden, weights)


def mtp_logits(model: Qwen3_5ForCausalLM, mtp: MTPHead, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[B, L-1, V]: row t predicts ids[:, t+2] from hidden[:, t] and ids[:, t+1] (RoPE position t)."""
    batch, length = ids.shape
    positions = torch.arange(length - 1, device=ids.device).view(1, 1, -1).expand(3, batch, -1)
    pos_emb = model.model.rotary_emb(hidden, positions)
    out = mtp(model.model.embed_tokens(ids[:, 1:]), hidden[:, :-1], pos_emb)
    return model.lm_head(out)


def mtp_loss(
    model: Qwen3_5ForCausalLM, mtp: MTPHead, ids: torch.Tensor, hidden: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    return _ce(mtp_logits(model, mtp, ids, hidden)[:, :-1], ids[:, 2:], None if weights is None else weights[:, 2:])


def draft_loss(draft: Qwen3ForCausalLM, ids: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    return _ce(draft(input_ids=ids[:, :-1]).logits, ids[:, 1:], None if weights is None else weights[:, 1:])


def _step(opt: torch.optim.Optimizer, loss: torch.Tensor, params: list[nn.Parameter], cfg: TrainConfig) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


ValFn = Callable[[], tuple[float, float]]  # () -> (target val loss, draft val loss)


class BestKeeper:
    """Keeps the parameters of the best validation pass (a copy on the training device)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules, self.best, self.state, self.step = modules, float("inf"), None, 0

    def offer(self, loss: float, step: int) -> None:
        if loss < self.best:
            self.best, self.step = loss, step
            self.state = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in self.modules]

    def restore(self) -> None:
        if self.state is not None:
            for m, state in zip(self.modules, self.state, strict=True):
                m.load_state_dict(state)


def train(
    model: Qwen3_5ForCausalLM,
    mtp: MTPHead,
    draft: Qwen3ForCausalLM,
    sampler: BatchSampler,
    cfg: TrainConfig,
    device: torch.device,
    val_fn: ValFn,
    log: Callable[[str], None] = print,
) -> TrainLog:
    opt = make_optimizer([model, mtp], cfg.lr, cfg.weight_decay)
    draft_opt = make_optimizer([draft], cfg.draft_lr, cfg.weight_decay)
    target_params = [p for g in opt.param_groups for p in g["params"]]
    draft_params = [p for g in draft_opt.param_groups for p in g["params"]]
    bases = [(g, g["lr"]) for o in (opt, draft_opt) for g in o.param_groups]
    best, best_draft = BestKeeper([model, mtp]), BestKeeper([draft])
    out, num_steps, step, warm_time = TrainLog(), cfg.max_steps, 0, 0.0
    sums = torch.zeros(3, device=device)
    for m in (model, mtp, draft):
        m.train()
    start = time.perf_counter()
    while step < num_steps:
        for group, base in bases:
            group["lr"] = base * lr_factor(step, num_steps, cfg)
        ids, boosts = sampler.next_with_boosts()
        ids = ids.to(device, non_blocking=True)
        weights = edit_prompt_weights(ids) if cfg.mask_edit_prompts else None
        if boosts is not None:  # edit-point boosts apply with or without the prompt mask
            boosts = boosts.to(device)
            weights = boosts if weights is None else weights * boosts
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, loss_mtp = target_losses(model, mtp, ids, weights)
        _step(opt, loss + cfg.mtp_weight * loss_mtp, target_params, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss_draft = draft_loss(draft, ids, weights)
        _step(draft_opt, loss_draft, draft_params, cfg)
        sums += torch.stack([loss.detach(), loss_mtp.detach(), loss_draft.detach()])
        step += 1
        out.num_tokens += ids.numel()
        if step == cfg.warm_steps:
            warm_time = _sync_time(device)
            log(f"warm-up ({step} steps, kernel compilation): {warm_time - start:.1f} s")
        if step == cfg.warm_steps + cfg.calibrate_steps:  # fit the schedule to the time budget, once
            now = _sync_time(device)
            per_step = (now - warm_time) / cfg.calibrate_steps * 1.03  # + validation passes
            num_steps = min(num_steps, max(step, step + int((cfg.time_budget_s - (now - start)) / per_step)))
            log(f"calibration: {per_step:.4f} s/step -> {num_steps} steps")
        if step % cfg.log_every == 0 or step == num_steps:
            _record(out, step, sums, bases[0][0]["lr"], log)
        calibrated = step > cfg.warm_steps + cfg.calibrate_steps
        if step == num_steps or (calibrated and step % max(1, num_steps // cfg.num_evals) == 0):
            _validate(out, step, val_fn, best, best_draft, log)
        if step < num_steps and time.perf_counter() - start > 1.1 * cfg.time_budget_s:
            log(f"time budget overrun at step {step}; stopping")
            _validate(out, step, val_fn, best, best_draft, log)
            break
    if cfg.keep == "best":
        best.restore()
        best_draft.restore()
    out.num_steps, out.train_seconds = step, _sync_time(device) - start
    out.best_step, out.best_draft_step = (best.step, best_draft.step) if cfg.keep == "best" else (step, step)
    log(f"kept target from step {out.best_step}, draft from step {out.best_draft_step} (best val: target "
        f"{best.best:.4f} at step {best.step}, draft {best_draft.best:.4f} at step {best_draft.step})")
    return out


def _validate(out: TrainLog, step: int, val_fn: ValFn, best: BestKeeper, best_draft: BestKeeper,
              log: Callable[[str], None]) -> None:
    for m in best.modules + best_draft.modules:
        m.eval()
    val, val_draft = val_fn()
    for m in best.modules + best_draft.modules:
        m.train()
    out.val_steps.append(step)
    out.val_loss.append(val)
    out.val_draft_loss.append(val_draft)
    best.offer(val, step)
    best_draft.offer(val_draft, step)
    log(f"step {step}: val loss {val:.4f} draft {val_draft:.4f}")


def _sync_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _record(out: TrainLog, step: int, sums: torch.Tensor, lr: float, log: Callable[[str], None]) -> None:
    n = step - (out.steps[-1] if out.steps else 0)
    loss, mtp, draft = (sums / n).tolist()
    sums.zero_()
    out.steps.append(step)
    out.loss.append(loss)
    out.mtp_loss.append(mtp)
    out.draft_loss.append(draft)
    out.lr.append(lr)
    log(f"step {step}: loss {loss:.3f} mtp {mtp:.3f} draft {draft:.3f} lr {lr:.2e}")
