"""down_proj's x pass over its SwiGLU factors (the "x_pass_product" key): every configuration of its space at the
down_proj shapes of the 0.5B / 1B / 8B gate models (T 8192, r 16, bf16), against the plain x pass's configuration
it falls back to, the plain pass over the formed input and Liger's SwiGLU forward (what a rebuild would cost).
Stores the best in the tuning cache (SITS_LORA_TUNING_CACHE). Usage: python xpass_tune.py OUT.json"""
import json
import sys

import torch

from sits_lora.ops import fused, tuning
from sits_lora.ops.reference import ProductInput
from sits_lora.utils.timing import gpu_seconds

out = {"gpu": torch.cuda.get_device_name(), "rows": []}
for name, K, N in (("0.5b", 4864, 896), ("1b", 8192, 2048), ("8b", 14336, 4096)):
    T, R = 8192, 16
    skip = {("shrink", (K, R)), ("expand", (N, R)), ("dy_pass", (N, R)), ("x_pass", (K, R))}
    report = fused.tune_layer_kernels(K, N, R, torch.bfloat16, "cuda", tokens=T, skip=skip, product_input=True)
    info = report["x_pass_product"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    A = torch.randn(R, K, device="cuda", generator=gen) / K**0.5
    g = torch.randn(T, R, device="cuda", generator=gen)
    x = ProductInput(gate, up, True).value()
    plain_ms = gpu_seconds(lambda: fused.lora_x_pass_parts(x, A, g, 1.0, True)) * 1e3
    from liger_kernel.ops.swiglu import swiglu_forward
    swiglu_ms = gpu_seconds(lambda: swiglu_forward(gate, up)) * 1e3
    row = {"shape": name, "K": K, "N": N, "T": T, "r": R, "fallback_config": info["before"],
           "fallback_ms": info["before_ms"], "best_config": info["best"], "best_ms": info["best_ms"],
           "configs_tried": info["configs_tried"], "plain_x_pass_ms": plain_ms, "liger_swiglu_forward_ms": swiglu_ms}
    out["rows"].append(row)
    print(f"{name} K={K}: factored x pass, fallback config {info['before_ms']:.4f} ms -> best {info['best_ms']:.4f} ms "
          f"{info['best']}; plain pass over the formed x {plain_ms:.4f} ms; Liger SwiGLU forward {swiglu_ms:.4f} ms",
          flush=True)
print("cache:", tuning.save_cache())
json.dump(out, open(sys.argv[1], "w"), indent=1)
