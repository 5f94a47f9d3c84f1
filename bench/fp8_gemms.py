"""The fp8 layer's GPU pieces, each timed alone at T = 8192 on the four layer shapes: is the GEMM or the rest slow?

    python bench/fp8_gemms.py [--out DIR]

Rows per shape (d_in, d_out), all median ms (CUDA events, bench/harness.py):
  bf16 forward x Wᵀ and dX = dy W (torch.mm: the frozen floor's two GEMMs);
  fp8 forward x8 W8ᵀ (e4m3 × e4m3, fast accumulation, as the layer runs it);
  fp8 dX dy8 W8 (e5m2 × e4m3) with exact (the layer's setting) and with fast accumulation;
  the Triton fp8 GEMM candidate (ops.fp8.triton_fp8_matmul) for both, dX reading W8 as stored (no transpose);
  the fused cast of x and of dy (one read, fp8 write, amax) and the per-call transpose of W8 (torch's copy
and the layer's Triton kernel).
The ratio column is against the bf16 GEMM of the same direction. Writes fp8_gemms.{json,csv}.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import SHAPES  # noqa: E402
from harness import median_ms, print_table, write_results  # noqa: E402


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script, times nothing useful)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("fp8_gemms: needs a CUDA GPU (compute capability >= 8.9); --smoke runs tiny shapes on the CPU",
              file=sys.stderr)
        return 2
    if args.smoke and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke without a GPU runs the kernels in the Triton interpreter: set TRITON_INTERPRET=1")
    from sits_lora.ops.fp8 import E4M3, E5M2, fp8_cast, quantize_weight, transpose_fp8, triton_fp8_matmul

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    timer = (lambda fn: median_ms(fn, warmup_ms=1, rep_ms=1)) if args.smoke else median_ms
    shapes, T = (SHAPES, args.tokens) if not args.smoke else ([(64, 96), (96, 64)], 48)
    one = torch.ones(1, device=dev)
    rows = []
    for d_in, d_out in shapes:
        torch.manual_seed(0)
        x = torch.randn(T, d_in, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(T, d_out, device=dev, dtype=torch.bfloat16)
        w = torch.randn(d_out, d_in, device=dev, dtype=torch.bfloat16) * 0.02
        w8, w_inv = quantize_weight(w, "tensor")
        amax = torch.zeros(1, device=dev)
        scale = torch.full((1,), 16.0, device=dev)
        x8 = fp8_cast(x, scale, amax, E4M3)
        dy8 = fp8_cast(dy, scale, amax, E5M2)
        w8t = w8.t().contiguous()
        flops = 2.0 * T * d_in * d_out

        def mm8(a, b, fast):
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)

        # the Triton candidate must compute the same product before its time means anything; a candidate that
        # fails to compile or run on this GPU is recorded and the rest is still measured
        triton_operands = {"forward": (x8, w8.t(), w8.t()), "dX": (dy8, w8, w8t.t())}
        agreement, failed = {}, {}
        for direction, (a, b, b_cublas) in triton_operands.items():
            try:
                agreement[direction] = _rel_diff(triton_fp8_matmul(a, b, one, one), mm8(a, b_cublas, False))
            except Exception as error:  # noqa: BLE001 (reported in the results)
                failed[direction] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        timings = {
            ("forward", "bf16 mm"): timer(lambda: x @ w.t()),
            ("forward", "fp8 e4m3 fast"): timer(lambda: mm8(x8, w8.t(), True)),
            ("forward", "fp8 e4m3 exact"): timer(lambda: mm8(x8, w8.t(), False)),
            ("forward", "fp8 e4m3 Triton"): None if "forward" in failed else timer(
                lambda: triton_fp8_matmul(x8, w8.t(), one, one)),
            ("forward", "cast x"): timer(lambda: fp8_cast(x, scale, amax, E4M3)),
            ("dX", "bf16 mm"): timer(lambda: dy @ w),
            ("dX", "fp8 e5m2 exact"): timer(lambda: mm8(dy8, w8t.t(), False)),
            ("dX", "fp8 e5m2 fast"): timer(lambda: mm8(dy8, w8t.t(), True)),
            ("dX", "fp8 e5m2 Triton, W8 as stored"): None if "dX" in failed else timer(
                lambda: triton_fp8_matmul(dy8, w8, one, one)),
            ("dX", "cast dy"): timer(lambda: fp8_cast(dy, scale, amax, E5M2)),
            ("dX", "transpose W8 (torch)"): timer(lambda: w8.t().contiguous()),
            ("dX", "transpose W8 (Triton)"): timer(lambda: transpose_fp8(w8)),
        }
        for (direction, what), ms in timings.items():
            row = {"d_in": d_in, "d_out": d_out, "T": T, "direction": direction, "op": what}
            candidate = what.startswith("fp8") and "Triton" in what
            if ms is None:
                row["error"] = failed[direction]
            else:
                gemm = "mm" in what or "fp8 e" in what
                row.update({"ms": ms, "vs_bf16_gemm": ms / timings[(direction, "bf16 mm")],
                            "tflops": flops / ms / 1e9 if gemm else None,
                            "max_rel_diff_vs_scaled_mm": agreement[direction] if candidate else None})
            rows.append(row)
        if dev == "cuda":
            torch.cuda.empty_cache()
    paths = write_results("fp8_gemms_smoke" if args.smoke else "fp8_gemms", rows, args.out,
                          {"command": "python bench/fp8_gemms.py " + " ".join(argv or sys.argv[1:])})
    print_table(rows, ["d_in", "d_out", "direction", "op", "ms", "vs_bf16_gemm", "tflops", "max_rel_diff_vs_scaled_mm",
                       "error"])
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
