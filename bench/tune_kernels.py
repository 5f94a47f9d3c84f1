"""Tune the side kernels' launch configurations for the benchmark shapes on this GPU.

    python bench/tune_kernels.py --out bench/results       # writes kernel_configs.json + tuning.json
    python bench/tune_kernels.py --fp8 --no-kernels --out OUT   # only the fp8-vs-bf16 layer crossover

``--fp8`` also times one adapted layer step with the fp8 base against the bf16 fused path at each shape
(T = 8192, r 16) and stores the verdict that SitsLoraConfig(fp8_layers="auto") reads (sits_lora.fp8.selection).

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
    parser.add_argument("--fp8", action="store_true", help="also measure where the fp8 base pays, per shape")
    parser.add_argument("--no-kernels", action="store_true", help="skip the launch-configuration tuning")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ["SITS_LORA_TUNING_CACHE"] = os.path.join(args.out, "kernel_configs.json")
    from sits_lora.ops import fused, tuning

    report, done = [], set()
    for K, N in SHAPES if not args.no_kernels else []:
        for r in args.ranks:
            result = fused.tune_layer_kernels(K, N, r, torch.bfloat16, "cuda", skip=done)
            for kernel, info in result.items():
                report.append({"K": K, "N": N, "r": r, "kernel": kernel, **info})
                print(f"{K:>6} {N:>6} r{r:<3} {kernel:8} default {info['default_ms']:.4f} ms -> best "
                      f"{info['best_ms']:.4f} ms {info['best']}", flush=True)
    fp8_rows = []
    if args.fp8:
        from sits_lora.fp8 import selection

        for K, N in SHAPES:
            entry = selection.measure_layer(K, N)
            fp8_rows.append({"K": K, "N": N, **entry})
            print(f"fp8 {K:>6} x {N:<6} bf16 {entry['bf16_ms']:.3f} ms  fp8 {entry['fp8_ms']:.3f} ms  "
                  f"ratio {entry['ratio']:.3f}  -> {'fp8' if entry['use_fp8'] else 'bf16'}", flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "tuning.json"), "w") as f:
        json.dump({"environment": environment(), "rows": report, "fp8_layers": fp8_rows}, f, indent=1)
    print("cache:", tuning.save_cache())
    return 0


if __name__ == "__main__":
    sys.exit(main())
