"""Where the host (Python) time of one LoRA layer step goes: per launcher, and by cProfile.

    python bench/profile_host.py --out OUT        # on a GPU; --smoke on a CPU (emulated fp8, no launches)

Session 3 measured the eager fp8 layer at 1.99 ms of host time per fwd+bwd step against 0.76 ms of
GPU time (bench/NOTES.md): below the MLP shapes the layer is launch-bound, and on the 8B model the
224 adapted layers can keep the GPU waiting. This script runs a small token count (the GPU finishes
each kernel long before the host issues the next), so the timings are host costs:

1. each launcher alone (fp8 cast, shrink, expand, dy pass, x pass, W8 transpose, _scaled_mm,
   torch.mm and torch.empty for scale), µs per call;
2. a whole layer step per arm, µs per step, and the cProfile table of 100 steps (top by own time).

Writes OUT/host.json and OUT/host_profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import adapted_layer, layer_step  # noqa: E402
from harness import environment  # noqa: E402


def _host_us(fn, calls: int) -> float:
    """Mean host time of fn() in µs; the GPU is synchronized before and after, not in between."""
    for _ in range(5):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def launchers(T: int, K: int, N: int, R: int, calls: int) -> dict:
    from sits_lora.ops import fp8 as fp8_ops
    from sits_lora.ops import fused

    dev = "cuda"
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    A = torch.randn(R, K, device=dev) * 0.01
    B = torch.randn(N, R, device=dev) * 0.01
    w8, w_inv = fp8_ops.quantize_weight(torch.randn(N, K, device=dev, dtype=torch.bfloat16), "tensor")
    scale = torch.ones(8, device=dev)
    amax = torch.zeros(8, device=dev)
    x8 = fp8_ops.fp8_cast(x, scale[:1], None, fp8_ops.E4M3)
    h = fused.lora_shrink(x, A)
    g, _ = fused.lora_dy_pass(dy, B, h, 2.0)
    y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
    pieces = {
        "fp8_cast": lambda: fp8_ops.fp8_cast(x, scale[:1], amax[:1], fp8_ops.E4M3),
        "lora_shrink": lambda: fused.lora_shrink(x, A),
        "lora_expand_add": lambda: fp8_ops.lora_expand_add_(y, h, B, 2.0, None),
        "lora_dy_pass": lambda: fused.lora_dy_pass(dy, B, h, 2.0),
        "lora_x_pass": lambda: fused.lora_x_pass(x, A, g, 2.0, write_dx=False),
        "transpose_fp8": lambda: fp8_ops.transpose_fp8(w8),
        "scaled_mm": lambda: torch._scaled_mm(x8, w8.t(), scale_a=scale[:1], scale_b=scale[:1],
                                              out_dtype=torch.bfloat16, use_fast_accum=True),
        "torch_mm_bf16": lambda: torch.mm(x, x.t()),
        "torch_empty": lambda: torch.empty(T, N, device=dev, dtype=torch.bfloat16),
    }
    return {name: _host_us(fn, calls) for name, fn in pieces.items()}


def breakdown(T: int, K: int, N: int, R: int, calls: int) -> tuple[dict, str]:
    """Host µs of the pieces a fused layer step is made of, and the torch.profiler table of the
    adapted layer alone (without PeftModel's wrapper, which a model pays once per step, not per layer)."""
    from torch.nn import functional as F

    from sits_lora.ops import fused, fused_backward

    dev = "cuda"
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    C = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
    A = torch.randn(R, K, device=dev) * 0.01
    xd = x.detach()

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    h = torch.empty((T, R), device=dev, dtype=torch.float32)
    compiled = fused._lora_shrink_kernel[(4,)](xd, A, h, h, h, T, K, R, K, 1, K, 1, R, 1, HAS_LIMIT=False,
                                               WRITE_FULL=False, BLOCK_R=16, DOT_PRECISION="tf32", BLOCK_T=64,
                                               BLOCK_K=128, num_warps=4, num_stages=4)
    from triton.runtime import driver

    stream = driver.active.get_current_stream(driver.active.get_current_device())
    run, fn, packed = compiled.run, compiled.function, compiled.packed_metadata
    args = (xd, A, h, h, h, T, K, R, K, 1, K, 1, R, 1, False, False, 64, 128, 16, "tf32")
    pieces = {
        "addmm_inplace": lambda: C.addmm_(xd, W.t()),
        "torch_addmm": lambda: torch.addmm(C, xd, W.t()),
        "torch_mm": lambda: torch.mm(xd, W.t()),
        "F_linear": lambda: F.linear(xd, W),
        "mm_dy_W": lambda: torch.mm(dy, W),
        "empty_like_fp32": lambda: torch.empty((T, R), device=dev, dtype=torch.float32),
        "sum0_of_4": lambda: h.view(4, T // 4, R).sum(0),
        "function_apply_fwd": lambda: Nothing.apply(x),
        "function_fwd_bwd": lambda: Nothing.apply(x).backward(dy[:, :K] if N >= K else None),
        "shrink_jit_launch": lambda: fused._lora_shrink_kernel[(4,)](
            xd, A, h, h, h, T, K, R, K, 1, K, 1, R, 1, HAS_LIMIT=False, WRITE_FULL=False, BLOCK_R=16,
            DOT_PRECISION="tf32", BLOCK_T=64, BLOCK_K=128, num_warps=4, num_stages=4),
        "shrink_direct_run": lambda: run(4, 1, 1, stream, fn, packed, None, None, None, *args),
        "current_stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
    }
    results = {name: _host_us(fn_, calls) for name, fn_ in pieces.items()}
    direct = [fused._SHRINK, fused._EXPAND, fused_backward._DY_PASS, fused_backward._X_PASS, fused_backward._SUM_PARTIALS]
    before = [launcher.direct_launches for launcher in direct]
    text = io.StringIO()
    for arm in ("frozen", "sits:cublas"):
        model, xs, step = layer_step(arm, K, N, R, T, torch.bfloat16, dev, layer_only=True)
        layer = adapted_layer(model, arm)
        results[f"layer_only_step:{arm}"] = _host_us(step, calls)
        results[f"layer_only_forward:{arm}"] = _host_us(lambda: layer(xs), calls)
        if arm == "frozen":
            continue
        from torch.profiler import ProfilerActivity, profile

        for _ in range(10):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                step()
        text.write(f"== torch.profiler, {arm} layer alone, 50 steps (T = {T}, {K} x {N}, r {R})\n")
        text.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))
    # how many launches took sits_lora.ops.launch's direct path (0: every launch went through JITFunction.run)
    for launcher, b in zip(direct, before):
        results[f"direct_launches:{launcher.fn.__name__}"] = launcher.direct_launches - b
    return results, text.getvalue()


