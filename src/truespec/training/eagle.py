"""Train an EAGLE draft head for a frozen target (the embedded model), reproducibly from one command:

    python -m truespec.training.eagle --target src/truespec/assets/stdlib-qwen35 \
        --out src/truespec/assets/stdlib-eagle --report src/truespec/training/report/eagle_report.json

The head (``truespec.models.eagle``) reads the target's final-normed hidden state h_t and the embedding of
x_{t+1}, runs one Qwen3 decoder layer and the target's lm_head to predict x_{t+2}. It trains on the same
mix as the target (plain files, edit tasks, chat; held-out files never seen), with the target frozen.
"""

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from truespec.models.eagle import save_eagle_head

from .corpus import collect_corpus
from .data import BatchSampler
from .gdn_kernels import use_fla_kernels
from .prep import prepare


class EagleTrainHead(nn.Module):
    """transformers' Qwen3 layer under the parameter names of ``truespec.models.eagle.EagleHead``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, 0)])
        self.norm = Qwen3RMSNorm(h, config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # emb_next, hidden: [B, L, H]; position_ids: [B, L] -> [B, L, H] (causal attention: no mask)
        x = self.fc(torch.cat([emb_next, hidden], dim=-1))
        x = self.layers[0](x, attention_mask=None, position_ids=position_ids,
                           position_embeddings=self.rotary(x, position_ids))
        return self.norm(x[0] if isinstance(x, tuple) else x)


def head_config(target_config: object, intermediate_size: int, num_heads: int | None = None,
                num_kv_heads: int | None = None) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=1, num_attention_heads=num_heads or target_config.num_attention_heads,
        num_key_value_heads=num_kv_heads or target_config.num_key_value_heads, head_dim=target_config.head_dim,
        max_position_embeddings=target_config.max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return config


def eagle_loss(target: nn.Module, head: EagleTrainHead, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of x_{t+2} and top-1 accuracy, for ids [B, L]."""
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state  # [B, L, H], final-normed
        emb = target.model.embed_tokens(ids)
    positions = torch.arange(ids.shape[1] - 2, device=ids.device).expand(ids.shape[0], -1)
    out = head(emb[:, 1:-1], hidden[:, :-2], positions)
    logits = target.lm_head(out).float()
    labels = ids[:, 2:]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return loss, (logits.argmax(-1) == labels).float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget-s", type=float, default=150)
    # sizes: the head must fit the 16 MiB asset budget beside the target and draft (~0.8 MB left): ~376k params
    parser.add_argument("--intermediate-size", type=int, default=192)
    parser.add_argument("--num-attention-heads", type=int, default=2)
    parser.add_argument("--num-key-value-heads", type=int, default=1)
    parser.add_argument("--report", type=Path, default=None, help="training report JSON (default: beside the head)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-files", type=int, default=None, help="(smoke runs) use only this many files")
    parser.add_argument("--num-edits", type=int, default=150_000)
    args = parser.parse_args()
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.target))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 matmuls need autocast (CUDA)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=dtype).to(device).eval()
    target.requires_grad_(False)
    log(f"GDN kernel: {use_fla_kernels(device)[0]}")
    corpus = collect_corpus(args.max_files)
    data = prepare(corpus, tokenizer, args.seed, args.num_edits, 1)
    log(f"data: {data.counts}")
    weights = {"plain": 0.35, "edit": 0.55, "chat": 0.10}
    sampler = BatchSampler({k: v.to(device) for k, v in data.streams.items()}, weights, args.seq_len,
                           args.batch_size, args.seed)
    config = head_config(target.config, args.intermediate_size, args.num_attention_heads, args.num_key_value_heads)
    head = EagleTrainHead(config).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    budget = args.time_budget_s - (time.perf_counter() - start)
    t0, step, history = time.perf_counter(), 0, []
    while time.perf_counter() - t0 < budget:
        frac = min(1.0, (time.perf_counter() - t0) / budget)
        for group in opt.param_groups:  # warmup then cosine over the time budget
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, acc = eagle_loss(target, head, sampler.next())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            history.append({"step": step, "loss": float(loss), "top1": float(acc)})
            log(f"step {step}: loss {float(loss):.3f} top1 {float(acc):.3f}")
    head.eval()
    heldout = data.heldout_stream[: 64 * args.seq_len].to(device)
    rows = heldout[: len(heldout) // args.seq_len * args.seq_len].view(-1, args.seq_len).long()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        results = [eagle_loss(target, head, rows[i:i + 8]) for i in range(0, len(rows), 8)]
    report = {"steps": step, "train_seconds": round(time.perf_counter() - t0, 1),
              "heldout_loss": sum(float(r[0]) for r in results) / len(results),
              "heldout_top1_next_next": sum(float(r[1]) for r in results) / len(results),
              "params": sum(p.numel() for p in head.parameters()), "history": history,
              "python": corpus.python_version, "seed": args.seed,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    log(f"held-out: loss {report['heldout_loss']:.3f} top1 {report['heldout_top1_next_next']:.3f}")
    save_eagle_head(args.out, config, {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")})
    (args.report or args.out / "training_report.json").write_text(json.dumps(report, indent=1))
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
