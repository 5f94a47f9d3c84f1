"""SitsLoraLinear: PEFT's LoRA ``Linear`` whose common path runs through sits_lora.ops.

Parameter names, merge / unmerge, ``get_delta_weight``, mixed-batch ``adapter_names``, several
adapters, DoRA and the other LoRA variants are PEFT's, inherited unchanged. Only the plain training
and inference path (one active vanilla adapter over an ``nn.Linear``) is replaced by one call to
``sits_lora.ops.lora_linear``, which computes the base GEMM and the LoRA branch together; every
other case falls through to PEFT's own forward, so behaviour stays PEFT's.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any, Optional

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from . import ops


# Whether each device type has an autocast mode ("meta", used by plans and shape checks, has none).
# torch.amp.is_autocast_available is a builtin that torch.compile cannot trace on torch 2.11: asked in
# every layer it broke the graph in each of them (12 of the 22 breaks of a 2-layer Llama). A dict read is
# traced; the common types are asked here, once, and any other on its first eager call.
_AUTOCAST_AVAILABLE: dict[str, bool] = {t: torch.amp.is_autocast_available(t) for t in ("cpu", "cuda", "meta")}


def _autocast_on(device_type: str) -> bool:
    available = _AUTOCAST_AVAILABLE.get(device_type)
    if available is None:
        available = _AUTOCAST_AVAILABLE.setdefault(device_type, torch.amp.is_autocast_available(device_type))
    return available and torch.is_autocast_enabled(device_type)


def autocast_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """(x, weight, bias, context) as autocast would hand them to a linear layer.

    The fused path is an autograd Function, which autocast does not cast for: under autocast the
    input and the frozen weight are cast here to the autocast dtype (as autocast does for
    nn.Linear), and the Function then runs with autocast off so that its backward sees the same
    dtypes as its forward. Without autocast nothing changes.
    """
    device_type = "cuda" if x.is_cuda else x.device.type
    if not _autocast_on(device_type):
        return x, weight, bias, nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    return (x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
            torch.autocast(device_type, enabled=False))


class SitsLoraLinear(LoraLinear):
    # Per-adapter state that PEFT's delete_adapter / set_adapter must carry along.
    other_param_names = LoraLinear.other_param_names + ("sits_kernel",)
    # Set by SitsLoraModel for layers that read the same input as others (sits_lora.siblings).
    _sibling_group = None
    # Set by sits_lora.fp8 for layers whose base is fp8 (SitsLoraConfig.fp8 != 'off'): an Fp8Binding.
    _fp8 = None

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

    def _fused_adapter(self, args: tuple, kwargs: dict, base_type: type = nn.Linear) -> str | None:
        """The single active adapter the fused path can run, or None to use PEFT's forward.

        ``base_type``: the base layer class the fused path handles (sits_lora.fp8 passes its Fp8BaseLinear)."""
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
            or type(base) is not base_type
            or base._forward_hooks
            or base._forward_pre_hooks
        ):
            return None
        return adapter

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._fp8 is not None:
            return self._fp8.forward(self, x, *args, **kwargs)
        adapter = self._fused_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        if self._sibling_group is not None:
            out = self._sibling_group.forward(self, x)
            if out is not None:
                return out
        base = self.base_layer
        kernel = ops.resolve_kernel(self.sits_kernel[adapter], x)
        if kernel == "triton" and (base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)):
            kernel = "torch"  # the fused kernels assume a frozen base (no dW / db); the reference computes them
        x, weight, bias, autocast_off = autocast_inputs(x, base.weight, base.bias)
        dropout = self.lora_dropout[adapter]
        x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else x
        with autocast_off:
            return ops.lora_linear(
                x, x_lora, weight, bias, self.lora_A[adapter].weight, self.lora_B[adapter].weight,
                self.scaling[adapter], kernel,
            )

    def __repr__(self) -> str:
        return "sits_lora." + super().__repr__().removeprefix("lora.")
