"""fp8 convolutions (sits_lora.ops.fp8_conv) against cuDNN's bf16 ones, at the convolution shapes of SDXL's U-Net and
VAE decoder; and SDPA's attention backends at SDXL's attention shapes.

    python bench/fp8_conv.py --out OUT              # on a GPU
    python bench/fp8_conv.py --out OUT --smoke      # tiny shapes on the Triton interpreter (checks the script)
    python bench/fp8_conv.py --out OUT --vae-only   # only the whole VAE decode (below)

For each shape, GPU time of one call (triton.testing.do_bench, median):
  cudnn_bf16   F.conv2d in bf16, channels_last (what the U-Net runs today)
  fp8_best     the Triton implicit-GEMM kernel on e4m3 codes, the fastest configuration of a small space
  fp8_default  the same at the module's default configuration
  cast         the static cast of the input to e4m3 by one eager pass (under torch.compile it is fused into the
               GroupNorm / SiLU that writes the input, and costs nothing of its own)
and the error of the fp8 result against the bf16 convolution (relative max, SQNR in dB). The attention part times
F.scaled_dot_product_attention under each backend that runs (flash, efficient, cudnn).
The VAE part decodes one SDXL latent (128² -> 1024², random weights in SDXL's VAE shape, channels_last, the decoder
compiled as sits_lora.diffusion.compile_blocks does) in bf16 and with the decoder's layers in fp8
(sits_lora.diffusion.calibrate on another latent, then quantize_fp8(vae_decoder=True)): ms a decode (CUDA events,
median of 10), the fp8 image's PSNR against the bf16 one, the graph breaks of compiling the decoder and, on a GPU,
one decode's kernel time by kind and its top kernels (torch.profiler).
Writes OUT/fp8_conv.json and OUT/fp8_conv.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

# (name, batch, C_in, H, C_out, kernel, stride): SDXL U-Net at 1024² with CFG (batch 2, latents 128²), VAE decoder
# at 1024² (batch 1, latents 128²)
CONV_SHAPES = [
    ("unet128 320->320 3x3", 2, 320, 128, 320, 3, 1),
    ("unet128 640->320 3x3", 2, 640, 128, 320, 3, 1),
    ("unet128 960->320 3x3", 2, 960, 128, 320, 3, 1),
    ("unet down 320 s2", 2, 320, 128, 320, 3, 2),
    ("unet64 320->640 3x3", 2, 320, 64, 640, 3, 1),
    ("unet64 640->640 3x3", 2, 640, 64, 640, 3, 1),
    ("unet64 1280->640 3x3", 2, 1280, 64, 640, 3, 1),
    ("unet64 1920->640 3x3", 2, 1920, 64, 640, 3, 1),
    ("unet32 640->1280 3x3", 2, 640, 32, 1280, 3, 1),
    ("unet32 1280->1280 3x3", 2, 1280, 32, 1280, 3, 1),
    ("unet32 2560->1280 3x3", 2, 2560, 32, 1280, 3, 1),
    ("unet64 1x1 1920->640", 2, 1920, 64, 640, 1, 1),
    ("vae128 512->512 3x3", 1, 512, 128, 512, 3, 1),
    ("vae256 512->512 3x3", 1, 512, 256, 512, 3, 1),
    ("vae512 512->256 3x3", 1, 512, 512, 256, 3, 1),
    ("vae512 256->256 3x3", 1, 256, 512, 256, 3, 1),
    ("vae1024 256->128 3x3", 1, 256, 1024, 128, 3, 1),
    ("vae1024 128->128 3x3", 1, 128, 1024, 128, 3, 1),
]
SMOKE_SHAPES = [("smoke 32->16 3x3", 1, 32, 6, 16, 3, 1), ("smoke 16->16 s2", 1, 16, 7, 16, 3, 2)]

# (name, batch·heads, q length, kv length, head dim): SDXL's self- and cross-attention at batch 2
ATTENTION_SHAPES = [
    ("self 64² 10 heads", 2 * 10, 4096, 4096, 64),
    ("self 32² 20 heads", 2 * 20, 1024, 1024, 64),
    ("cross 64² 10 heads", 2 * 10, 4096, 77, 64),
    ("cross 32² 20 heads", 2 * 20, 1024, 77, 64),
]


def config_space(block_k: int, smoke: bool) -> list[dict]:
    if smoke:
        return [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 1, "num_stages": 1}]
    space = []
    for bm, bn, bk, warps, stages in ((128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 128, 64, 4, 4),
                                      (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3),
                                      (128, 64, 64, 4, 4), (128, 64, 128, 4, 4), (64, 64, 64, 4, 5),
                                      (256, 128, 64, 8, 3)):
        if bk <= block_k:
            space.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
                          "num_stages": stages})
    return space


def bench_us(fn, smoke: bool) -> float:
    if smoke:
        fn()
        return float("nan")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1000


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    noise = (value.float() - reference.float()).pow(2).mean().item()
    signal = reference.float().pow(2).mean().item()
    return 10 * math.log10(signal / noise) if noise > 0 else float("inf")


def conv_rows(shapes, device: str, smoke: bool) -> list[dict]:
    from sits_lora.ops import fp8 as fp8_ops
    from sits_lora.ops.fp8_conv import conv2d_fp8, conv_k_block, pack_conv_weight

    code_dtype = torch.float16 if smoke else fp8_ops.E4M3
    act_dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for name, batch, c_in, size, c_out, kernel, stride in shapes:
        torch.manual_seed(0)
        x = torch.randn(batch, c_in, size, size, device=device).to(act_dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        weight = (torch.randn(c_out, c_in, kernel, kernel, device=device) / math.sqrt(c_in * kernel * kernel))
        bias = torch.randn(c_out, device=device).to(act_dtype)
        weight = weight.to(act_dtype).contiguous(memory_format=torch.channels_last)
        padding = kernel // 2
        amax = x.float().abs().amax().reshape(1)
        x_scale = (448.0 / amax).float()
        x_inv = x_scale.reciprocal()
        if smoke:
            x8 = x.to(code_dtype)
            x_inv = torch.ones(1, device=device)
            w8, w_inv = weight.to(code_dtype), torch.ones(c_out, device=device)
        else:
            x8 = fp8_ops.fp8_cast(x.permute(0, 2, 3, 1).reshape(-1, c_in), x_scale, None, code_dtype)
            x8 = x8.reshape(batch, size, size, c_in).permute(0, 3, 1, 2)
            w8, w_inv = fp8_ops.quantize_weight(weight.reshape(c_out, -1), "row")
            w8 = w8.reshape(c_out, c_in, kernel, kernel)
        packed = pack_conv_weight(w8)
        reference = F.conv2d(x, weight, bias, stride=stride, padding=padding)
        cudnn_us = bench_us(lambda: F.conv2d(x, weight, bias, stride=stride, padding=padding), smoke)
        flops = 2 * reference.numel() // c_out * c_out * c_in * kernel * kernel
        best = (float("inf"), None)
        block_k = conv_k_block(c_in)
        for cfg in config_space(block_k, smoke):
            try:
                us = bench_us(lambda: conv2d_fp8(x8, packed, x_inv, w_inv, bias, (kernel, kernel), stride, padding,
                                                 act_dtype, cfg), smoke)
            except Exception as exc:   # a configuration out of shared memory: skip it, say so
                print(f"  {name}: {cfg} failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            if smoke or us < best[0]:
                best = (us, cfg)
        default_us = bench_us(lambda: conv2d_fp8(x8, packed, x_inv, w_inv, bias, (kernel, kernel), stride, padding,
                                                 act_dtype), smoke)
        out = conv2d_fp8(x8, packed, x_inv, w_inv, bias, (kernel, kernel), stride, padding, act_dtype, best[1])
        cast_us = float("nan") if smoke else bench_us(
            lambda: fp8_ops.fp8_cast(x.permute(0, 2, 3, 1).reshape(-1, c_in), x_scale, None, code_dtype), smoke)
        rel = ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
        row = {"shape": name, "batch": batch, "c_in": c_in, "size": size, "c_out": c_out, "kernel": kernel,
               "stride": stride, "gflop": flops / 1e9, "cudnn_bf16_us": cudnn_us, "fp8_best_us": best[0],
               "fp8_default_us": default_us, "cast_us": cast_us, "speedup": cudnn_us / best[0],
               "fp8_tflops": flops / best[0] / 1e6, "cudnn_tflops": flops / cudnn_us / 1e6,
               "rel_max_err": rel, "sqnr_db": sqnr_db(reference, out), "best_config": best[1]}
        rows.append(row)
        print(f"{name:24s} cudnn {cudnn_us:8.1f} us  fp8 {best[0]:8.1f} (default {default_us:8.1f})  cast "
              f"{cast_us:6.1f}  x{row['speedup']:.2f}  sqnr {row['sqnr_db']:.1f} dB  {best[1]}", flush=True)
    return rows


def attention_rows(device: str) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for name, bh, lq, lk, dim in ATTENTION_SHAPES:
        q = torch.randn(2, bh // 2, lq, dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(2, bh // 2, lk, dim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        row = {"shape": name}
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            reference = F.scaled_dot_product_attention(q, k, v)
        for backend, value in backends.items():
            try:
                with sdpa_kernel([value]):
                    out = F.scaled_dot_product_attention(q, k, v)
                    row[f"{backend}_us"] = bench_us(lambda: F.scaled_dot_product_attention(q, k, v), False)
                row[f"{backend}_max_err"] = (out.float() - reference.float()).abs().max().item()
            except Exception as exc:
                row[f"{backend}_us"] = None
                row[f"{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        with torch.no_grad():
            row["default_us"] = bench_us(lambda: F.scaled_dot_product_attention(q, k, v), False)
        rows.append(row)
        print(name, {k: v for k, v in row.items() if k.endswith("_us")}, flush=True)
    return rows


class _VaeOnly:
    """The part of a pipeline calibrate / quantize_fp8 read for the VAE decoder: .vae, an empty .unet, and a call
    that decodes."""

    def __init__(self, vae):
        self.vae, self.unet = vae, torch.nn.Module()

    def __call__(self, latents):
        return self.vae.decode(latents).sample


def vae_rows(device: str, smoke: bool) -> list[dict]:
    import copy

    import diffusers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from diffusion import SHAPES, SMOKE_SHAPES as DIFFUSION_SMOKE

    from sits_lora.diffusion import calibrate, quantize_fp8

    shape = DIFFUSION_SMOKE["tiny"] if smoke else SHAPES["sdxl"]
    dtype = torch.float32 if smoke else torch.bfloat16
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(**shape["vae"]).to(device, dtype).eval().requires_grad_(False)
    vae.to(memory_format=torch.channels_last)
    latent = shape["resolution"] // 8
    gen = torch.Generator().manual_seed(1)
    factor = vae.config.scaling_factor
    latents = (torch.randn(1, 4, latent, latent, generator=gen) / factor).to(device, dtype)
    calibration_latents = (torch.randn(1, 4, latent, latent, generator=gen) / factor).to(device, dtype)
    fp8_vae = copy.deepcopy(vae)
    calibration = calibrate(_VaeOnly(fp8_vae), [{"latents": calibration_latents}])
    report = quantize_fp8(_VaeOnly(fp8_vae), calibration, vae_decoder=True, min_rows=0 if smoke else 256)
    print(f"[vae] {report.summary()}", flush=True)
    rows, images = [], {}
    for arm, model in (("bf16", vae), ("fp8", fp8_vae)):
        breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
        if not smoke:
            model.decoder.compile()
        with torch.no_grad():
            for _ in range(3):
                image = model.decode(latents).sample
            times = []
            for _ in range(1 if smoke else 10):
                if device == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    image = model.decode(latents).sample
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    image = model.decode(latents).sample
                    times.append(float("nan"))
        images[arm] = (image.float() / 2 + 0.5).clamp(0, 1)
        rows.append({"arm": arm, "ms_per_decode": sorted(times)[len(times) // 2],
                     "layers_fp8": len(report.quantized) if arm == "fp8" else 0,
                     "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks_before})
        if device == "cuda":   # where the decode's time goes, by kind of kernel (what a faster convolution saves)
            from profile_diffusion import top_kernels

            def decode():
                with torch.no_grad():
                    model.decode(latents)

            top, counts = top_kernels(decode, device, count=8)
            rows[-1].update(kernels=counts["kernels"], ms_by_kind=counts["ms_by_kind"], top_kernels=top)
    mse = (images["fp8"] - images["bf16"]).pow(2).mean().item()
    rows[1]["psnr_db"] = 10 * math.log10(1 / mse) if mse > 0 else float("inf")
    rows[1]["speedup"] = rows[0]["ms_per_decode"] / rows[1]["ms_per_decode"]
    for row in rows:
        print("[vae]", {k: v for k, v in row.items() if k != "top_kernels"}, flush=True)
        for kernel in row.get("top_kernels", []):
            print(f"[vae {row['arm']}]   {kernel['ms']:7.2f} ms {kernel['calls']:4d}x  {kernel['name']}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the Triton interpreter")
    parser.add_argument("--vae-only", action="store_true", help="only the VAE decode, bf16 against fp8")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("bench/fp8_conv.py: no CUDA device; run with --smoke (and TRITON_INTERPRET=1) on a CPU", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    if not args.vae_only:
        result["conv"] = conv_rows(SMOKE_SHAPES if args.smoke else CONV_SHAPES, device, args.smoke)
        if not args.smoke:
            result["attention"] = attention_rows(device)
    result["vae"] = vae_rows(device, args.smoke)
    with open(os.path.join(args.out, "fp8_conv.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(args.out, "fp8_conv.csv"), "w", newline="") as f:
        rows = result.get("conv") or result["vae"]
        nested = ("best_config", "top_kernels", "ms_by_kind")   # in the JSON only
        fields = list(dict.fromkeys(k for row in rows for k in row if k not in nested))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: v for k, v in row.items() if k not in nested})
    return 0


if __name__ == "__main__":
    sys.exit(main())
