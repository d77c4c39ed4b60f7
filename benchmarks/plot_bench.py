"""Plot the JSON(s) of benchmarks/vs_transformers.py: output tokens/s vs batch size per engine (log y), and
BS=1 decode time per output token next to the roofline.

    python3 benchmarks/plot_bench.py vs_h200.json [more.json ...] --out benchmarks/results/vs_transformers.png
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def plot(reports: list[dict], out: Path) -> None:
    fig, (tput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars: list[tuple[str, float, str]] = []  # (label, ms, color)
    for report in reports:
        tag = report["device"] if len(reports) > 1 else ""
        for name, engine in report["engines"].items():
            rows = [r for r in engine.get("throughput", []) if "output_tok_per_s" in r]
            color = f"C{len(tput.lines)}"
            if rows:
                tput.plot([r["batch_size"] for r in rows], [r["output_tok_per_s"] for r in rows], "o-",
                          color=color, label=f"{name} {tag}".strip())
            if engine.get("bs1_step_s") is not None:
                bars.append((f"{name}\n{tag}".strip(), 1e3 * engine["bs1_step_s"], color))
        roof = min(report["roofline"], key=lambda r: r["batch_size"])
        bars.append((f"roofline\n{tag}".strip(), 1e3 * roof["step_s"], "tab:gray"))
    first = reports[0]
    tput.set(xscale="log", yscale="log", xlabel="batch size", ylabel="output tokens/s",
             title=f"throughput, input {first['input_len']} / output {first['output_len']} tokens")
    tput.set_xticks(first["batch_sizes"], [str(b) for b in first["batch_sizes"]])
    tput.grid(True, which="both", alpha=0.3)
    tput.legend()
    latency.bar(range(len(bars)), [ms for _, ms, _ in bars], color=[c for _, _, c in bars])
    latency.set_xticks(range(len(bars)), [label.replace("_", "\n", 1) for label, _, _ in bars], fontsize=8)
    for i, (_, ms, _) in enumerate(bars):
        latency.annotate(f"{ms:.2f}", (i, ms), ha="center", va="bottom", fontsize=8)
    latency.set(ylabel="ms per output token", title="BS=1 decode step vs memory roofline")
    fig.suptitle(", ".join(sorted({r["device"] for r in reports})) + f" ({first['dtype']})")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path("vs_transformers.png"))
    args = parser.parse_args()
    plot([json.loads(p.read_text()) for p in args.reports], args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
