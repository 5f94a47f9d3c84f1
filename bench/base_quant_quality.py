"""Quality of a 4-bit frozen base: the recipe's held-out loss after the same steps, bf16 base against INT4, per seed.

    python bench/base_quant_quality.py --out OUT                          # runs the recipe (SmolLM2-135M, defaults)
    python bench/base_quant_quality.py --out OUT --arms off int4:64 int4:32 --seeds 0 1 2
    python bench/base_quant_quality.py --out OUT --summarize-only         # the runs already under OUT

Each arm is one `recipes/train.py` run per seed (`--base-quant off`, or `int4` with `--int4-group-size G`), in its
own folder OUT/<arm>_s<seed>; a finished run (its metrics.json exists) is not run again, so an interrupted study
continues where it stopped. Then the table: held-out loss (ln of the held-out perplexity after training) per arm
and seed, its mean, and each arm's mean relative to the "off" arm's. Writes OUT/base_quant_quality.json, .csv and
.png. Extra recipe options go after ``--``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import png, print_table, write_results  # noqa: E402

RECIPE = os.path.join(os.path.dirname(HERE), "recipes", "train.py")


def arm_flags(arm: str) -> list[str]:
    """--base-quant (and --int4-group-size) of an arm: "off", "fp8" (the bf16 weights stored and computed in fp8 on
    every adapted layer), "nf4" (QLoRA: bitsandbytes, a CUDA GPU), "nf4+fp8" (the 4-bit storage with fp8 compute on
    every adapted layer), "int4" (the recipe's group size) or "int4:G"."""
    if arm in ("fp8", "nf4+fp8"):
        return ["--base-quant", "off" if arm == "fp8" else "nf4", "--fp8", "hybrid", "--fp8-layers", "all"]
    quant, _, group = arm.partition(":")
    if quant not in ("off", "int4", "nf4") or (group and not group.isdigit()) or (group and quant != "int4"):
        raise ValueError(f"--arms {arm}: give off, fp8, nf4, nf4+fp8, int4 or int4:G (G a group size, e.g. int4:64)")
    return ["--base-quant", quant] + (["--int4-group-size", group] if group else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arms", nargs="+", default=["off", "int4"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--summarize-only", action="store_true", help="read the runs under OUT, run nothing")
    args, recipe_args = parser.parse_known_args(argv)
    recipe_args = [a for a in recipe_args if a != "--"]
    try:
        flags = {arm: arm_flags(arm) for arm in args.arms}
    except ValueError as error:
        parser.error(str(error))
    rows = []
    for arm in args.arms:
        for seed in args.seeds:
            folder = os.path.join(args.out, f"{arm.replace(':', 'g').replace('+', '')}_s{seed}")
            metrics_path = os.path.join(folder, "metrics.json")
            if not os.path.exists(metrics_path) and not args.summarize_only:
                cmd = [sys.executable, RECIPE, "--seed", str(seed), *flags[arm], "--output-dir", folder,
                       "--overwrite", "true", *recipe_args]
                print(f"[{arm} seed {seed}] " + " ".join(cmd[1:]), flush=True)
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "run.log"), "w") as log:
                    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
                if done.returncode != 0:
                    print(f"[{arm} seed {seed}] failed (exit {done.returncode}): see {folder}/run.log", flush=True)
            if not os.path.exists(metrics_path):
                rows.append({"arm": arm, "seed": seed, "error": "no metrics.json"})
                continue
            with open(metrics_path) as f:
                metrics = json.load(f)
            rows.append({"arm": arm, "seed": seed,
                         "heldout_loss": math.log(metrics["heldout_perplexity_after"]),
                         "heldout_loss_before": math.log(metrics["heldout_perplexity_before"]),
                         "train_loss": metrics["train_loss"], "train_seconds": metrics["train_seconds"]})
    means = {}
    for arm in args.arms:
        losses = [r["heldout_loss"] for r in rows if r["arm"] == arm and "heldout_loss" in r]
        means[arm] = sum(losses) / len(losses) if losses else None
    base = means.get("off")
    summary = [{"arm": arm, "seeds": sum(1 for r in rows if r["arm"] == arm and "heldout_loss" in r),
                "mean_heldout_loss": m, "vs_off": (m / base - 1) if (m is not None and base) else None}
               for arm, m in means.items()]
    write_results("base_quant_quality", rows, args.out,
                  {"command": "python bench/base_quant_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "summary": summary})
    with png(os.path.join(args.out, "base_quant_quality.png"), figsize=(6, 3)) as ax:
        if ax is not None:
            for i, arm in enumerate(args.arms):
                losses = [r["heldout_loss"] for r in rows if r["arm"] == arm and "heldout_loss" in r]
                ax.scatter([i] * len(losses), losses, color="#4a7")
                if means[arm] is not None:
                    ax.hlines(means[arm], i - 0.25, i + 0.25, color="#333")
            ax.set_xticks(range(len(args.arms)), args.arms)
            ax.set_ylabel("held-out loss after training")
    print_table(rows, ["arm", "seed", "heldout_loss_before", "heldout_loss", "train_loss", "train_seconds"])
    print_table(summary, ["arm", "seeds", "mean_heldout_loss", "vs_off"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
