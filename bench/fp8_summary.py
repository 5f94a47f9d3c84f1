"""Read the fp8 run's result files and print them against issue 6's targets; write fp8_summary.json.

    python bench/fp8_summary.py bench/results/fp8

Targets (H200): whole-model step with fp8="hybrid" <= 0.80x the bf16 frozen floor (the faster of
eager and compiled frozen, same run) on the 8B shape; frozen-weight memory <= 0.55x bf16.
"""

from __future__ import annotations

import json
import os
import sys

STEP_TARGET = 0.80
MEMORY_TARGET = 0.55
# the fp8 arms of bench_model.py; "+liger" runs Liger's fused norm / SwiGLU / cross-entropy around the fp8
# base, and is also given against the frozen model with Liger ("vs_liger_floor") when that arm ran
FP8_ARMS = ("sits+fp8", "sits+fp8+compile", "sits+fp8+compile+cg", "sits+fp8+liger")


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["rows"]


def summarize(out: str) -> dict:
    summary: dict = {"layers": [], "model": {}}
    layer = _rows(os.path.join(out, "layer.json"))
    for key in sorted({(r["d_in"], r["d_out"]) for r in layer}):
        by_arm = {r["arm"]: r for r in layer if (r["d_in"], r["d_out"]) == key}
        entry = {"shape": f"{key[0]} x {key[1]}"}
        for arm, row in by_arm.items():
            if "error" in row:  # bench_layer.py records a failing arm and goes on
                entry[arm + "_error"] = row["error"]
                continue
            entry[arm + "_ms"] = row["full_ms"]
            entry[arm + "_vs_frozen"] = row.get("vs_frozen")
        summary["layers"].append(entry)
    model = {r["arm"]: r for r in _rows(os.path.join(out, "model_8b.json"))}
    floors = {a: model[a]["step_s"] for a in ("frozen", "frozen+compile", "frozen+compile+cg")
              if "step_s" in model.get(a, {})}
    if floors:
        floor_arm = min(floors, key=floors.get)
        summary["model"]["floor"] = {"arm": floor_arm, "step_s": floors[floor_arm]}
        liger_floor = model.get("frozen+liger", {}).get("step_s")
        if liger_floor:
            summary["model"]["frozen+liger"] = {"step_s": liger_floor, "vs_floor": liger_floor / floors[floor_arm]}
        for arm in FP8_ARMS:
            row = model.get(arm, {})
            if "step_s" in row:
                ratio = row["step_s"] / floors[floor_arm]
                summary["model"][arm] = {"step_s": row["step_s"], "vs_floor": ratio, "meets_0.80": ratio <= STEP_TARGET,
                                         "frozen_weight_ratio": row.get("frozen_weight_ratio"),
                                         "peak_gib": row.get("peak_gib"), "fp8_saturated": row.get("fp8_saturated"),
                                         "fp8_nonfinite": row.get("fp8_nonfinite")}
                if liger_floor and "liger" in arm:
                    summary["model"][arm]["vs_liger_floor"] = row["step_s"] / liger_floor
            elif arm in model:
                summary["model"][arm] = {"error": row.get("error")}
    return summary


def _num(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main(argv=None) -> int:
    out = (argv or sys.argv[1:] or [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fp8")])[0]
    summary = summarize(out)
    for entry in summary["layers"]:
        print(f"layer {entry['shape']:>13}: " + ", ".join(
            f"{k[:-3]} {v:.3f} ms" for k, v in entry.items() if k.endswith("_ms")) + "  |  fp8 vs frozen bf16: "
            + (f"{entry['sits:fp8_vs_frozen']:.3f}x" if entry.get("sits:fp8_vs_frozen") else "n/a")
            + "".join(f"  |  {k[:-6]} FAILED: {v}" for k, v in entry.items() if k.endswith("_error")))
    floor = summary["model"].get("floor")
    if floor:
        print(f"8B floor: {floor['arm']} {floor['step_s'] * 1000:.1f} ms/step")
    if "frozen+liger" in summary["model"]:
        row = summary["model"]["frozen+liger"]
        print(f"8B frozen+liger (not the issue's floor): {row['step_s'] * 1000:.1f} ms/step = {row['vs_floor']:.3f}x")
    for arm in FP8_ARMS:
        row = summary["model"].get(arm)
        if not row:
            continue
        if "error" in row:
            print(f"8B {arm}: FAILED: {row['error']}")
            continue
        print(f"8B {arm}: {row['step_s'] * 1000:.1f} ms/step = {row['vs_floor']:.3f}x the floor "
              f"(target <= {STEP_TARGET}: {'met' if row['meets_0.80'] else 'NOT met'}); frozen weights "
              f"{_num(row['frozen_weight_ratio'], '.3f')}x bf16 (target <= {MEMORY_TARGET}); peak "
              f"{_num(row['peak_gib'], '.1f')} GiB; saturated {row['fp8_saturated']}, non-finite {row['fp8_nonfinite']}"
              + (f"; {row['vs_liger_floor']:.3f}x the frozen model with Liger" if "vs_liger_floor" in row else ""))
    path = os.path.join(out, "fp8_summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
