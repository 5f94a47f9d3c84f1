"""Does an fp8 frozen base cost quality? SmolLM2-135M fine-tuned with sits bf16 and sits fp8="hybrid".

Issue 6's quality target: the fp8 run's held-out loss within 1 % of the bf16 run's at the same
steps, 3 seeds each; fp8 with a per-tensor and with a per-row weight scale. Same protocol and data as the dynamic-rank evaluation (bench/dynamic_rank_harness.py:
the project's offline standard-library corpus, whole held-out modules as the test set, the same
blocks in the same order for every arm of a seed), one learning rate for both arms. The model is
loaded in bf16 for both arms (the fp8 base quantizes the bf16 weights once at injection).

    python bench/fp8_quality.py --out DIR                     # one H200: 3 arms x 3 seeds x 80 steps of 8 x 512
    python bench/fp8_quality.py --size tiny --out DIR         # a tiny random model, emulated fp8 on a CPU (seconds)

Writes fp8_quality.json / .csv (one row per run, then the mean ± std per arm) and fp8_quality.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamic_rank_harness import (  # noqa: E402
    _mean_std,
    evaluate_model,
    load_blocks,
    load_eval_model,
    settings_for,
    train_model,
)
from harness import png, write_results  # noqa: E402

# the fp8 arms differ in the weight scale's granularity: one per tensor, or one per output row
ARMS = ("sits-bf16", "sits-fp8-hybrid", "sits-fp8-hybrid-row")


def arm_model(arm: str, base, settings, r: int, emulate: bool):
    from peft import get_peft_model

    from sits_lora import SitsLoraConfig

    fp8 = {}
    if arm != "sits-bf16":
        fp8 = dict(fp8="hybrid", fp8_emulate=emulate, fp8_weight_scale="row" if arm.endswith("-row") else "tensor")
    config = SitsLoraConfig(r=r, lora_alpha=2 * r, target_modules=list(settings.target_modules), task_type="CAUSAL_LM",
                            **fp8)
    return get_peft_model(copy.deepcopy(base), config)


def run(settings, lr: float, r: int, out_dir: str, command: str) -> dict:
    from sits_lora.fp8 import fp8_scaling_state, frozen_weight_memory, update_scaling

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, tokenizer, description = load_eval_model(settings.model, settings.seq_len)
    base = base.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    base.requires_grad_(False)
    train_blocks, _, test_blocks = load_blocks(tokenizer, settings)
    print(f"model: {description}; {len(train_blocks)} train / {len(test_blocks)} test blocks of {settings.seq_len} "
          f"tokens; {settings.steps} steps of {settings.batch_size}; lr {lr:g}; r {r}; device {device}", flush=True)
    rows = []
    for seed in settings.seeds:
        for arm in ARMS:
            torch.manual_seed(seed)
            model = arm_model(arm, base, settings, r, emulate=device.type != "cuda")
            after = (lambda m=model: update_scaling(m)) if arm != "sits-bf16" else None
            timing = train_model(model, train_blocks, settings, lr, seed, after_step=after)
            ev = evaluate_model(model, test_blocks, settings, seed=seed)
            row = {"arm": arm, "seed": seed, "lr": lr, "r": r, "test_loss": ev["loss"], "test_ppl": ev["ppl"],
                   "final_train_loss": timing["final_train_loss"], "train_seconds": timing["train_seconds"],
                   "step_ms": 1000 * timing["train_seconds"] / settings.steps}
            if arm != "sits-bf16":
                row.update(frozen_weight_memory(model))
                row.update(fp8_scaling_state(model).log_counts())
            rows.append(row)
            print(f"{arm:>16} seed {seed}: test loss {ev['loss']:.4f}, {row['step_ms']:.1f} ms/step", flush=True)
            del model
            _write_partial(rows, out_dir)  # a call cut by its time limit keeps the runs it finished
    return report(rows, out_dir, command, description, settings)


def _write_partial(rows: list, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fp8_quality_partial.json"), "w") as f:
        json.dump({"rows": rows}, f, default=str)


_LOG_LINE = re.compile(r"^\s*(sits-[\w-]+) seed (\d+): test loss ([0-9.]+), ([0-9.]+) ms/step")


def runs_from(path: str) -> list[dict]:
    """Per-run rows from a fp8_quality_partial.json / fp8_quality.json, or from a run's log (the lines
    ``<arm> seed <n>: test loss <x>, <t> ms/step``, 4 decimals) when the run was cut before writing."""
    if path.endswith(".json"):
        with open(path) as f:
            data = json.load(f)
        return [r for r in data["rows"] if "seed" in r]
    rows = []
    with open(path) as f:
        for line in f:
            m = _LOG_LINE.match(line)
            if m:
                rows.append({"arm": m.group(1), "seed": int(m.group(2)), "test_loss": float(m.group(3)),
                             "step_ms": float(m.group(4)), "source": os.path.basename(path) + " (4 decimals)"})
    return rows


def report(rows: list, out_dir: str, command: str, description: str, settings) -> dict:
    """Mean ± std per arm, the ±1 % verdict against sits-bf16, fp8_quality.{json,csv,png}."""
    summary = []
    for arm in [a for a in ARMS if any(r_["arm"] == a for r_ in rows)]:
        losses = [r_["test_loss"] for r_ in rows if r_["arm"] == arm]
        mean, std = _mean_std(losses)
        steps = [r_["step_ms"] for r_ in rows if r_["arm"] == arm]
        summary.append({"arm": arm, "seeds": len(losses), "test_loss_mean": mean, "test_loss_std": std,
                        "step_ms_mean": sum(steps) / len(steps)})
    bf16 = summary[0]["test_loss_mean"]
    verdict = {s["arm"]: {"relative_loss_gap": (s["test_loss_mean"] - bf16) / bf16, "target": 0.01,
                          "met": abs(s["test_loss_mean"] - bf16) / bf16 <= 0.01} for s in summary[1:]}
    paths = write_results("fp8_quality", rows + summary, out_dir,
                          {"command": command, "model": description, "summary": summary, "verdict": verdict,
                           "settings": {k: getattr(settings, k) for k in ("seq_len", "batch_size", "steps", "seeds",
                                                                            "test_blocks", "target_modules")}})
    _plot(rows, os.path.join(out_dir, "fp8_quality.png"))
    for s in summary:
        print(f"{s['arm']:>16}: test loss {s['test_loss_mean']:.4f} ± {s['test_loss_std'] or 0:.4f} over {s['seeds']} "
              f"seeds, {s['step_ms_mean']:.1f} ms/step")
    for arm, v in verdict.items():
        print(f"{arm} vs sits-bf16 held-out loss: {100 * v['relative_loss_gap']:+.2f} % (target within ±1 %: "
              f"{'met' if v['met'] else 'MISSED'})")
    print("wrote", *paths)
    return {"rows": rows, "summary": summary, "verdict": verdict}


def _plot(rows, path: str) -> None:
    with png(path, figsize=(5, 3.2)) as ax:
        if ax is None:
            return
        for i, arm in enumerate(ARMS):
            losses = [r["test_loss"] for r in rows if r["arm"] == arm]
            ax.scatter([i] * len(losses), losses, label=arm)
        ax.set_xticks(range(len(ARMS)), ARMS)
        ax.set_ylabel("held-out loss (per seed)")
        ax.set_title("SmolLM2-135M, sits LoRA r16: bf16 vs fp8 base")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="budget", choices=["budget", "smoke", "tiny"],
                        help="preset of bench/dynamic_rank_harness.py (data sizes, steps, seeds)")
    parser.add_argument("--model", help="model spec for sits_lora.recipe.loading (default SmolLM2-135M) or 'tiny-random'")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seeds", type=lambda s: tuple(int(v) for v in s.split(",")))
    parser.add_argument("--out", default=os.path.join("bench", "results", "fp8_quality"))
    parser.add_argument("--merge-runs", nargs="+", metavar="FILE",
                        help="do not train: one result from the runs in these files (fp8_quality[_partial].json, or "
                             "the log of a run cut short); a run (arm, seed) is taken from the first file that has it")
    args = parser.parse_args(argv)
    settings = settings_for(args.size, model=args.model, steps=args.steps, seeds=args.seeds)
    command = "python bench/fp8_quality.py " + " ".join(argv or sys.argv[1:])
    if args.merge_runs:
        rows, seen = [], set()
        for path in args.merge_runs:
            for row in runs_from(path):
                if (row["arm"], row["seed"]) not in seen:
                    seen.add((row["arm"], row["seed"]))
                    rows.append(row)
        rows.sort(key=lambda r: (r["seed"], ARMS.index(r["arm"])))
        report(rows, args.out, command, args.model or "SmolLM2-135M-Instruct", settings)
        return 0
    if settings.seeds and len(settings.seeds) < 3 and args.size == "budget":
        parser.error(f"--seeds {args.seeds}: issue 6's comparison needs at least 3 seeds")
    run(settings, args.lr, args.r, args.out, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
