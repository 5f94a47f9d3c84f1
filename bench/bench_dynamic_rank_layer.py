"""Dynamic rank per layer: the fused per-token-rank path against the static fused kernel at r_max.

    python bench/bench_dynamic_rank_layer.py            # on the GPU: 4 Llama shapes, T = 8192, bf16, r_max 64
    python bench/bench_dynamic_rank_layer.py --smoke    # seconds on a CPU (Triton interpreter): checks the script

Arms, all timed forward + backward in one process (bench/harness.py), interleaved over --rounds
passes (median kept), ratios to the frozen floor and to the static fused layer at r_max; on a GPU
also each arm's kernel time alone (gpu_ms: the profiler's summed GPU activity per step, host left
out), the measure that separates a slower kernel from a slower launch at the narrow shapes:
    frozen              the base nn.Linear alone (frozen weight, input requires grad)
    static-r16/r64      the fused static LoRA kernels (sits_lora.ops.lora_linear in ops/linear.py, cuBLAS design)
    dyn:<hist>:<mode>   sits_lora.ops.lora_linear_dynamic_rank_triton with buckets 16/32/48/64 and
                        bucket histogram all-min / all-max / mixed (uniform); mode "hard" (no router
                        gradient: eval, 'random', 'static') or "router" (the bucket-weight gradient
                        that trains the router); "-ungrouped" = tokens not sorted by bucket
    reference:mixed     the mask-multiply reference (sits_lora.dynamic_rank), the CPU path
    layer:learned       a whole dynamic-rank SitsLoraLinear in training (router, Gumbel sampling, budget term),
                        the router's decision eager (the default since session 5)
    layer:learned-compiled-router   the same with the decision compiled (SITS_LORA_COMPILE_ROUTER=1)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import gpu_kernels_ms, median_ms, print_table, write_results  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]
BUCKETS = (16, 32, 48, 64)


def _shapes(text: str) -> list:
    """'4096x4096,2048x8192' -> [(4096, 4096), (2048, 8192)]"""
    shapes = []
    for part in text.split(","):
        dims = part.strip().lower().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(f"--shapes: {part!r} is not DINxDOUT with two positive integers "
                                             f"(e.g. 4096x4096)")
        shapes.append((int(dims[0]), int(dims[1])))
    return shapes


def _ids(hist: str, tokens: int, device) -> torch.Tensor:
    k = len(BUCKETS)
    if hist == "all-min":
        return torch.zeros(tokens, dtype=torch.long, device=device)
    if hist == "all-max":
        return torch.full((tokens,), k - 1, dtype=torch.long, device=device)
    return torch.randint(0, k, (tokens,), device=device, generator=torch.Generator(device).manual_seed(0))


def arms(d_in, d_out, T, dtype, device, smoke):
    """({name: step function}, the leaf tensors whose .grad the steps fill)"""
    from sits_lora import ops
    from sits_lora.dynamic_rank import dynamic_rank_lora_linear_reference

    torch.manual_seed(0)
    W = torch.randn(d_out, d_in, device=device, dtype=dtype) / d_in**0.5
    x = torch.randn(T, d_in, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, d_out, device=device, dtype=dtype)
    A = (torch.randn(64, d_in, device=device) / d_in**0.5).requires_grad_(True)
    B = (torch.randn(d_out, 64, device=device) * 0.02).requires_grad_(True)
    A16, B16 = A[:16].detach().clone().requires_grad_(True), B[:, :16].detach().clone().requires_grad_(True)
    ends = torch.tensor(BUCKETS, device=device)
    leaves = [x, A, B, A16, B16]
    out = {
        "frozen": lambda: torch.nn.functional.linear(x, W).backward(dy),
        "static-r16": lambda: ops.lora_linear(x, x, W, None, A16, B16, 2.0, "triton").backward(dy),
        "static-r64": lambda: ops.lora_linear(x, x, W, None, A, B, 2.0, "triton").backward(dy),
    }
    hists = ["mixed"] if smoke else ["all-min", "all-max", "mixed"]
    for hist in hists:
        ids_ = _ids(hist, T, device)
        limit = ends[ids_].to(torch.int32)
        for mode in ("hard", "router"):
            weights = (torch.nn.functional.one_hot(ids_, len(BUCKETS)).float().requires_grad_(True)
                       if mode == "router" else None)
            for grouped in (True, False):
                name = f"dyn:{hist}:{mode}" + ("" if grouped else "-ungrouped")
                if weights is not None:
                    leaves.append(weights)
                out[name] = (lambda limit=limit, weights=weights, grouped=grouped:
                             ops.lora_linear_dynamic_rank_triton(x, None, W, None, A, B, 2.0, limit, ends, weights,
                                                                 group_tokens=grouped).backward(dy))
    ids_mixed = _ids("mixed", T, device)
    out["reference:mixed"] = lambda: dynamic_rank_lora_linear_reference(
        x, x, W, None, A, B, 2.0, ids_mixed, BUCKETS).backward(dy)
    out["layer:learned"], layer_params = _layer_arm(d_in, d_out, T, dtype, device, x, dy)
    leaves += layer_params
    out["layer:learned-compiled-router"] = _compiled_routing(out["layer:learned"])
    return out, leaves


def _compiled_routing(step):
    """The same layer step with the router's decision compiled (SITS_LORA_COMPILE_ROUTER=1): does compiling
    it pay? (The compiled call has its own Python cost; on a CPU both are eager.)"""
    def run():
        before = os.environ.get("SITS_LORA_COMPILE_ROUTER")
        os.environ["SITS_LORA_COMPILE_ROUTER"] = "1"
        try:
            step()
        finally:
            if before is None:
                del os.environ["SITS_LORA_COMPILE_ROUTER"]
            else:
                os.environ["SITS_LORA_COMPILE_ROUTER"] = before
    return run


def _layer_arm(d_in, d_out, T, dtype, device, x, dy):
    from peft import get_peft_model

    from sits_lora import SitsLoraConfig
    from sits_lora.dynamic_rank.variant import dynamic_rank_adapters

    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(d_in, d_out, bias=False))
    model = get_peft_model(base.to(device, dtype), SitsLoraConfig(
        r=64, lora_alpha=16, use_rslora=True, target_modules=["proj"], use_dynamic_rank=True,
        rank_scheduler="learned", rank_buckets=list(BUCKETS), target_mean_rank=32))
    layer = next(m for m in model.modules() if dynamic_rank_adapters(m))
    layer.rank_budget_attached = True  # timed alone: no Trainer / RankBudget around it
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.02)
    model.train()
    return (lambda: layer(x).backward(dy)), [p for p in layer.parameters() if p.requires_grad]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="time every arm once per round, arms interleaved, and keep the median over rounds "
                             "(adjacent arms differed by up to 5 %% within one pass on the H200; spread = "
                             "(max - min) / median over rounds, per arm)")
    parser.add_argument("--shapes", type=_shapes, metavar="DINxDOUT[,DINxDOUT...]",
                        help="only these layer shapes, e.g. 4096x4096,2048x8192 (default: "
                             + ",".join(f"{i}x{o}" for i, o in SHAPES) + ")")
    parser.add_argument("--gpu-steps", type=int, default=20,
                        help="steps profiled per arm for gpu_ms (0: skip the kernel-time measurement)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("without a GPU the kernels need the Triton interpreter: TRITON_INTERPRET=1 python ... --smoke")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes, T = (args.shapes or SHAPES, args.tokens) if not args.smoke else ([(80, 72)], 64)
    rows, kernel_breakdown = [], {}
    for d_in, d_out in shapes:
        fns, leaves = arms(d_in, d_out, T, dtype, device, args.smoke)

        def fresh(fn, leaves=leaves):
            # each step writes its gradients anew (as in training after zero_grad), not x.grad += dx: an
            # accumulate is a T x d_in read and write every arm would pay (to session 4 they all did)
            def step():
                for t in leaves:
                    t.grad = None
                fn()
            return step

        rounds = {name: [] for name in fns}
        for _ in range(max(1, args.rounds)):
            for name, fn in fns.items():
                rounds[name].append(median_ms(fresh(fn), rep_ms=200 if not args.smoke else 1))
        timed = {name: statistics.median(values) for name, values in rounds.items()}
        breakdown = {name: gpu_kernels_ms(fresh(fn), steps=args.gpu_steps) if args.gpu_steps > 0 else None
                     for name, fn in fns.items()}
        kernels = {name: sum(per.values()) if per else None for name, per in breakdown.items()}
        if any(breakdown.values()):
            # which kernel a kernel-time excess comes from, without another GPU call
            kernel_breakdown[f"{d_in}x{d_out}"] = breakdown
        for name, ms in timed.items():
            gpu_ms, gpu_static = kernels[name], kernels["static-r64"]
            rows.append({"d_in": d_in, "d_out": d_out, "T": T, "arm": name, "full_ms": ms,
                         "vs_frozen": ms / timed["frozen"], "vs_static_r64": ms / timed["static-r64"],
                         "spread": (max(rounds[name]) - min(rounds[name])) / ms, "rounds": len(rounds[name]),
                         "gpu_ms": gpu_ms, "gpu_vs_static_r64": gpu_ms / gpu_static if gpu_ms and gpu_static else None})
        if device == "cuda":
            torch.cuda.empty_cache()
    name = "dynamic_rank_layer_smoke" if args.smoke else "dynamic_rank_layer"
    paths = write_results(name, rows, args.out,
                          {"command": "python bench/bench_dynamic_rank_layer.py " + " ".join(argv or sys.argv[1:]),
                           "buckets": list(BUCKETS), "gpu_kernels_ms": kernel_breakdown})
    print_table(rows, ["d_in", "d_out", "arm", "full_ms", "vs_frozen", "vs_static_r64", "spread", "gpu_ms",
                       "gpu_vs_static_r64"])
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
