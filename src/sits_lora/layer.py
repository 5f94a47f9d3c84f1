"""SitsLoraLinear: PEFT's LoRA ``Linear`` whose common path runs through sits_lora.ops.

Parameter names, merge / unmerge, ``get_delta_weight``, mixed-batch ``adapter_names``, several
adapters, DoRA and the other LoRA variants are PEFT's, inherited unchanged. Only the plain training
and inference path (one active vanilla adapter over the frozen base's module) is replaced by one call
to the frozen base's fused path (``sits_lora.bases``), which computes the base GEMM and the LoRA branch
together; every other case falls through to PEFT's own forward, so behaviour stays PEFT's.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from .bases import BF16_BASE


class SitsLoraLinear(LoraLinear):
    # Per-adapter state that PEFT's delete_adapter / set_adapter must carry along.
    other_param_names = LoraLinear.other_param_names + ("sits_kernel",)
    # Set by SitsLoraModel for layers that read the same input as others (sits_lora.siblings).
    _sibling_group = None
    # The frozen base's fused path (sits_lora.bases): plain nn.Linear unless a feature quantizes the base
    # (sits_lora.fp8 sets an Fp8Base). A plain object, not a submodule: it holds no parameters.
    frozen_base = BF16_BASE

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        self.sits_kernel: dict[str, str] = {}
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        smaller = min(self.in_features, self.out_features)
        if r > smaller:
            # PEFT accepts such adapters (a 2-way classifier head at r=8; add_weighted_adapter's "cat" sums
            # ranks), so a drop-in must too: it works, it only holds more parameters than the update can use
            target_name = kwargs.get("target_name") or "<this layer>"
            warnings.warn(
                f"adapter {adapter_name!r}: r={r} is larger than the smaller dimension ({smaller}) of layer "
                f"'{target_name}' (in_features={self.in_features}, out_features={self.out_features}); the update "
                f"has rank at most {smaller} there. It trains as in PEFT; rank_pattern={{'"
                f"{target_name.rsplit('.', 1)[-1]}': {smaller}}} would hold the same update in fewer parameters.",
                stacklevel=2,
            )
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        self.sits_kernel[adapter_name] = getattr(config, "kernel", "auto")

    def _fused_adapter(self, args: tuple, kwargs: dict) -> str | None:
        """The single active adapter the frozen base's fused path can run, or None to use PEFT's forward."""
        if self.disable_adapters or self.merged or args:
            return None
        if kwargs and any(v is not None for v in kwargs.values()):  # adapter_names and the like
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1:
            return None
        adapter = active[0]
        base = self.base_layer
        if (
            adapter in self.lora_variant
            or self.lora_bias[adapter]
            or self.fan_in_fan_out
            or type(base) is not self.frozen_base.module_type
            or base._forward_hooks
            or base._forward_pre_hooks
        ):
            return None
        return adapter

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._fused_adapter(args, kwargs)
        if adapter is None:
            # PEFT's own forward (an fp8 base module then runs its fp8 GEMM with current scaling)
            return super().forward(x, *args, **kwargs)
        return self.frozen_base.fused_forward(self, adapter, x)

    def __repr__(self) -> str:
        return "sits_lora." + super().__repr__().removeprefix("lora.")
