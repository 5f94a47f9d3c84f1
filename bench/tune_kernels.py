"""Tune the side kernels' launch configurations for the benchmark shapes on this GPU.

    python bench/tune_kernels.py --out bench/results       # writes kernel_configs.json + tuning.json

The cache it writes is what sits_lora reads at run time (SITS_LORA_TUNING_CACHE, or the packaged
defaults in src/sits_lora/ops/tuned_configs.json, which are a copy of an H200 run of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import environment  # noqa: E402

# (K, N) of every adapted projection in the benchmark: the layer shapes and the 1B / 8B models.
SHAPES = sorted({(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192),      # bench_layer
                 (2048, 2048), (2048, 512), (8192, 2048),                        # Llama-3.2-1B
                 (4096, 1024)})                                                  # Llama-3-8B k/v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ["SITS_LORA_TUNING_CACHE"] = os.path.join(args.out, "kernel_configs.json")
    from sits_lora.ops import fused, tuning

    report, done = [], set()
    for K, N in SHAPES:
        for r in args.ranks:
            result = fused.tune_layer_kernels(K, N, r, torch.bfloat16, "cuda", skip=done)
            for kernel, info in result.items():
                report.append({"K": K, "N": N, "r": r, "kernel": kernel, **info})
                print(f"{K:>6} {N:>6} r{r:<3} {kernel:8} default {info['default_ms']:.4f} ms -> best "
                      f"{info['best_ms']:.4f} ms {info['best']}", flush=True)
    with open(os.path.join(args.out, "tuning.json"), "w") as f:
        json.dump({"environment": environment(), "rows": report}, f, indent=1)
    print("cache:", tuning.save_cache())
    return 0


if __name__ == "__main__":
    sys.exit(main())
