"""Where a diffusers U-Net step's time goes with a LoRA: GPU kernels (torch.profiler) and host time, per arm.

    python bench/profile_diffusion.py --out OUT                 # on a GPU: the SD1.5 U-Net shape
    python bench/profile_diffusion.py --out OUT --smoke         # tiny config on a CPU (checks the script)
    python bench/profile_diffusion.py --out OUT --shape sdxl --denoise-only --arms base base+fp8
    python bench/profile_diffusion.py --out OUT --shape sdxl --denoise-only --vae --arms base+fp8+cl+bcompile
    python bench/profile_diffusion.py --out OUT --shape sdxl --denoise-only --lora-targets cross \
        --arms base+fp8c+cl+bcompile sits+fp8c+cl+bcompile     # the image bench's LoRA (K / V kept)

An arm "X+fp8" is arm X with the U-Net's big linears in fp8 (sits_lora.diffusion.calibrate on one call with other
inputs, then quantize_fp8). Each profile also sums the GPU time by kind of kernel (GEMM, convolution, attention,
fp8 cast, the rest), to tell what a faster GEMM can save. "+cl": the U-Net in channels_last; "+bcompile": every block
compiled alone (sits_lora.diffusion.compile_blocks; the profile then counts the graph breaks dynamo made);
"+fuseqkv": diffusers' fuse_qkv_projections first (base arms). "+fp8c": the U-Net's convolutions in fp8 too (the
VAE stays bf16 here).

For each arm of bench/diffusion.py given in --arms: the training step (bs 8, 64² latents) and one no-grad U-Net call
at batch 2 (a denoising step with guidance): wall time, the host's time to issue the call (until it returns, without
waiting for the GPU), and the top kernels by GPU time. Writes OUT/profile_diffusion.txt and .json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diffusion as bench  # noqa: E402


def timed(fn, device: str, steps: int) -> tuple[float, float]:
    """(median wall seconds, median host seconds to issue) of ``fn``."""
    walls, hosts = [], []
    for _ in range(steps):
        bench.sync(device)
        start = time.perf_counter()
        fn()
        hosts.append(time.perf_counter() - start)
        bench.sync(device)
        walls.append(time.perf_counter() - start)
    return sorted(walls)[len(walls) // 2], sorted(hosts)[len(hosts) // 2]


def top_kernels(fn, device: str, count: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        bench.sync(device)
    attr = "device_time_total" if device == "cuda" else "cpu_time_total"
    averages = prof.key_averages()
    events = [e for e in averages if device != "cuda" or getattr(e, attr, 0) > 0]
    if device == "cuda":   # kernels only: the aten ops' device time counts their kernels again, and so do
        # inductor's compiled-region and dynamo annotations, and a Triton kernel's host-side launch event of its name
        from torch.autograd import DeviceType

        kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
        events = kernels or [e for e in events if not e.key.startswith(
            ("aten::", "autograd::", "cudaLaunch", "Optimizer", "Torch-Compiled Region", "## ", "TorchDynamo"))]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    # the host's launches: CUDA runtime / driver launch calls (cuBLAS, ATen and Triton kernels alike)
    launches = sum(e.count for e in averages if e.key.startswith(("cudaLaunch", "cuLaunch")))
    top = [{"name": e.key[:90], "ms": getattr(e, attr) / 1000, "calls": e.count} for e in events[:count]]
    kinds: dict[str, float] = {}
    for e in events:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + getattr(e, attr) / 1000
    return top, {"kernels": sum(e.count for e in events), "launch_calls": launches,
                 "ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}


# substrings of kernel names, first match wins: cuBLAS / cuBLASLt / CUTLASS GEMMs (bf16 and fp8), cuDNN convolutions,
# SDPA's attention kernels, our fp8 cast
KERNEL_KINDS = (("fp8_cast", ("_fp8_cast_kernel",)),
                ("attention", ("flash", "fmha", "attention", "sdpa")),
                ("conv", ("conv", "implicit_convolve", "cudnn", "xmma_fprop", "fprop")),
                ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "scaled_mm")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--arms", nargs="+", default=["base", "peft", "sits", "sits+noreuse"])
    parser.add_argument("--cprofile", nargs="*", default=[], metavar="ARM",
                        help="also cProfile 5 training steps of these arms (the host's Python, top 30 by own time)")
    parser.add_argument("--shape", choices=sorted(bench.SHAPES), default="sd15",
                        help="U-Net shape (the training step is SD1.5's: --denoise-only for others)")
    parser.add_argument("--denoise-only", action="store_true", help="profile the no-grad denoising call only")
    parser.add_argument("--lora-targets", choices=["attention", "cross"], default="attention",
                        help="the LoRA's layers: to_q / to_k / to_v / to_out.0 of every attention (the training "
                             "step's), or cross-attention to_k / to_v only (bench/diffusion.py's inference arms)")
    parser.add_argument("--vae", action="store_true",
                        help="also profile one VAE decode of one image (compiled whole with the +bcompile arms)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.shape != "sd15" and not args.denoise_only:
        parser.error(f"--shape {args.shape} profiles the denoising call only: add --denoise-only")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = bench.SMOKE_SHAPES["tiny"] if args.smoke else bench.SHAPES[args.shape]
    unet, vae_model = bench.build_base(shape, device, dtype)
    latent, batch = shape["resolution"] // 8, 2 if args.smoke else 8
    gen = torch.Generator().manual_seed(4)

    def unet_inputs():
        inputs = dict(sample=torch.randn(2, 4, latent, latent, generator=gen).to(device, dtype),
                      timestep=torch.tensor([500, 500], device=device),
                      encoder_hidden_states=torch.randn(2, 77, shape["text_dim"], generator=gen).to(device, dtype))
        if shape["pooled_dim"]:
            inputs["added_cond_kwargs"] = {
                "text_embeds": torch.randn(2, shape["pooled_dim"], generator=gen).to(device, dtype),
                "time_ids": torch.tensor([[shape["resolution"]] * 2 + [0, 0] + [shape["resolution"]] * 2] * 2,
                                         device=device, dtype=dtype)}
        return inputs

    denoise_inputs, calibration_inputs = unet_inputs(), unet_inputs()
    latents = torch.randn(1, 4, latent, latent, generator=gen).to(device, dtype)
    report, lines = {}, []
    for arm in args.arms:
        targets = bench.INFERENCE_TARGETS if args.lora_targets == "cross" else bench.TRAIN_TARGETS
        model = bench.adapt(unet, arm, targets if not arm.startswith("base") else [])
        if "fuseqkv" in arm.split("+"):   # bench/diffusion.py's arm of that name (base only: it drops a LoRA)
            model.fuse_qkv_projections()
        if "fp8" in arm.split("+") or "fp8c" in arm.split("+"):
            from sits_lora.diffusion import calibrate, quantize_fp8

            fp8 = quantize_fp8(model, calibrate(model, [calibration_inputs]), min_rows=0 if args.smoke else 256,
                               convolutions="fp8c" in arm.split("+"))
            lines.append(f"== {arm}: {fp8.summary()}")
        vae = vae_model
        if "bcompile" in arm.split("+"):   # every block compiled alone (bench/diffusion.py's arm of that name)
            from sits_lora.diffusion import compile_blocks

            compile_blocks(model, vae=False, channels_last="cl" in arm.split("+"))
            if args.vae:
                vae = copy.deepcopy(vae_model).to(memory_format=torch.channels_last if "cl" in arm.split("+")
                                                  else torch.contiguous_format)
                vae.decoder.compile()
        elif "cl" in arm.split("+"):
            model.to(memory_format=torch.channels_last)
        from sits_lora import ops

        threshold = ops.aten_below_flops()
        if arm.endswith("+fused"):   # every call on the fused kernels (bench/diffusion.py's arm of that name)
            ops.set_aten_below_flops(0)
        train = None if args.denoise_only else bench.train_step(model, arm.startswith("base"), batch, latent,
                                                                  shape["text_dim"], None, device, dtype)

        def denoise():
            with torch.no_grad():
                model(**denoise_inputs)

        def decode():
            with torch.no_grad():
                vae.decode(latents)

        row, first_line = {}, max(len(lines) - 1, 0) if {"fp8", "fp8c"} & set(arm.split("+")) else len(lines)
        jobs = (("train", train), ("denoise", denoise)) + ((("vae_decode", decode),) if args.vae else ())
        breaks_before = dict(torch._dynamo.utils.counters["graph_break"])
        for name, fn in jobs:
            if fn is None:
                continue
            for _ in range(3):
                fn()
            wall, host = timed(fn, device, 3 if args.smoke else 10)
            top, counts = top_kernels(fn, device)
            row[name] = {"wall_ms": wall * 1000, "host_ms": host * 1000, "top": top, **counts}
            adapter_dtypes = sorted({str(p.dtype) for n, p in model.named_parameters() if "lora_" in n})
            lines.append(f"== {arm} {name}: wall {wall * 1000:.1f} ms, host {host * 1000:.1f} ms, "
                         f"{counts['kernels']} kernels, {counts['launch_calls']} launch calls, adapters "
                         f"{' '.join(adapter_dtypes) or '-'}")
            lines.append("   by kind: " + ", ".join(f"{k} {v:.2f} ms" for k, v in counts["ms_by_kind"].items()))
            lines += [f"   {k['ms']:8.2f} ms {k['calls']:5d}x  {k['name']}" for k in row[name]["top"]]
        # this arm's breaks only: dynamo's counters run over the whole process
        breaks = {reason: count - breaks_before.get(reason, 0)
                  for reason, count in torch._dynamo.utils.counters["graph_break"].items()
                  if count > breaks_before.get(reason, 0)}
        if "bcompile" in arm.split("+"):
            lines.append(f"   graph breaks while compiling: {sum(breaks.values())} "
                         f"({', '.join(sorted(breaks)[:5]) or '-'})")
        if arm in args.cprofile and train is not None:
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(5):
                train()
            bench.sync(device)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            lines.append(f"== {arm} train, cProfile of 5 steps\n" + text.getvalue())
        # the LoRA layers of this arm's model (by their name in the U-Net), so a reader knows what --lora-targets gave
        row["adapted_layers"] = sorted(name for name, m in model.named_modules() if len(getattr(m, "lora_A", ())))
        report[arm] = row
        print("\n".join(lines[first_line:]), flush=True)
        model = train = None   # this arm's copy freed before the next one is made
        ops.set_aten_below_flops(threshold)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_diffusion.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "profile_diffusion.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
