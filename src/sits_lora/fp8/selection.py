"""Which adapted layers get the fp8 base (``SitsLoraConfig.fp8_layers``).

fp8 halves the two base GEMMs but adds work per layer that does not shrink with the layer: two casts,
the W8 transpose in the backward, an expand launch for dX's LoRA term (cuBLAS's bf16 epilogue folds it,
``torch._scaled_mm`` has none) and their host time. On a narrow layer that extra costs more than the
GEMMs save: of the Llama 1B and 8B layer shapes, only the 8B MLP's (4096 x 14336 and 14336 x 4096) are
large enough for fp8 to pay in a layer step (docs/fp8.md). With ``"auto"`` a layer is quantized only
where fp8 pays: a measurement of its shape on this GPU when one is stored with the tuned kernel configs
(:func:`measure_layer`, ``sits-lora compile --fp8``; the package ships those of the GPU it was
tuned on), else the rule in_features x out_features >= MIN_ELEMENTS (32 Mi, between the largest shape
where fp8 lost, 4096², 16 Mi, and the smallest where it won, 4096 x 14336, 56 Mi).
"""

from __future__ import annotations

import torch
from peft import get_peft_model
from torch import nn

from ..config import SitsLoraConfig
from ..ops import tuning
from ..utils.timing import gpu_seconds
from .scaling import update_scaling

MIN_ELEMENTS = 32 * 2**20


def choose(device: torch.device, in_features: int, out_features: int) -> tuple[bool, str]:
    """(quantize this layer?, why) for an adapted layer of this shape under fp8_layers='auto'."""
    measured = tuning.fp8_layer_measurement(device, in_features, out_features)
    if measured is not None:
        return bool(measured["use_fp8"]), (f"measured: fp8 step {measured['ratio']:.2f}x the bf16 step at "
                                           f"T={measured.get('tokens')}, r={measured.get('rank')}")
    elements = in_features * out_features
    verdict = "pays" if elements >= MIN_ELEMENTS else "too narrow to pay"
    return elements >= MIN_ELEMENTS, (f"rule: {in_features} x {out_features} = {elements / 2**20:.1f} Mi elements, "
                                      f"{verdict} (fp8 from {MIN_ELEMENTS // 2**20} Mi; no measurement stored)")


def measure_layer(in_features: int, out_features: int, tokens: int = 8192, rank: int = 16,
                  save: bool = True) -> dict:
    """Time one adapted layer's training step (forward + backward) with the bf16 fused path and with
    the fp8 base on this GPU, store the verdict with the tuned kernel configs, and return it:
    {"ratio": fp8 / bf16, "use_fp8": ratio < 1, "bf16_ms", "fp8_ms", "tokens", "rank"}."""
    device = torch.device("cuda", torch.cuda.current_device())
    times = {arm: _step_ms(device, in_features, out_features, tokens, rank, fp8)
             for arm, fp8 in (("bf16_ms", {}), ("fp8_ms", {"fp8": "hybrid", "fp8_layers": "all"}))}
    ratio = times["fp8_ms"] / times["bf16_ms"]
    entry = {"ratio": ratio, "use_fp8": ratio < 1.0, "tokens": tokens, "rank": rank, **times}
    tuning.store_fp8_layer_measurement(device, in_features, out_features, entry, save=save)
    return entry


def _step_ms(device: torch.device, in_features: int, out_features: int, tokens: int, rank: int, fp8: dict) -> float:
    """Median milliseconds of one training step of an adapted layer built with the config options ``fp8``
    (its memory is freed on return, before the other arm builds its own)."""
    torch.manual_seed(0)
    holder = nn.Module()  # the adapted layer is called directly below: no forward of its own needed
    holder.proj = nn.Linear(in_features, out_features, bias=False, device=device, dtype=torch.bfloat16)
    model = get_peft_model(holder, SitsLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["proj"], **fp8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    layer = model.base_model.model.proj
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        layer(x).backward(dy)

    step()
    if fp8:
        update_scaling(model)  # delayed scaling from here on: the steady state
    return gpu_seconds(step, rep_ms=200) * 1e3
