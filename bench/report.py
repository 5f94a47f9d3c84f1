"""Turn result files into the README's tables and one combined chart.

    python bench/report.py bench/results/2026-11-30-h200-run3/model_1b.json \
        bench/results/2026-11-30-h200-run4/model_8b_a.json bench/results/2026-11-30-h200-run4/model_8b_b.json \
        --layer bench/results/2026-11-30-h200-run2/layer.json --png bench/results/summary.png

Rows of one model shape may come from several files (an arm list split over two commands on one
machine at one git revision); ratios use the floor (the faster frozen arm) and the best peer
(the fastest PEFT arm) of that model shape. Nothing here measures: it only divides measured numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def model_rows(paths):
    by_model = defaultdict(list)
    for path in paths:
        data = json.load(open(path))
        for row in data["rows"]:
            if "step_s" in row:
                by_model[row["model"]].append({**row, "source": path, "git": data["environment"]["git_revision"]})
    table = []
    for model, rows in by_model.items():
        floor = min(r["step_s"] for r in rows if r["arm"].startswith("frozen"))
        floor_mem = min(r["peak_gib"] for r in rows if r["arm"].startswith("frozen"))
        peer = max((r["tokens_per_s"] for r in rows if r["arm"].startswith("peft")), default=None)
        for r in rows:
            table.append({**r, "vs_floor": r["step_s"] / floor, "vs_best_peer": r["tokens_per_s"] / peer if peer else None,
                          "mem_vs_floor": r["peak_gib"] - floor_mem})
    return table


def print_markdown(rows):
    print("| model | arm | tokens/s | step vs floor | vs best PEFT | peak GiB | peak − floor peak |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peer = f"{r['vs_best_peer']:.2f}×" if r["vs_best_peer"] else ""
        print(f"| {r['model']} | {r['arm']} | {r['tokens_per_s']:,.0f} | {r['vs_floor']:.3f}× | {peer} | "
              f"{r['peak_gib']:.1f} | {r['mem_vs_floor']:+.1f} |")


def print_layer_markdown(path):
    rows = json.load(open(path))["rows"]
    frozen = {(r["d_in"], r["d_out"], r["r"]): r["full_ms"] for r in rows if r["arm"] == "frozen"}
    print("| d_in × d_out | r | frozen ms | PEFT ms (× frozen) | sits ms (× frozen) |")
    print("|---|---|---|---|---|")
    for key, f in frozen.items():
        arm = {r["arm"]: r["full_ms"] for r in rows if (r["d_in"], r["d_out"], r["r"]) == key}
        sits = arm.get("sits:cublas") or arm.get("sits")
        print(f"| {key[0]} × {key[1]} | {key[2]} | {f:.3f} | {arm['peft']:.3f} ({arm['peft'] / f:.2f}×) | "
              f"{sits:.3f} ({sits / f:.3f}×) |")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = sorted((r for r in rows if r["model"] == model), key=lambda r: r["tokens_per_s"])
        colors = ["#888" if r["arm"].startswith("frozen") else "#4a7" if r["arm"].startswith("sits") else "#c66" for r in rs]
        ax.barh([r["arm"] for r in rs], [r["tokens_per_s"] for r in rs], color=colors)
        for i, r in enumerate(rs):
            ax.text(r["tokens_per_s"], i, f" {r['vs_floor']:.2f}× floor, {r['peak_gib']:.0f} GiB", va="center", fontsize=8)
        ax.set_title(f"Llama-3 {model.upper()} shape, bs 4 × 2048, H200")
        ax.set_xlabel("tokens / s (higher is better)")
        ax.set_xlim(0, max(r["tokens_per_s"] for r in rs) * 1.45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_results", nargs="*")
    parser.add_argument("--layer")
    parser.add_argument("--png")
    args = parser.parse_args(argv)
    if args.layer:
        print_layer_markdown(args.layer)
        print()
    if args.model_results:
        rows = model_rows(args.model_results)
        print_markdown(rows)
        if args.png:
            plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
