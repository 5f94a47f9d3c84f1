"""Does per-token dynamic rank help? Fine-tune SmolLM2-135M with each arm and compare held-out quality.

Arms, protocol and metrics: bench/dynamic_rank_harness.py (same data, same steps, learning
rate tuned per arm on validation blocks, >= 3 seeds; test loss / perplexity / KL against a full
fine-tune; loss against mean active rank). Writes dynamic_rank_eval.json, .csv, _runs.csv and .png
to --out.

    python bench/dynamic_rank_eval.py --budget      # one H200, about 18 minutes (measured: see PRESETS)
    python bench/dynamic_rank_eval.py --smoke       # a CPU, the real model at a tiny size, about 3 minutes
    python bench/dynamic_rank_eval.py --size tiny   # a tiny random model, seconds (tests)
    python bench/dynamic_rank_eval.py --merge-partials A/dynamic_rank_eval_partial.json B/... --out DIR
                                                    # one result from runs cut short (arms split over GPU calls)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamic_rank_harness import PRESETS, results_from_partials, run_evaluation, settings_for, write_results  # noqa: E402


def _lr_by_arm(text: str) -> dict:
    pairs = {}
    for item in text.split(","):
        arm, _, value = item.partition("=")
        try:
            pairs[arm.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not ARM=LR (e.g. static-r16=1e-3)") from None
    return pairs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--size", choices=sorted(PRESETS), help="preset size (default budget)")
    size.add_argument("--smoke", action="store_const", const="smoke", dest="size", help="= --size smoke")
    size.add_argument("--budget", action="store_const", const="budget", dest="size", help="= --size budget")
    parser.add_argument("--out", default=os.path.join("bench", "results"), help="output folder (default bench/results)")
    parser.add_argument("--model", help="model spec for sits_lora.recipe.loading (default SmolLM2-135M) or 'tiny-random'")
    parser.add_argument("--steps", type=int, help="optimizer steps per run")
    parser.add_argument("--seeds", type=lambda s: tuple(int(v) for v in s.split(",")), help="comma-separated seeds")
    parser.add_argument("--arms", type=lambda s: tuple(v.strip() for v in s.split(",")), help="comma-separated arms")
    parser.add_argument("--cache-dir", help="token-entropy cache folder (default $SITS_LORA_CACHE/token_entropy or "
                                            "~/.cache/sits_lora/token_entropy)")
    parser.add_argument("--lr-grid", type=lambda s: tuple(float(v) for v in s.split(",")),
                        help="comma-separated learning rates tried for each adapter arm (default 5e-4,1e-3,2e-3)")
    parser.add_argument("--lr", type=_lr_by_arm, metavar="ARM=LR[,ARM=LR...]",
                        help="a fixed learning rate for these arms instead of their grid, e.g. static-r16=1e-3 (the "
                             "pick of an earlier run's grid: each arm at its own tuned rate, one run per seed)")
    parser.add_argument("--rank-budget-mode", choices=("target", "ceiling", "price"),
                        help="SitsLoraConfig.rank_budget_mode of the routed arms (default price, the library's and "
                             "the latest evaluation's; sessions 2 and 3 ran ceiling and target)")
    parser.add_argument("--rank-budget-step-size", type=float,
                        help="SitsLoraConfig.rank_budget_step_size of the routed arms (default: the library's for the "
                             "mode, 0.5 for target, 6 for price)")
    parser.add_argument("--merge-partials", nargs="+", metavar="PARTIAL_JSON",
                        help="do not train: merge dynamic_rank_eval_partial.json files of runs cut short into one result")
    parser.add_argument("--environment-from", metavar="JSON",
                        help="with --merge-partials: take the environment stamp from this result file")
    args = parser.parse_args(argv)
    settings = settings_for(args.size or "budget", model=args.model, steps=args.steps, seeds=args.seeds,
                            arms=args.arms, cache_dir=args.cache_dir, lr_grid_lora=args.lr_grid, lr_by_arm=args.lr,
                            rank_budget_step_size=args.rank_budget_step_size, rank_budget_mode=args.rank_budget_mode)
    if args.merge_partials:
        results = results_from_partials(args.merge_partials, settings, args.environment_from)
        paths = write_results(results, args.out)
        print(json.dumps(results["rows"], indent=1))
        print("[dynamic-rank eval] merged", len(results["runs"]), "runs; wrote", *[p for p in paths.values() if p])
        return 0
    results = run_evaluation(settings, out_dir=args.out)
    print(json.dumps(results["rows"], indent=1))
    print(f"[dynamic-rank eval] wrote {args.out}/dynamic_rank_eval.{{json,csv,png}}, _runs.csv "
          f"in {results['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
