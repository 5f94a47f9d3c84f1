"""The LoRA linear op as few ATen matmuls, for calls too small for the fused kernels' launches to pay.

A fused Triton call costs host time the GPU only hides when the GEMM is large enough: a diffusers U-Net's
LoRA layers (320-1280 features, 77-32768 tokens) are all smaller than that, so their step is as long as the
host's time to issue it (docs/diffusion.md). Here a call is three matmuls forward and five backward,
each one cuBLAS (or CPU BLAS) call with its scale in the GEMM's alpha, none of them an elementwise pass:

    forward   y = x Wᵀ + b          (addmm)            backward  g  = dy B                 (mm)
              h = x_lora Aᵀ         (mm)                         dx = dy W                 (mm)
              y += s · h Bᵀ         (addmm_, in place)           dx += s · g A             (addmm_, in place)
                                                                 dA = s · gᵀ x_lora        (addmm, beta = 0)
                                                                 dB = s · dyᵀ h            (addmm, beta = 0)

(PEFT's layer issues about twice as many ops for the same products.) h and g are in x's dtype, as in PEFT; the
fused path keeps h in fp32. ``sits_lora.ops.choice.small_call`` says which calls take this path. A call with nothing
to differentiate (inference, decoding) runs the three forward matmuls without the autograd Function around them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _forward(x, x_lora, weight, bias, lora_A, lora_B, scaling):
    """(y (..., N), and for backward: x_lora as (T, K), A and B in x's dtype, h)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    xl = x2 if x_lora is None else x_lora.reshape(-1, K)
    A = _in_dtype(lora_A, x.dtype)       # adapters kept in fp32 over a bf16 model compute in bf16, as PEFT's
    B = _in_dtype(lora_B, x.dtype)
    h = torch.mm(xl, A.t())
    y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
    y.addmm_(h, B.t(), alpha=scaling)
    return y.view(*x.shape[:-1], weight.shape[0]), xl, A, B, h


class LoraLinearAtenFunction(torch.autograd.Function):
    """y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ with a frozen W and b; x_lora None means the LoRA input is x."""

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_A, lora_B, scaling):
        y, xl, A, B, h = _forward(x, x_lora, weight, bias, lora_A, lora_B, scaling)
        ctx.save_for_backward(xl, weight, A, B, h)
        ctx.scaling = scaling
        ctx.separate_lora_input = x_lora is not None
        ctx.adapter_dtypes = (lora_A.dtype, lora_B.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xl, weight, A, B, h = ctx.saved_tensors
        s = ctx.scaling
        lead, K = grad_y.shape[:-1], weight.shape[1]
        dy = grad_y.reshape(-1, grad_y.shape[-1])
        if dy.dtype != h.dtype:
            dy = dy.to(h.dtype)
        need_x, need_xl, _, _, need_a, need_b, _ = ctx.needs_input_grad
        need_lora_in = need_xl if ctx.separate_lora_input else need_x
        dx = dx_lora = dA = dB = None
        g = torch.mm(dy, B) if (need_lora_in or need_a) else None
        if need_x:
            dx = torch.mm(dy, weight)
            if not ctx.separate_lora_input:
                dx.addmm_(g, A, alpha=s)
        if need_lora_in and ctx.separate_lora_input:
            dx_lora = torch.mm(g, A).mul_(s).view(*lead, K)
        # addmm with beta = 0 ignores its first argument (used for its shape only): s·(product) in one call
        if need_a:
            dA = _in_dtype(torch.addmm(A, g.t(), xl, beta=0, alpha=s), ctx.adapter_dtypes[0])
        if need_b:
            dB = _in_dtype(torch.addmm(B, dy.t(), h, beta=0, alpha=s), ctx.adapter_dtypes[1])
        return (None if dx is None else dx.view(*lead, K)), dx_lora, None, None, dA, dB, None


def lora_linear_aten(x: Tensor, x_lora: Optional[Tensor], weight: Tensor, bias: Optional[Tensor], lora_A: Tensor,
                     lora_B: Tensor, scaling: float) -> Tensor:
    """The few-matmul path; pass x_lora=x (or None) when there is no dropout. W and b must be frozen."""
    x_lora = None if x_lora is x else x_lora
    if not torch.is_grad_enabled() or not (x.requires_grad or lora_A.requires_grad or lora_B.requires_grad
                                           or (x_lora is not None and x_lora.requires_grad)):
        # nothing to differentiate (inference, decoding): the same three matmuls without the autograd Function's
        # bookkeeping, host time that every call of a decode step would otherwise pay
        return _forward(x, x_lora, weight, bias, lora_A, lora_B, float(scaling))[0]
    return LoraLinearAtenFunction.apply(x, x_lora, weight, bias, lora_A, lora_B, float(scaling))
