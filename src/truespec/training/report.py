"""The training report: report.json (every number), report.md (readable), loss_curves.png."""

import json
from pathlib import Path

from .train import TrainLog


def plot_losses(log: TrainLog, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # CPU dev envs may lack matplotlib; the numbers are in report.json anyway
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(log.steps, log.loss, label="target next-token")
    ax.plot(log.steps, log.mtp_loss, label="target MTP next-next-token")
    ax.plot(log.steps, log.draft_loss, label="draft next-token")
    ax.plot(log.val_steps, log.val_loss, "o-", label="target validation (held-apart files)")
    ax.plot(log.val_steps, log.val_draft_loss, "s-", label="draft validation")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_ylim(0, max(4.0, min(8.0, max(log.loss[: max(1, len(log.loss) // 10)] or [4.0]))))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out_dir: Path, report: dict, log: TrainLog) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = ("steps", "loss", "mtp_loss", "draft_loss", "lr", "val_steps", "val_loss", "val_draft_loss")
    report = {**report, "curves": {k: getattr(log, k) for k in keys}}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    plotted = plot_losses(log, out_dir / "loss_curves.png")
    lines = ["# truespec embedded model: training report", ""]
    for section, values in report.items():
        if section == "curves":
            continue
        lines.append(f"## {section}")
        lines += [f"- {k}: {_fmt(v)}" for k, v in values.items()] if isinstance(values, dict) else [f"- {values}"]
        lines.append("")
    if plotted:
        lines += ["![loss curves](loss_curves.png)", ""]
    (out_dir / "report.md").write_text("\n".join(lines), encoding="utf-8")


def _fmt(v: object) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)
