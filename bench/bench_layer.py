"""One LoRA linear layer, forward / backward / full: the frozen base, PEFT LoRA and sits_lora.

    python bench/bench_layer.py                   # on the GPU: the four shapes x r in {16, 64}, T = 8192, bf16
    python bench/bench_layer.py --smoke           # seconds on a CPU: tiny shapes, checks the script runs
    python bench/bench_layer.py --arms frozen sits:cublas sits:fp8 --ranks 16   # the fp8 base (issue 6)
    python bench/bench_layer.py --arms frozen sits:cublas sits:int4 sits:nf4 sits:nf4:bitsandbytes peft:nf4 --ranks 16   # 4-bit

"frozen" is the floor: the base nn.Linear with a frozen weight and an input that requires grad
(forward GEMM + dX GEMM). Every LoRA layer does at least this work. Each arm is timed in the same
process, one after the other, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import median_ms, peak_memory_gib, print_table, write_results  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 8192)]


class _One(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        return self.proj(x)


def build(arm: str, d_in: int, d_out: int, r: int, dtype, device):
    from peft import LoraConfig, get_peft_model

    import sits_lora
    from sits_lora import ops

    torch.manual_seed(0)
    base = _One(d_in, d_out).to(device, dtype)
    if arm == "frozen":
        base.requires_grad_(False)
        return base
    if arm == "peft":
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"]))
    elif arm in ("peft:nf4", "sits:nf4", "sits:nf4:triton", "sits:nf4:bitsandbytes"):
        # PEFT's QLoRA layer, or sits_lora's fused one: a bitsandbytes Linear4bit base (nf4, double
        # quantization, bf16 compute); a third field picks the kernel that forms W (SITS_LORA_BNB4_DEQUANT,
        # read per call, so it holds for the timing that follows this build)
        import bitsandbytes as bnb

        os.environ["SITS_LORA_BNB4_DEQUANT"] = arm.split(":")[2] if arm.count(":") == 2 else "triton"

        quantized = bnb.nn.Linear4bit(d_in, d_out, bias=False, compute_dtype=dtype, quant_type="nf4",
                                      compress_statistics=True)
        quantized.load_state_dict(base.proj.state_dict())
        base.proj = quantized.to(device)
        base.is_loaded_in_4bit = True  # what PEFT's bitsandbytes dispatcher looks for
        config = (LoraConfig if arm == "peft:nf4" else sits_lora.SitsLoraConfig)(r=r, lora_alpha=2 * r,
                                                                                 target_modules=["proj"])
        model = get_peft_model(base, config)
    elif arm.startswith("sits:int4"):
        # the INT4 base; "sits:int4:fused" / "sits:int4:dequant" pin how its products run
        model = get_peft_model(base, sits_lora.SitsLoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"],
                                                              base_quant="int4",
                                                              int4_group_size=128 if d_in % 128 == 0 else 32))
        model.base_model.model.proj.base_layer.int4_mode = arm.split(":")[2] if arm.count(":") == 2 else "auto"
    elif arm == "sits:fp8":
        # fp8 frozen base, "hybrid" recipe; emulated on a CPU so that --smoke runs anywhere
        model = get_peft_model(base, sits_lora.SitsLoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"],
                                                              fp8="hybrid", fp8_layers="all",
                                                              fp8_emulate=device == "cpu"))
    else:
        gemm = arm.split(":", 1)[1]
        ops.set_gemm_backend(gemm)
        model = get_peft_model(base, sits_lora.SitsLoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"]))
    with torch.no_grad():  # B = 0 at init would let a kernel skip work it must do in training
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    if arm == "sits:fp8":
        # one step records amaxes and advances the scales: the timed calls run delayed scaling (steady state)
        from sits_lora.fp8 import update_scaling

        model(torch.randn(64, d_in, device=device, dtype=dtype, requires_grad=True)).sum().backward()
        update_scaling(model)
    return model


def adapted_layer(model, arm: str):
    """The module that does the arm's work: the nn.Linear itself (frozen) or the adapted layer inside the
    PeftModel (without PeftModel's wrapper, which a whole model pays once per step, not per layer)."""
    return model if arm == "frozen" else model.base_model.model.proj


def layer_step(arm, d_in, d_out, r, T, dtype, device, layer_only: bool = False):
    """(model, x, step): the arm's layer, a (T, d_in) input that requires grad, and one forward + backward
    that writes every gradient anew (as training does after zero_grad), not an accumulate into .grad.
    ``layer_only``: the step calls ``adapted_layer`` instead of the PeftModel."""
    model = build(arm, d_in, d_out, r, dtype, device)
    x = torch.randn(T, d_in, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, d_out, device=device, dtype=dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    called = adapted_layer(model, arm) if layer_only else model

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        called(x).backward(dy)

    return model, x, step


def measure(arm, d_in, d_out, r, T, dtype, device) -> dict:
    model, x, full = layer_step(arm, d_in, d_out, r, T, dtype, device)

    def forward():
        return model(x)

    y = forward()
    fwd = median_ms(lambda: forward())
    bwd_total = median_ms(full)
    mem = peak_memory_gib(full)
    del y
    return {"d_in": d_in, "d_out": d_out, "r": r, "T": T, "arm": arm, "forward_ms": fwd,
            "backward_ms": bwd_total - fwd, "full_ms": bwd_total, "peak_gib": mem}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--arms", nargs="+", default=["frozen", "peft", "sits:cublas", "sits:triton"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes, T = (SHAPES, args.tokens) if not args.smoke else ([(64, 96), (96, 64)], 128)
    rows = []
    for d_in, d_out in shapes:
        for r in args.ranks:
            frozen = None
            for arm in args.arms:
                try:
                    row = measure(arm, d_in, d_out, r, T, dtype, device)
                except RuntimeError as error:  # one failing arm must not cost the others (the first fp8 run did)
                    print(f"[{arm} {d_in}x{d_out} r{r}] failed: {str(error).splitlines()[0]}", file=sys.stderr)
                    rows.append({"d_in": d_in, "d_out": d_out, "r": r, "T": T, "arm": arm,
                                 "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"})
                    continue
                frozen = row["full_ms"] if arm == "frozen" else frozen
                row["vs_frozen"] = row["full_ms"] / frozen if frozen else None
                rows.append(row)
                torch.cuda.empty_cache() if device == "cuda" else None
    name = "layer_smoke" if args.smoke else "layer"
    paths = write_results(name, rows, args.out, {"command": "python bench/bench_layer.py " + " ".join(argv or sys.argv[1:])})
    print_table(rows, ["d_in", "d_out", "r", "arm", "forward_ms", "backward_ms", "full_ms", "vs_frozen", "peak_gib"])
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
