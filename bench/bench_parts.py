"""Where the time of one fused LoRA layer goes: each kernel alone, against its byte and FLOP floor.

    python bench/bench_parts.py            # GPU: T = 8192, the four layer shapes, r = 16 and 64
    python bench/bench_parts.py --smoke    # CPU interpreter: checks the script

For every part: median ms, the bytes it must move (each input read once, each output written once),
the achieved GB/s and TFLOP/s, so bench/NOTES.md can say which pass is off its floor and by how much.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import median_ms, print_table, write_results  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]


def parts(T, K, N, r, dtype, device):
    from sits_lora.ops import fused

    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(T, K, device=device, dtype=dtype)
    W = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
    A = torch.randn(r, K, device=device) / K**0.5
    B = torch.randn(N, r, device=device) / r**0.5
    dy = torch.randn(T, N, device=device, dtype=dtype)
    h = fused.lora_shrink(x, A)
    g, _ = fused.lora_dy_pass(dy, B, h, 1.0)
    C = fused.lora_expand(h, B, 1.0, None, dtype)
    dX0 = torch.empty(T, K, device=device, dtype=dtype)
    gemm_flops = 2 * T * K * N
    return [
        # name, fn, bytes, flops
        ("cublas x@Wt", lambda: x @ W.t(), (T * K + N * K + T * N) * e, gemm_flops),
        ("cublas C.addmm_(x, Wt)", lambda: C.addmm_(x, W.t()), (T * K + N * K + 2 * T * N) * e, gemm_flops),
        ("triton gemm x@Wt + s·hBt", lambda: fused.lora_gemm(x, W.t(), h, B.t(), 1.0, None, dtype),
         (T * K + N * K + T * N) * e, gemm_flops),
        ("cublas dy@W", lambda: dy @ W, (T * N + N * K + T * K) * e, gemm_flops),
        ("cublas dX0.addmm_(dy, W)", lambda: dX0.addmm_(dy, W), (T * N + N * K + 2 * T * K) * e, gemm_flops),
        ("triton gemm dy@W + s·gA", lambda: fused.lora_gemm(dy, W, g, A, 1.0, None, dtype),
         (T * N + N * K + T * K) * e, gemm_flops),
        ("shrink h=xAt", lambda: fused.lora_shrink(x, A), T * K * e, 2 * T * K * r),
        ("expand C=s·hBt", lambda: fused.lora_expand(h, B, 1.0, None, dtype), T * N * e, 2 * T * N * r),
        ("dy pass (g, dB)", lambda: fused.lora_dy_pass(dy, B, h, 1.0), T * N * e, 4 * T * N * r),
        ("x pass (dA)", lambda: fused.lora_x_pass(x, A, g, 1.0, False), T * K * e, 2 * T * K * r),
        ("x pass (dA, dx)", lambda: fused.lora_x_pass(x, A, g, 1.0, True), 2 * T * K * e, 4 * T * K * r),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes, T = (SHAPES, 8192) if not args.smoke else ([(64, 96)], 64)
    rows = []
    for K, N in shapes:
        for r in args.ranks:
            for name, fn, nbytes, flops in parts(T, K, N, r, dtype, device):
                ms = median_ms(fn, warmup_ms=50, rep_ms=200)
                rows.append({"K": K, "N": N, "r": r, "part": name, "ms": ms, "MB": nbytes / 1e6,
                             "GB_per_s": nbytes / ms / 1e6, "TFLOP_per_s": flops / ms / 1e9})
    paths = write_results("parts_smoke" if args.smoke else "parts", rows, args.out)
    print_table(rows, ["K", "N", "r", "part", "ms", "MB", "GB_per_s", "TFLOP_per_s"])
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
