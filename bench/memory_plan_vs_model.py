"""sits_lora.plan_memory against peaks already measured on the GPU by bench_model.py.

    python bench/memory_plan_vs_model.py bench/results/2026-11-30-h200-run3/model_1b.json \
        bench/results/2026-11-30-h200-run4/model_8b_a.json bench/results/2026-11-30-h200-run4/model_8b_b.json \
        --out bench/results/2026-11-30-memory-plan

Runs on a CPU: each eager arm of the given files (sits, sits+gc, peft) is rebuilt on the meta
device exactly as bench_model.py builds it (bf16 weights, no autocast, fused AdamW, bs 4 x 2048),
planned with plan_memory, and compared with the peak torch.cuda.max_memory_allocated measured in
that run. The plan is a function of the model and the batch; only the measured side needs the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_model import build, liger_patch_undone  # noqa: E402
from harness import print_table, write_results  # noqa: E402

PLANNED_ARMS = {"sits": False, "sits+gc": True, "peft": False, "peft+gc": True, "frozen+liger": False,
                "sits+liger": False, "sits+liger+saved": False, "sits+saved": False}
TOLERANCE = 0.15


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    from sits_lora import plan_memory

    rows = []
    for path in args.results:
        data = json.load(open(path))
        for run in data["rows"]:
            if run.get("arm") not in PLANNED_ARMS or run.get("peak_gib") is None:
                continue
            with liger_patch_undone():
                model, params = build(run["model"], run["arm"], "meta", torch.bfloat16, run.get("layers") or 0)
                plan = plan_memory(model, run["batch"], run["seq"], gradient_checkpointing=PLANNED_ARMS[run["arm"]],
                                   optimizer="adamw" if params else "none")
            planned = plan.total / 2**30
            error = planned / run["peak_gib"] - 1
            rows.append({"model": run["model"], "arm": run["arm"], "planned_gib": planned,
                         "measured_gib": run["peak_gib"], "error_pct": 100 * error,
                         "within_15pct": abs(error) <= TOLERANCE, "measured_in": path,
                         "measured_git_revision": data["environment"]["git_revision"]})
            print(f"{run['model']} {run['arm']}: planned {planned:.1f} GiB, measured {run['peak_gib']:.1f} GiB "
                  f"({100 * error:+.1f} %)", flush=True)
    write_results("memory_plan_vs_model", rows, args.out,
                  {"command": "python bench/memory_plan_vs_model.py " + " ".join(argv or sys.argv[1:])})
    print_table(rows, ["model", "arm", "planned_gib", "measured_gib", "error_pct", "within_15pct"])
    return 0 if all(r["within_15pct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
