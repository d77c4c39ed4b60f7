"""One run, end to end: corpus -> tokenizer -> tasks -> joint training -> evaluation -> assets + report."""

import json
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

from .corpus import collect_corpus
from .data import BatchSampler
from .evaluate import heldout_metrics, task_metrics, write_prompts
from .export import dir_size, save_draft, save_target
from .gdn_kernels import use_fla_kernels
from .models import (
    DRAFT_SIZES,
    SMOKE_DRAFT_SIZES,
    SMOKE_TARGET_SIZES,
    TARGET_SIZES,
    ModelSizes,
    add_dropout,
    build_draft,
    build_target,
    draft_config,
    num_params,
    target_config,
)
from .prep import prepare
from .report import write_report
from .tokenizer import ENDOFTEXT, IM_END, train_tokenizer
from .train import TrainConfig, train

TARGET_DIR_NAME = "stdlib-qwen35"
DRAFT_DIR_NAME = "stdlib-qwen3-draft"


@dataclass(frozen=True)
class RunConfig:
    out: Path
    seed: int = 0
    device: str = "cuda"
    time_budget_s: float = 500.0  # the whole run, preparation and evaluation included
    eval_reserve_s: float = 75.0
    max_steps: int = 2100  # a cap; the shipped run got 1860 steps from the time budget on an H200
    vocab_size: int = 2048
    seq_len: int = 2048
    batch_size: int = 32
    num_edits: int = 200_000
    num_prompts_each: int = 150
    max_new_tokens: int = 320
    dropout: float = 0.1
    max_files: int | None = None
    max_heldout_tokens: int | None = None
    smoke: bool = False
    weights: tuple[tuple[str, float], ...] = (("plain", 0.15), ("edit", 0.75), ("chat", 0.10))
    mask_edit_prompts: bool = True  # no loss on the original code + instruction of edit tasks: all copying
    edit_point_boost: float = 2.0  # loss weight of the edit points of edit tasks (MODEL.md "--edit-point-boost")
    target_sizes: ModelSizes = TARGET_SIZES
    draft_sizes: ModelSizes = DRAFT_SIZES
    keep: str = "last"  # "last": the annealed final weights; "best": the best validation pass


def smoke_config(out: Path, seed: int) -> RunConfig:
    return RunConfig(
        out=out, seed=seed, device="cpu", time_budget_s=60, eval_reserve_s=10, max_steps=3, vocab_size=384,
        seq_len=64, batch_size=4, num_edits=64, num_prompts_each=1, max_new_tokens=4, max_files=24,
        max_heldout_tokens=512, smoke=True,
    )