def layer_steps(arms, T: int, K: int, N: int, R: int, steps: int, device: str, dtype) -> tuple[dict, str]:
    results, text = {}, io.StringIO()
    for arm in arms:
        _, _, step = layer_step(arm, K, N, R, T, dtype, device)
        results[arm] = _host_us(step, steps)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            step()
        prof.disable()
        if device == "cuda":
            torch.cuda.synchronize()
        text.write(f"== {arm}: {results[arm]:.1f} us host per step (T = {T}, {K} x {N}, r {R}); cProfile of 100 steps\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return results, text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="small: the host, not the GPU, sets the pace")
    parser.add_argument("--d-in", type=int, default=2048)
    parser.add_argument("--d-out", type=int, default=8192)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--arms", nargs="+", default=["frozen", "sits:cublas", "sits:fp8"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="bench/results/host")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny sizes, layer steps only")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke on a CPU)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    T, K, N, steps = (args.tokens, args.d_in, args.d_out, args.steps) if cuda else (32, 64, 96, 5)
    os.makedirs(args.out, exist_ok=True)
    report = {"environment": environment(), "command": "python " + " ".join(sys.argv),
              "tokens": T, "d_in": K, "d_out": N, "r": args.r}
    if cuda:
        report["launcher_host_us"] = launchers(T, K, N, args.r, steps)
        for name, us in report["launcher_host_us"].items():
            print(f"{name:22s} {us:8.1f} us host per call", flush=True)
    detail_table = ""
    if cuda:
        report["breakdown_host_us"], detail_table = breakdown(T, K, N, args.r, steps)
        for name, us in report["breakdown_host_us"].items():
            print(f"{name:34s} {us:8.1f} us host", flush=True)
    report["layer_step_host_us"], table = layer_steps(args.arms, T, K, N, args.r, steps, device, dtype)
    for arm, us in report["layer_step_host_us"].items():
        print(f"layer step {arm:12s} {us:8.1f} us host", flush=True)
    with open(os.path.join(args.out, "host.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
        f.write(detail_table + table)
    print(table[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
