"""Plot the benchmark results written with ``--json`` into one PNG (the figure of docs/benchmarks.md).

    python bench/step_throughput.py --json bench/results/step_throughput.json
    python bench/overhead.py --json bench/results/overhead.json
    python bench/vs_trl.py --max-new-tokens 128 --prompts 16 --n 8 --json bench/results/vs_trl.json
    python bench/plot_results.py                      # -> docs/benchmarks.png

One panel per result file found: tokens/s of each side of the step benchmark (with MFU), the median
step time of the Trainer against the hand-written loop, and the time per GRPO step of ours against
TRL by phase. A missing file leaves its panel out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
OURS, BASE = "#1f77b4", "#bbbbbb"


def bars(ax, labels: list[str], values: list[float], colors: list[str], fmt: str) -> None:
    rects = ax.bar(labels, values, color=colors)
    for rect, value in zip(rects, values):
        ax.annotate(fmt.format(value), (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                    ha="center", va="bottom", fontsize=8)


def panel_throughput(ax, r: dict) -> None:
    sides = r["sides"]
    names = list(sides)
    bars(ax, [n.replace("padded ", "padded\n") for n in names], [sides[n]["tokens_per_s"] for n in names],
         [OURS if n == "ours" else BASE for n in names], "{:.0f}")
    mfu = sides["ours"]["mfu_fp32" if r["dtype"] == "fp32" else "mfu_bf16"]
    ax.set_title(f"training step, {r['tokens']} tokens ({r['dtype']}, {r['device']})\n"
                 f"ours {r['ratio_vs_safe']:.2f}x vs {r['safe_baseline']}; our MFU {mfu:.0%}", fontsize=9)
    ax.set_ylabel("tokens / s (higher is better)")


def panel_overhead(ax, r: dict) -> None:
    med = r["median_s"]
    names = list(med)
    bars(ax, names, [med[n] for n in names], [OURS if n == "Trainer" else BASE for n in names], "{:.2f} s")
    ax.set_title(f"Trainer vs hand-written loop\noverhead {r['overhead']:+.1%} (target <= 5%)", fontsize=9)
    ax.set_ylabel("median step time, s (lower is better)")


def panel_trl(ax, r: dict) -> None:
    phases = list(r["phases"])
    x = range(len(phases))
    w = 0.38
    ours = [r["phases"][p]["ours"] for p in phases]
    trl = [r["phases"][p]["trl"] for p in phases]
    ax.bar([i - w / 2 for i in x], ours, w, color=OURS, label="ours")
    ax.bar([i + w / 2 for i in x], trl, w, color=BASE, label="TRL GRPOTrainer")
    for i, p in enumerate(phases):
        ratio = r["phases"][p]["trl"] / r["phases"][p]["ours"]
        ax.annotate(f"{ratio:.2f}x", (i, max(ours[i], trl[i])), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), phases)
    ax.set_title("GRPO step vs TRL, lengths 1-128 (same model, prompts, reward, lengths)\n"
                 "trl time / our time per phase",
                 fontsize=9)
    ax.set_ylabel("median time, s (lower is better)")
    ax.legend(fontsize=8)


PANELS = (("step_throughput.json", panel_throughput), ("overhead.json", panel_overhead),
          ("vs_trl.json", panel_trl))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs" / "benchmarks.png")
    args = p.parse_args()
    files = [(args.results / name, fn) for name, fn in PANELS]
    found = [(json.loads(path.read_text()), fn) for path, fn in files if path.exists()]
    if not found:
        raise SystemExit(f"no result files in {args.results}; run the benchmarks with --json first")
    fig, axes = plt.subplots(1, len(found), figsize=(4.6 * len(found), 4.2), squeeze=False)
    for ax, (result, fn) in zip(axes[0], found):
        fn(ax, result)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
