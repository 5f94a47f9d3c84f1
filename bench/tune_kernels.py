"""Tune the side kernels' launch configurations for the benchmark shapes on this GPU.

    python bench/tune_kernels.py --out bench/results       # writes kernel_configs.json + tuning.json
    python bench/tune_kernels.py --fp8 --no-kernels --out OUT   # only the fp8-vs-bf16 layer crossover
    python bench/tune_kernels.py --model 1b --ranks 16 --out OUT  # what a bench_model shape's step launches

``--model`` (a bench_model shape, repeatable) tunes the dims its adapted layers launch at rank r: each projection,
and the shrink and x pass of its sibling groups, which run at the summed rank (q / k / v: 3r, gate / up: 2r).

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


def _ms(value) -> str:
    return "-" if value is None else f"{value:.4f} ms"


def _layer_shapes(models: list, ranks: list) -> list:
    """(K, N, r, (kernel, dims) not to tune) for SHAPES at each rank, or for each bench_model shape's projections
    and sibling groups (shrink and x pass only: their expand and dy pass run per projection)."""
    if not models:
        return [(K, N, r, ()) for K, N in SHAPES for r in ranks]
    from bench_model import MODELS

    from sits_lora.ops.geometry import block_rank

    rows = []
    for name in models:
        shape = MODELS[name]
        h, inter = shape["hidden_size"], shape["intermediate_size"]
        kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
        for r in ranks:
            rows += [(K, N, r, ()) for K, N in ((h, h), (h, kv), (h, inter), (inter, h))]
            for width in (3 * r, 2 * r):   # q / k / v, gate / up
                dims = (h, block_rank(width))
                rows.append((h, h, width, (("expand", dims), ("dy_pass", dims))))
    return rows


def _down_projections(models: list) -> set:
    """(K, N) of the bench_model shapes' down projections: their input can be read as its two SwiGLU factors (the
    x pass's "x_pass_product" configuration is tuned there too)."""
    if not models:
        return set()
    from bench_model import MODELS

    return {(MODELS[name]["intermediate_size"], MODELS[name]["hidden_size"]) for name in models}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--fp8", action="store_true", help="also measure where the fp8 base pays, per shape")
    parser.add_argument("--no-kernels", action="store_true", help="skip the launch-configuration tuning")
    parser.add_argument("--model", action="append", default=[], metavar="SHAPE",
                        help="tune what this bench_model shape launches (1b, 8b, 0.5b; repeatable) instead of SHAPES")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ["SITS_LORA_TUNING_CACHE"] = os.path.join(args.out, "kernel_configs.json")
    from sits_lora.ops import fused, tuning

    report, done = [], set()
    down_projections = _down_projections(args.model)
    for K, N, r, skip_kernels in ([] if args.no_kernels else _layer_shapes(args.model, args.ranks)):
        skip = done | {(kernel, dims) for kernel, dims in skip_kernels}
        result = fused.tune_layer_kernels(K, N, r, torch.bfloat16, "cuda", skip=skip,
                                          product_input=(K, N) in down_projections)
        done |= skip - {(kernel, dims) for kernel, dims in skip_kernels}
        for kernel, info in result.items():
            report.append({"K": K, "N": N, "r": r, "kernel": kernel, **info})
            print(f"{K:>6} {N:>6} r{r:<3} {kernel:8} default {_ms(info['default_ms'])}, in use before "
                  f"{_ms(info['before_ms'])} -> best {_ms(info['best_ms'])} {info['best']}", flush=True)
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
