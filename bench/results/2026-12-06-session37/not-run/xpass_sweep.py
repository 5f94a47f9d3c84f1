# the x pass over down_proj's input, formed (x) against read as its two factors (ProductInput, silu), every config
# of the x_pass space, at the down_proj shapes of 0.5B / 1B / 8B (T 8192, r16, bf16), medians of do_bench
import json, sys, torch
from sits_lora.ops import fused, tuning
from sits_lora.ops.reference import ProductInput
from sits_lora.utils.timing import gpu_seconds
out = {}
for name, K, N in (("1b", 8192, 2048), ("0.5b", 4864, 896), ("8b", 14336, 4096)):
    T, R = 8192, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    product = ProductInput(gate, up, True)
    x = product.value()
    A = torch.randn(R, K, device="cuda", generator=gen) / K**0.5
    B = torch.randn(N, R, device="cuda", generator=gen) / R**0.5
    dy = torch.randn(T, N, device="cuda", generator=gen).to(torch.bfloat16)
    h = fused.lora_shrink(x, A)
    g_part, _ = fused.lora_dy_pass_parts(dy, B, h, 1.0)
    chosen = tuning.config_for("x_pass", torch.device("cuda"), (K, 16), torch.bfloat16)
    rows = []
    for cfg in [None] + tuning.CONFIG_SPACE["x_pass"]:
        try:
            plain = gpu_seconds(lambda: fused.lora_x_pass_parts(x, A, g_part, 1.0, True, config=cfg)) * 1e3
            prod = gpu_seconds(lambda: fused.lora_x_pass_parts(product, A, g_part, 1.0, True, config=cfg)) * 1e3
        except Exception as e:
            print(name, cfg, type(e).__name__); continue
        rows.append({"config": cfg or f"chosen {chosen}", "x_ms": round(plain, 4), "product_ms": round(prod, 4)})
    mb = T * K * 2 / 2**20
    from liger_kernel.ops.swiglu import swiglu_forward
    swiglu_ms = gpu_seconds(lambda: swiglu_forward(gate, up)) * 1e3
    out[name] = {"K": K, "N": N, "x_MiB": mb, "chosen": chosen, "rows": rows, "liger_swiglu_forward_ms": swiglu_ms}
    print(f"{name}: Liger's SwiGLU forward (the rebuild) {swiglu_ms:.3f} ms", flush=True)
    best_x = min(rows, key=lambda r: r["x_ms"]); best_p = min(rows, key=lambda r: r["product_ms"])
    print(f"{name} K={K}: chosen config x {rows[0]['x_ms']:.3f} ms, product {rows[0]['product_ms']:.3f} ms; "
          f"best x {best_x['x_ms']:.3f} ({best_x['config']}), best product {best_p['product_ms']:.3f} ({best_p['config']}); "
          f"rebuild-free saving needs product < x + swiglu fwd", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
