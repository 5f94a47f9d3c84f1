"""Turn result files into the README's tables and one combined chart.

    python -m bench tools report OUT/results.jsonl --png OUT/steps.png      # the one log every script appends to
    python bench/report.py bench/results/2026-11-30-h200-run3/model_1b.json \
        bench/results/2026-11-30-h200-run4/model_8b_a.json bench/results/2026-11-30-h200-run4/model_8b_b.json \
        --layer bench/results/2026-11-30-h200-run2/layer.json --png bench/results/summary.png

A results.jsonl (bench/harness.py's one schema) may hold rows of many scripts, machines and revisions: the step
table takes the rows with a step time, grouped by machine, revision and model shape.

Rows of one model shape may come from several files (an arm list split over two commands on one
machine at one git revision); ratios use the floor (the faster frozen arm) and the best peer
(the fastest PEFT arm) of that model shape. Nothing here measures: it only divides measured numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import host_share, read_log  # noqa: E402


def _step_rows(path):
    """(group, row) for each row with a step time: a results.jsonl line, or a row of one script's JSON file."""
    if path.endswith(".jsonl"):
        for line in read_log(path):
            row = line["row"]
            if "step_s" in row and "model" in row:
                machine = line["machine"].get("gpu") or line["machine"].get("cpu")
                yield (machine, line["revision"], row["model"]), {**row, "source": path, "git": line["revision"],
                                                                 "machine": machine}
        return
    with open(path) as f:
        data = json.load(f)
    env = data["environment"]
    for row in data["rows"]:
        if "step_s" in row:
            yield (env.get("gpu"), env["git_revision"], row["model"]), {**row, "source": path,
                                                                      "git": env["git_revision"],
                                                                      "machine": env.get("gpu")}


def model_rows(paths):
    """Each step row with its ratios to the floor of its group (one machine, revision and model shape)."""
    by_model = defaultdict(list)
    for path in paths:
        for group, row in _step_rows(path):
            by_model[group].append(row)
    table = []
    for group, rows in by_model.items():
        if not any(r["arm"].startswith("frozen") for r in rows):
            print(f"report: {group}: no frozen arm, no floor: left out", file=sys.stderr)
            continue
        floor = min(r["step_s"] for r in rows if r["arm"].startswith("frozen"))
        floor_mem = min((r["peak_gib"] for r in rows if r["arm"].startswith("frozen") and r.get("peak_gib") is not None),
                        default=None)
        peer = max((r["tokens_per_s"] for r in rows if r["arm"].startswith("peft")), default=None)
        for r in rows:
            table.append({**r, "vs_floor": r["step_s"] / floor, "vs_best_peer": r["tokens_per_s"] / peer if peer else None,
                          "mem_vs_floor": r["peak_gib"] - floor_mem
                          if r.get("peak_gib") is not None and floor_mem is not None else None,
                          "host_share": host_share(r)})
    return table


def _cell(value, form: str) -> str:
    return "" if value is None else format(value, form)


def print_markdown(rows):
    print("| machine | revision | model | arm | tokens/s | step vs floor | host share | vs best PEFT | peak GiB | "
          "peak − floor peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peer = f"{r['vs_best_peer']:.2f}×" if r["vs_best_peer"] else ""
        print(f"| {r['machine'] or ''} | {r['git']} | {r['model']} | {r['arm']} | {r['tokens_per_s']:,.0f} | "
              f"{r['vs_floor']:.3f}× | {_cell(r['host_share'], '.2f')} | {peer} | {_cell(r.get('peak_gib'), '.1f')} | "
              f"{_cell(r['mem_vs_floor'], '+.1f')} |")


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
    """One panel per model shape, a bar per arm (tokens/s), labelled with its ratio to its group's floor; rows
    of several machines or revisions carry them in the bar's name."""
    from matplotlib.figure import Figure

    models = sorted({r["model"] for r in rows})
    fig = Figure(figsize=(6 * len(models), 1.6 + 0.35 * max(sum(r["model"] == m for r in rows) for m in models)))
    for index, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), index + 1)
        rs = sorted((r for r in rows if r["model"] == model), key=lambda r: r["tokens_per_s"])
        several = len({(r["machine"], r["git"]) for r in rs}) > 1
        names = [f"{r['arm']} · {r['machine']} {r['git']}" if several else r["arm"] for r in rs]
        colors = ["#888" if r["arm"].startswith("frozen") else "#4a7" if r["arm"].startswith("sits") else "#c66"
                  for r in rs]
        ax.barh(names, [r["tokens_per_s"] for r in rs], color=colors)
        for i, r in enumerate(rs):
            peak = f", {r['peak_gib']:.0f} GiB" if r.get("peak_gib") is not None else ""
            ax.text(r["tokens_per_s"], i, f" {r['vs_floor']:.2f}× floor{peak}", va="center", fontsize=8)
        machines = sorted({r["machine"] or "?" for r in rs})
        ax.set_title(f"{model} shape, {', '.join(machines)}", fontsize=9)
        ax.set_xlabel("tokens / s (higher is better)")
        ax.set_xlim(0, max(r["tokens_per_s"] for r in rs) * 1.45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_results", nargs="*", help="results.jsonl files, or model-step JSON files of "
                                                           "bench_model.py / regress.py")
    parser.add_argument("--layer", help="a bench_layer.py JSON file: its table")
    parser.add_argument("--png", help="the step chart, one panel per model shape")
    args = parser.parse_args(argv)
    missing = [p for p in args.model_results + ([args.layer] if args.layer else []) if not os.path.isfile(p)]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if args.layer:
        print_layer_markdown(args.layer)
        print()
    if args.model_results:
        try:
            rows = model_rows(args.model_results)
        except ValueError as error:   # a results.jsonl of another schema
            print(f"report: {error}", file=sys.stderr)
            return 2
        if not rows:
            print("report: no step rows with a frozen arm in these files", file=sys.stderr)
            return 1
        print_markdown(rows)
        if args.png:
            plot(rows, args.png)
            print(f"chart: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
