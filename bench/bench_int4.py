"""The INT4 base's kernels on their own: dequantization bandwidth, and the fused dequant-GEMM against
dequantize + cuBLAS by token count (which one ``int4_mode="auto"`` should pick).

    python bench/bench_int4.py --out OUT          # a GPU: the 8B shapes, bf16
    python bench/bench_int4.py --smoke --out OUT  # a CPU under TRITON_INTERPRET=1: tiny shapes, checks the script

Dequantization: the kernel reads the packed codes, scales and mins and writes W in bf16; its bandwidth is
(bytes read + bytes written) / time, set against a device-to-device copy of a tensor of W's bf16 size
(read + write) measured in the same run. Writes OUT/int4_kernels.json and .csv.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import median_ms, print_table, write_results  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]   # (out_features, in_features)
# --fp8-tiles: the tiles of the NF4-into-e4m3 kernel measured beside its default (rows, bytes of a row, warps)
FP8_TILES = [(16, 128, 4), (32, 128, 4), (8, 256, 4), (32, 256, 8), (64, 64, 4), (32, 64, 4), (64, 128, 8),
             (128, 64, 8)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 1024, 8192])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--fp8-tiles", action="store_true", help="also time the NF4-into-e4m3 kernel at FP8_TILES")
    args = parser.parse_args(argv)
    from sits_lora.ops import int4_linear as Q

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("without a GPU, run under TRITON_INTERPRET=1 with --smoke")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes, tokens = (SHAPES, args.tokens) if not args.smoke else ([(48, 128)], [1, 32])
    rows = []
    for N, K in shapes:
        packed, scales, mins = Q.int4_pack(torch.randn(N, K, device=device, dtype=dtype) * 0.02, 128)
        out = torch.empty(N, K, device=device, dtype=dtype)
        read = sum(t.numel() * t.element_size() for t in (packed, scales, mins))
        written = out.numel() * out.element_size()
        dq_ms = median_ms(lambda: Q.int4_dequantize(packed, scales, mins, K, out))
        src = torch.empty_like(out)
        copy_ms = median_ms(lambda: out.copy_(src))
        copy_gb_per_s = 2 * written / copy_ms / 1e6
        rows.append({"kind": "dequantize", "format": "int4 g128", "N": N, "K": K, "tokens": None, "ms": dq_ms,
                     "gb_per_s": (read + written) / dq_ms / 1e6, "copy_gb_per_s": copy_gb_per_s,
                     "vs_copy": (read + written) / dq_ms / 1e6 / copy_gb_per_s})
        if device == "cuda" and importlib.util.find_spec("bitsandbytes") is not None:
            # what SitsLoraLinear4bit runs per call on a QLoRA model: bitsandbytes' own NF4 dequantization
            import bitsandbytes.functional as F

            codes, state = F.quantize_4bit(torch.randn(N, K, device=device, dtype=dtype) * 0.02, quant_type="nf4",
                                           compress_statistics=True)
            nf4_read = codes.numel() * codes.element_size() + state.absmax.numel() * state.absmax.element_size()
            nf4_ms = median_ms(lambda: F.dequantize_4bit(codes, state, out=out))
            rows.append({"kind": "dequantize", "format": "bnb nf4 (double quant)", "N": N, "K": K, "tokens": None,
                         "ms": nf4_ms, "gb_per_s": (nf4_read + written) / nf4_ms / 1e6, "copy_gb_per_s": copy_gb_per_s,
                         "vs_copy": (nf4_read + written) / nf4_ms / 1e6 / copy_gb_per_s})
            # the same bytes through sits_lora's kernel (SITS_LORA_BNB4_DEQUANT=triton), checked against bitsandbytes'
            from sits_lora.bases.bnb4 import layout_of
            from sits_lora.ops.bnb4_dequant import bnb4_dequantize

            expected = out.clone()
            ours_ms = median_ms(lambda: bnb4_dequantize(codes, layout_of(state), out))
            rows.append({"kind": "dequantize", "format": "nf4 by sits_lora's kernel", "N": N, "K": K, "tokens": None,
                         "ms": ours_ms, "gb_per_s": (nf4_read + written) / ours_ms / 1e6,
                         "copy_gb_per_s": copy_gb_per_s,
                         "vs_copy": (nf4_read + written) / ours_ms / 1e6 / copy_gb_per_s,
                         "max_abs_diff_vs_bnb": float((out.float() - expected.float()).abs().max())})
            # NF4 storage, fp8 compute: the same bytes formed in e4m3 (W · scale), as forward and as backward read it
            from sits_lora.bases.bnb4 import fp8_weight_scales
            from sits_lora.ops.bnb4_dequant import bnb4_dequantize_scaled

            from bitsandbytes.nn import Params4bit

            weight = Params4bit(codes, requires_grad=False, quant_state=state, bnb_quantized=True)
            w_scale, _ = fp8_weight_scales(weight, "tensor")
            for transpose in (False, True):
                out8 = torch.empty((K, N) if transpose else (N, K), device=device, dtype=torch.float8_e4m3fn)
                # the default tile, then (--fp8-tiles) others: rows, bytes of a row, warps per program
                for tile in [None] + (FP8_TILES if args.fp8_tiles else []):
                    fp8_ms = median_ms(lambda: bnb4_dequantize_scaled(codes, layout_of(state), (N, K), w_scale, out8,
                                                                      transpose, tile))
                    moved = nf4_read + out8.numel()
                    rows.append({"kind": "dequantize", "N": N, "K": K, "tokens": None, "ms": fp8_ms,
                                 "format": "nf4 into e4m3" + (", transposed" if transpose else "")
                                 + (f", tile {tile}" if tile else ""),
                                 "gb_per_s": moved / fp8_ms / 1e6, "copy_gb_per_s": copy_gb_per_s,
                                 "vs_copy": moved / fp8_ms / 1e6 / copy_gb_per_s})
        for T in tokens:
            x = torch.randn(T, K, device=device, dtype=dtype)
            fused = median_ms(lambda: Q.int4_matmul(x, packed, scales, mins, K))
            dequant = median_ms(lambda: torch.mm(x, Q.dequantized_into_shared_buffer(packed, scales, mins, K,
                                                                                     dtype).t()))
            w = out
            dense = median_ms(lambda: torch.mm(x, w.t()))
            rows.append({"kind": "forward product", "N": N, "K": K, "tokens": T, "fused_ms": fused,
                         "dequant_cublas_ms": dequant, "dense_cublas_ms": dense,
                         "faster": "fused" if fused < dequant else "dequant"})
    os.makedirs(args.out, exist_ok=True)
    write_results("int4_kernels", rows, args.out, {"command": "python bench/bench_int4.py " + " ".join(argv or sys.argv[1:])})
    print_table([r for r in rows if r["kind"] == "dequantize"],
                ["format", "N", "K", "ms", "gb_per_s", "copy_gb_per_s", "vs_copy"])
    print_table([r for r in rows if r["kind"] != "dequantize"],
                ["N", "K", "tokens", "fused_ms", "dequant_cublas_ms", "dense_cublas_ms", "faster"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
