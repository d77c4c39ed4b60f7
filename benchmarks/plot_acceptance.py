"""Plot per-position acceptance (k=8) from spec_acceptance.py's JSON: one panel per prompt kind."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str, out: str) -> None:
    runs = json.loads(Path(path).read_text())["runs"]
    kinds = ["edit", "completion", "chat"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, kind in zip(axes, kinds, strict=True):
        for r in runs:
            if r["kind"] == kind and r["k"] == 8:
                rates = [a / max(1, r["num_drafts"]) for a in r["per_pos"]]
                mal = 1 + r["num_accepted_tokens"] / max(1, r["num_drafts"])
                ax.plot(range(1, 9), rates, marker="o", label=f"{r['method']} (mean acc. len {mal:.2f})")
        ax.set_title(f"{kind} prompts, k = 8")
        ax.set_xlabel("draft position")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("acceptance rate")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