def run(cfg: RunConfig) -> dict:
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    corpus = collect_corpus(cfg.max_files)
    log(f"corpus: Python {corpus.python_version}, {corpus.num_files_found} .py files under {corpus.stdlib_root}; "
        f"{len(corpus.train)} train / {len(corpus.heldout)} held-out readable files")
    tokenizer = train_tokenizer((f.text for f in corpus.train), cfg.vocab_size)
    log(f"tokenizer: {len(tokenizer)} tokens")
    data = prepare(corpus, tokenizer, cfg.seed, cfg.num_edits, cfg.num_prompts_each, cfg.edit_point_boost)
    log(f"data: {data.counts}")
    write_prompts(data.prompts, cfg.out / "heldout.jsonl")

    target_sizes, draft_sizes = (
        (SMOKE_TARGET_SIZES, SMOKE_DRAFT_SIZES) if cfg.smoke else (cfg.target_sizes, cfg.draft_sizes)
    )
    model, mtp = build_target(target_config(len(tokenizer), target_sizes))
    draft = build_draft(draft_config(len(tokenizer), draft_sizes))
    for m in (model, mtp, draft):
        add_dropout(m, cfg.dropout)
        m.to(device)
    sampler = BatchSampler(
        {k: v.to(device) for k, v in data.streams.items()}, dict(cfg.weights), cfg.seq_len, cfg.batch_size, cfg.seed,
        {k: v.to(device) for k, v in data.boosts.items()},
    )
    gdn_kernel, gdn_errors = use_fla_kernels(device)
    log(f"GDN kernel: {gdn_kernel} {gdn_errors}")
    eval_batch = max(1, cfg.batch_size // 2)

    def val_fn() -> tuple[float, float]:  # selection criterion: plain + edit-task loss on validation files
        losses = [
            heldout_metrics(model, mtp, draft, stream[: cfg.max_heldout_tokens], cfg.seq_len, eval_batch, masked)
            for stream, masked in ((data.val_stream, False), (data.val_edit_stream, cfg.mask_edit_prompts))
        ]
        log("val plain/edit: target {:.4f}/{:.4f} draft {:.4f}/{:.4f}".format(
            *(m[k] for k in ("target_loss_nats_per_token", "draft_loss_nats_per_token") for m in losses)))
        return tuple(sum(m[k] for m in losses) for k in ("target_loss_nats_per_token", "draft_loss_nats_per_token"))

    budget = cfg.time_budget_s - cfg.eval_reserve_s - (time.perf_counter() - start)
    train_cfg = TrainConfig(max_steps=cfg.max_steps, time_budget_s=budget, mask_edit_prompts=cfg.mask_edit_prompts,
                            keep=cfg.keep)
    log(f"training: target {num_params(model)} + mtp {num_params(mtp)} params, draft {num_params(draft)}; "
        f"budget {budget:.0f} s")
    train_log = train(model, mtp, draft, sampler, train_cfg, device, val_fn, log)

    for m in (model, mtp, draft):  # from here on: exactly the shipped bf16 weights
        m.to(torch.bfloat16).eval()
    target_dir, draft_dir = cfg.out / TARGET_DIR_NAME, cfg.out / DRAFT_DIR_NAME
    for d in (target_dir, draft_dir):
        shutil.rmtree(d, ignore_errors=True)
    save_target(model, mtp, tokenizer, target_dir)
    save_draft(draft, tokenizer, draft_dir)
    log(f"saved {target_dir} and {draft_dir}")
    report = {
        "environment": {
            "python": corpus.python_version, "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "seed": cfg.seed, "gdn_kernel": gdn_kernel, "gdn_kernel_rel_err_vs_reference": gdn_errors,
        },
        "corpus": {"stdlib_root": corpus.stdlib_root, "num_py_files_found": corpus.num_files_found, **data.counts},
        "config": {k: str(v) for k, v in asdict(cfg).items()} | {"train": str(train_cfg)},
        "model": {
            "target_params": num_params(model), "mtp_params": num_params(mtp), "draft_params": num_params(draft),
            "target_dir_bytes": dir_size(target_dir), "draft_dir_bytes": dir_size(draft_dir),
        },
        "training": {"num_steps": train_log.num_steps, "num_tokens": train_log.num_tokens,
                     "train_seconds": round(train_log.train_seconds, 1), "kept_target_step": train_log.best_step,
                     "kept_draft_step": train_log.best_draft_step},
    }
    report["heldout"] = heldout_metrics(
        model, mtp, draft, data.heldout_stream[: cfg.max_heldout_tokens], cfg.seq_len, eval_batch
    )
    log(f"held-out: {report['heldout']}")
    write_report(cfg.out / "report", report, train_log)  # rewritten as each stage finishes
    stop_ids = set(tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END]))
    report["tasks_target"], samples = task_metrics(model, tokenizer, data.prompts, stop_ids, cfg.max_new_tokens)
    log(f"tasks (target): {report['tasks_target']}")
    (cfg.out / "report" / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples), "utf-8")
    write_report(cfg.out / "report", report, train_log)
    edit_prompts = [p for p in data.prompts if p.kind == "edit"]
    draft_tasks, _ = task_metrics(draft, tokenizer, edit_prompts, stop_ids, cfg.max_new_tokens)
    report["tasks_draft"] = {"edit_exact_match": draft_tasks["edit_exact_match"]}
    report["time"] = {"total_seconds": round(time.perf_counter() - start, 1)}
    write_report(cfg.out / "report", report, train_log)
    log(f"done: {report['tasks_draft']} {report['time']}")
    return report
