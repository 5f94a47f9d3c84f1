"""How fast does each rank-budget rule bring the routers to the target? Mean active rank per step.

Trains one routed arm (bench/dynamic_rank_harness.py's data, model and protocol) once per
(budget mode, step size) and records, after every optimizer step, the mean active rank the routers
decided and λ; then the held-out loss and the rank inference uses. The evaluation's routers sat at
11.7-21.5 under a target of 16 after 80 steps with the "target" rule (bench/results/
2026-11-30-h200-session3): this script compares the rules on a budget a CPU can afford.

    python bench/rank_budget_trace.py --size smoke --steps 80 --out DIR          # SmolLM2-135M, CPU, ~15 min
    python bench/rank_budget_trace.py --size budget --steps 80 --out DIR         # one GPU, the evaluation's batch
    python bench/rank_budget_trace.py --size tiny --steps 20 --out DIR           # a tiny random model (tests)

Writes rank_budget_trace.json (every step of every run), .csv (one row per run) and .png (mean
active rank against step, the target dashed).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamic_rank_harness import (  # noqa: E402
    arm_config,
    evaluate_model,
    load_blocks,
    load_eval_model,
    settings_for,
    train_model,
)
from harness import png, write_results  # noqa: E402


def _rule(text: str) -> tuple[str, float]:
    mode, _, step = text.partition(":")
    if mode not in ("target", "ceiling", "price") or not step:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODE:STEP_SIZE, e.g. target:0.5 or price:2")
    return mode, float(step)


def run(settings, arm: str, rules: list, lr: float, seed: int, out_dir: str, command: str) -> dict:
    from peft import get_peft_model

    from sits_lora import RankBudget, TokenEntropySampler

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, tokenizer, description = load_eval_model(settings.model, settings.seq_len)
    base = base.to(device).eval()
    base.requires_grad_(False)
    train_blocks, _, test_blocks = load_blocks(tokenizer, settings)
    print(f"model: {description}; {settings.steps} steps of {settings.batch_size} x {settings.seq_len}; arm {arm}; "
          f"lr {lr:g}; target {settings.mean_rank}; device {device}", flush=True)
    runs = []
    for mode, step_size in rules:
        run_settings = dataclasses.replace(settings, rank_budget_mode=mode, rank_budget_step_size=step_size)
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(base), arm_config(arm, run_settings))
        budget = RankBudget(model)
        if arm == "entropy-gated":
            TokenEntropySampler(model, tokenizer, batch_size=settings.eval_batch_size, max_length=settings.seq_len,
                                cache_dir=settings.cache_dir, progress=settings.progress
                                ).entropies([{"input_ids": row} for row in train_blocks])
        timing = train_model(model, train_blocks, run_settings, lr, seed, budget)
        test = evaluate_model(model, test_blocks, run_settings, budget=budget, seed=seed)
        trace = timing["budget_trace"]
        ranks = [t["mean_active_rank"] for t in trace]
        within = [abs(r - settings.mean_rank) <= 1.0 for r in ranks]
        # the first step from which every later step stays within ±1 of the target
        settled = next((i + 1 for i in range(len(within)) if all(within[i:])), None)
        row = {"arm": arm, "mode": mode, "step_size": step_size, "seed": seed, "lr": lr, "steps": settings.steps,
               "target": settings.mean_rank, "first_step_within_1_for_good": settled,
               "train_rank_last10": sum(ranks[-10:]) / len(ranks[-10:]), "final_lambda": trace[-1]["lambda"],
               "test_active_rank": test.get("active_rank"), "test_loss": test["loss"],
               "train_seconds": timing["train_seconds"],
               "trace_rank": [round(r, 3) for r in ranks], "trace_lambda": [round(t["lambda"], 4) for t in trace]}
        runs.append(row)
        print(f"{mode:>8}:{step_size:<4g} rank last 10 steps {row['train_rank_last10']:.2f}, test rank "
              f"{row['test_active_rank']:.2f}, settled at step {settled}, λ {row['final_lambda']:+.3f}, test loss "
              f"{test['loss']:.4f}", flush=True)
        budget.close()
        del model
    table = [{k: v for k, v in r.items() if not k.startswith("trace_")} for r in runs]
    paths = write_results("rank_budget_trace", table, out_dir,
                          {"command": command, "model": description, "runs_with_traces": runs})
    _plot(runs, settings.mean_rank, os.path.join(out_dir, "rank_budget_trace.png"))
    print("wrote", *paths)
    return {"runs": runs}


def _plot(runs, target: float, path: str) -> None:
    with png(path) as ax:
        if ax is None:
            return
        for r in runs:
            ax.plot(range(1, len(r["trace_rank"]) + 1), r["trace_rank"], label=f"{r['mode']} η={r['step_size']:g}")
        ax.axhline(target, color="gray", linestyle="--", label="target")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean active rank (router decisions)")
        ax.set_title(f"rank budget, {runs[0]['arm']}")
        ax.legend(fontsize=8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="smoke", choices=["budget", "smoke", "tiny"],
                        help="preset of bench/dynamic_rank_harness.py (model, data sizes)")
    parser.add_argument("--model", help="model spec for sits_lora.recipe.loading (default SmolLM2-135M) or 'tiny-random'")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--arm", default="entropy-gated", choices=["entropy-gated", "learned"])
    parser.add_argument("--rules", nargs="+", type=_rule, default=[("price", 2.0), ("price", 6.0)],
                        metavar="MODE:STEP", help="budget rules to compare (default price:2 price:6: the old and the new default step)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--router-lr-scale", type=float, default=1.0, help="the routers' lr as a multiple of --lr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("bench", "results", "rank_budget_trace"))
    args = parser.parse_args(argv)
    settings = settings_for(args.size, model=args.model, steps=args.steps, seeds=(args.seed,),
                            router_lr_scale=args.router_lr_scale)
    run(settings, args.arm, args.rules, args.lr, args.seed, args.out,
        "python bench/rank_budget_trace.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
