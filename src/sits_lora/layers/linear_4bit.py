"""SitsLoraLinear4bit: PEFT's LoRA layer over a bitsandbytes 4-bit base, with sits_lora's fused path.

PEFT's ``lora.bnb.Linear4bit`` keeps everything it does (merge into the 4-bit weight by dequantize, add and
requantize; several adapters; mixed batches; DoRA and the other variants); only the plain path (one active
vanilla adapter) runs the frozen base's fused path (``sits_lora.bases.bnb4``) instead of bitsandbytes' own
matmul plus a separate LoRA branch. Importing this module imports bitsandbytes.
"""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import torch
from peft.tuners.lora.bnb import Linear4bit

from ..bases.bnb4 import BNB4_BASE
from .forward_plan import plan_forward
from .linear import FusedAdapterChoice


class SitsLoraLinear4bit(FusedAdapterChoice, Linear4bit):
    other_param_names = Linear4bit.other_param_names + ("sits_kernel",)
    frozen_base = BNB4_BASE

    def __init__(self, base_layer: torch.nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                 **kwargs):
        self.sits_kernel: dict[str, str] = {}
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)
        # On a CPU with AVX512-BF16, bitsandbytes' eval-mode forward repacks the weight in place for its bf16 CPU
        # kernel; after that dequantize_4bit (which the fused path, merges and PEFT read the weight through)
        # returns wrong values without an error. The repacking is only a CPU inference speed-up: turned off.
        base = self.get_base_layer()
        if getattr(base, "support_avx512bf16_for_cpu", False):
            base.support_avx512bf16_for_cpu = False
        _undo_cpu_repacking(base)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        self.sits_kernel[adapter_name] = getattr(config, "kernel", "auto")

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plan = plan_forward(self, x, args, kwargs)
        if plan.path != "fused":
            # PEFT's QLoRA forward for every other path (no sits_lora variant runs on a 4-bit base; bitsandbytes'
            # matmul saves its own tensors, so no input rebuild)
            return super().forward(x, *args, **kwargs)
        hooks = self.input_recompute.saving(x) if plan.rebuild_input else None   # as SitsLoraLinear's
        if hooks is None:
            return self.frozen_base.fused_forward(self, plan, x)
        with hooks:
            return self.frozen_base.fused_forward(self, plan, x)

    def __repr__(self) -> str:
        return "sits_lora." + super().__repr__().removeprefix("lora.")


def _undo_cpu_repacking(base) -> None:
    """A weight that an eval forward on such a CPU already repacked (the model evaluated before get_peft_model)
    gets its bitsandbytes layout back, as bitsandbytes does itself before ``.cuda()`` and ``state_dict()``."""
    weight = base.weight
    if not getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
        return
    inverse = getattr(bnb.functional, "_convert_weight_packed_for_cpu_inverse", None)
    if inverse is None:
        raise RuntimeError("this bitsandbytes 4-bit weight was repacked for bitsandbytes' CPU kernel (an eval-mode "
                           "forward on a CPU with AVX512-BF16) and this bitsandbytes has no inverse: load the model "
                           "again and call get_peft_model before evaluating it")
    weight.data, weight.quant_state = inverse(weight.data, weight.quant_state)
    base.quant_state = weight.quant_state
