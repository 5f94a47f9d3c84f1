"""Fp8BaseLinear: a frozen ``nn.Linear`` whose weight is stored once as e4m3 codes and their scale."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops import fp8 as fp8_ops


class Fp8BaseLinear(nn.Linear):
    """The frozen base layer of an fp8 adapter: ``weight`` holds e4m3 codes (N, K), not values.

    W ≈ weight · weight_scale_inv, with ``weight_scale_inv`` fp32 of shape (1,) (per tensor) or
    (N,) (per output row). ``weight_bf16`` keeps the original weight when the config asks for it
    (``fp8_keep_bf16_weight=True``), else it is None and the original is freed.

    Called on its own (PEFT's paths: disabled adapters, several active adapters, mixed batches) it
    runs the fp8 GEMM with each tensor's own scale (current scaling); the delayed-scaling path of a
    single active adapter lives in :mod:`sits_lora.fp8.layer`. ``module.to(dtype)`` / ``.half()``
    move the codes between devices but never cast them (a cast would drop their scale).
    """

    weight_bf16: Optional[torch.Tensor]

    @classmethod
    def from_linear(cls, linear: nn.Linear, granularity: str, keep_bf16: bool, grad_dtype: torch.dtype,
                    margin: int, emulate: bool) -> "Fp8BaseLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        w8, w_inv = fp8_ops.quantize_weight(linear.weight, granularity)
        new.weight = nn.Parameter(w8, requires_grad=False)
        new.bias = linear.bias
        new.register_buffer("weight_scale_inv", w_inv)
        # the kept copy duplicates the checkpoint's own tensor: not part of the state dict
        new.register_buffer("weight_bf16", linear.weight.detach() if keep_bf16 else None, persistent=False)
        new.fp8_orig_dtype = linear.weight.dtype
        new.fp8_weight_scale = granularity
        new.fp8_grad_dtype = grad_dtype
        new.fp8_margin = margin
        new.fp8_emulate = emulate
        new.train(linear.training)
        return new

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in its original dtype: the kept original if there is one, else codes x scale."""
        if self.weight_bf16 is not None:
            return self.weight_bf16
        return fp8_ops.dequantize_weight(self.weight, self.weight_scale_inv, self.fp8_orig_dtype)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with :meth:`dequantized_weight` (used by merge and unload)."""
        weight = self.dequantized_weight()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.detach().clone() if self.weight_bf16 is None else weight,
                                     requires_grad=False)
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .layer import check_fp8_device

        check_fp8_device(x, self.fp8_emulate)
        scales = {"delayed": False, "scale": None, "scale_inv": None, "amax": None, "margin": self.fp8_margin,
                  "grad_dtype": self.fp8_grad_dtype, "emulate": self.fp8_emulate}
        return fp8_ops.fp8_lora_linear(x, None, None, None, self.weight, self.weight_scale_inv, self.bias, 0.0, scales)

    def _apply(self, fn, recurse=True):
        codes = self.weight.data
        scale = self.weight_scale_inv
        result = super()._apply(fn, recurse)
        if self.weight.dtype != codes.dtype:
            device = self.weight.device
            self.weight = nn.Parameter(codes.to(device), requires_grad=False)
            self.weight_scale_inv = scale.to(device)
        return result

    def extra_repr(self) -> str:
        kept = ", bf16 weight kept" if self.weight_bf16 is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3 per {self.fp8_weight_scale}{kept}")
