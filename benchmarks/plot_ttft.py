"""Plot the TTFT tables of benchmarks/prefill_ttft.py (its printed output, one file per tree or session): TTFT per
prompt length and batch size, one bar per file, the issue-17 targets as marks.

    python3 benchmarks/plot_ttft.py before.txt:"before" after.txt:"after" --out benchmarks/results/ttft.png
"""

import argparse
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

ROW = re.compile(r"^\|\s*([\d,]+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|")  # | prompt | BS | TTFT ms | ...
TARGETS_MS = {(8192, 1): 40.0, (32768, 1): 250.0}  # issue 17


def read_table(path: Path) -> dict[tuple[int, int], float]:
    """(prompt tokens, batch size) -> TTFT ms from a prefill_ttft.py output."""
    rows = {}
    for line in path.read_text().splitlines():
        if m := ROW.match(line):
            rows[(int(m[1].replace(",", "")), int(m[2]))] = float(m[3])
    return rows


def plot(tables: list[tuple[str, dict]], out: Path) -> None:
    keys = sorted({key for _, table in tables for key in table})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        labels = [label for label, table in tables if key in table]
        values = [table[key] for _, table in tables if key in table]
        ax.bar(range(len(values)), values, color=[f"C{i}" for i in range(len(values))])
        ax.set_xticks(range(len(values)), labels, rotation=20, ha="right", fontsize=8)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
        if key in TARGETS_MS:
            ax.axhline(TARGETS_MS[key], color="k", ls="--", lw=1, label="target")
            ax.legend(fontsize=8)
        ax.set_title(f"{key[0]:,} tokens, BS {key[1]}", fontsize=9)
        ax.set_ylabel("TTFT ms")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", help="FILE:LABEL (prefill_ttft.py's printed output)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tables = []
    for spec in args.tables:
        path, _, label = spec.partition(":")
        tables.append((label or Path(path).stem, read_table(Path(path))))
    plot(tables, Path(args.out))


if __name__ == "__main__":
    main()
