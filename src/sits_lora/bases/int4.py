"""The INT4 frozen base: the weight stored once as packed 4-bit codes with per-group scales and mins.

:class:`Int4BaseLinear` is the base module (``layer.base_layer``) of an INT4 layer; :class:`Int4Base` is the
layer's ``frozen_base``, which runs the base products from the packed codes and the LoRA branch on the
fused kernels (``sits_lora.ops.int4_linear``). Which layers get it is decided by ``sits_lora.int4``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
from torch import nn

from .. import ops
from ..ops import int4_linear as int4_ops
from .bf16 import autocast_dtype, autocast_inputs


def compute_inputs(x: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
    """(x, bias, context) in the dtype a quantized base computes in: autocast's when it is on (as for an
    nn.Linear; the context turns it off inside the op), else ``dtype`` (the dtype W is rebuilt in)."""
    cast, _, cast_bias, autocast_off = autocast_inputs(x, None, bias)
    if not isinstance(autocast_off, nullcontext):  # autocast is on: its dtype, and the context that turns it off
        return cast, cast_bias, autocast_off
    x = x if x.dtype == dtype else x.to(dtype)
    return x, (bias if bias is None or bias.dtype == dtype else bias.to(dtype)), nullcontext()


class Int4BaseLinear(nn.Linear):
    """A frozen ``nn.Linear`` whose ``weight`` holds packed INT4 codes (out_features, Kp / 2) uint8.

    W ≈ codes · ``weight_scales`` + ``weight_mins`` per group of ``group_size`` input features (the format:
    ``sits_lora.ops.int4_linear``); Kp is in_features rounded up to 64, so each packed row is 32-byte aligned.
    Called on its own (PEFT's paths: disabled adapters, several active adapters, mixed batches) it computes
    x Wᵀ + b from the codes. ``module.to(dtype)`` moves the codes but never casts them; the scales follow the
    dtype (they are the dtype W is rebuilt in).
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "Int4BaseLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        packed, scales, mins = int4_ops.int4_pack(linear.weight, group_size)
        new.weight = nn.Parameter(packed, requires_grad=False)
        new.bias = linear.bias
        new.register_buffer("weight_scales", scales)
        new.register_buffer("weight_mins", mins)
        new.group_size = group_size
        new.int4_mode = "auto"
        new.train(linear.training)
        return new

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.weight_scales.dtype

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """W (out_features, in_features) in ``dtype`` (the scales' dtype by default), by PyTorch."""
        return int4_ops.int4_unpack_reference(self.weight, self.weight_scales, self.weight_mins, self.in_features,
                                              dtype or self.compute_dtype)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the dequantized weight (used by merge and unload)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.dequantized_weight(), requires_grad=False)
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def packed_bytes(self) -> int:
        """Bytes this base holds for W: codes, scales and mins (not the bias)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scales, self.weight_mins))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, bias, autocast_off = compute_inputs(x, self.bias, self.compute_dtype)
        kernel = ops.resolve_kernel("auto", x, self.out_features)
        with autocast_off:
            return int4_ops.int4_lora_linear(x, None, None, None, bias, self.weight, self.weight_scales,
                                             self.weight_mins, self.in_features, 0.0, kernel, self.int4_mode)

    def _apply(self, fn, recurse=True):
        codes = self.weight.data
        result = super()._apply(fn, recurse)
        if self.weight.dtype != torch.uint8:  # a dtype cast reached the codes: keep the codes, moved only
            self.weight = nn.Parameter(codes.to(self.weight.device), requires_grad=False)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int4 group_size={self.group_size}")


class Int4Base:
    """The fused path of a SitsLoraLinear whose base module is an :class:`Int4BaseLinear` (stateless: one
    instance, :data:`INT4_BASE`, serves every layer)."""

    module_type = Int4BaseLinear
    fuses_siblings = False  # the sibling op reads a dense W; each INT4 layer runs its own products
    kernels = ("triton", "torch")   # the implementations a plan may name (sits_lora.layers.forward_plan)
    decodes = staticmethod(lambda layer, x, dtype: False)
    trains_weight = staticmethod(lambda layer: False)

    @staticmethod
    def kernel_dtype(layer, x: torch.Tensor) -> torch.dtype:
        """The dtype the products run in (compute_inputs): autocast's, else the one W is rebuilt in."""
        return autocast_dtype(x) or layer.base_layer.compute_dtype

    def fused_forward(self, layer, plan, x: torch.Tensor) -> torch.Tensor:
        adapter, kernel = plan.adapter, plan.kernel
        base = layer.base_layer
        x, bias, autocast_off = compute_inputs(x, base.bias, base.compute_dtype)
        dropout = layer.lora_dropout[adapter]
        x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else x
        with autocast_off:
            return int4_ops.int4_lora_linear(x, x_lora, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                                             bias, base.weight, base.weight_scales, base.weight_mins,
                                             base.in_features, layer.scaling[adapter], kernel, base.int4_mode)

    def __repr__(self) -> str:
        return "INT4_BASE"


INT4_BASE = Int4Base()
