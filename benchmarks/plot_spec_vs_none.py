"""Plot the JSON of benchmarks/spec_vs_none.py: each method's speedup over no speculation per batch size (log x),
with the 1.0x line that no row may fall below.

    python3 benchmarks/plot_spec_vs_none.py benchmarks/results/spec_vs_none_s7_h100.json --out FILE.png
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = json.loads(args.json.read_text())
    results = report["results"]
    base = {int(b): r["tok_s"] for b, r in results["none"].items()}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, by_bs in results.items():
        if name == "none":
            continue
        sizes = sorted(int(b) for b in by_bs)
        ax.plot(sizes, [by_bs[str(b)]["tok_s"] / base[b] for b in sizes], "o-", label=name)
    ax.axhline(1.0, color="gray", linestyle="--", label="no speculation")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (max_num_seqs)")
    ax.set_ylabel("output tok/s vs no speculation")
    ax.set_title(f"{report['device']}: embedded model, bf16, {report['args']['kind']} prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
