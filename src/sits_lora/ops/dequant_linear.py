"""The LoRA op over a frozen base held quantized: y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ, W never kept dense.

The base products (x Wᵀ in forward, dy W in backward) come from a *products* object that knows the
format (``sits_lora.ops.int4_linear``'s packed INT4; bitsandbytes' NF4 / FP4 in ``sits_lora.bases.bnb4``):

- ``forward_into(x, out)``: x Wᵀ for 2-D x, added to ``out`` when it is given, else a new tensor;
- ``backward_into(dy, out)``: dy W, the same way.

The LoRA branch runs on the shared kernels of ``fused`` (shrink, expand, the dy and x passes), as the bf16
op does. Saved for backward: the LoRA input, h (T x r), and the products object, which holds the packed
weight (a module's own tensors: no copy); backward forms W again. A format that forms W dense for the GEMM
writes it into :func:`shared_buffer`, one per (device, dtype) and grown to the largest layer: each product
writes it and reads it back on the same stream, so every layer can share it. That holds for one stream and one
thread per device (the training step's); products issued on another stream at the same time would need a buffer
of their own. ``dequant_lora_linear_reference`` is the same math in plain PyTorch, which also forms W per product.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .choice import fused_kernels

_buffers: dict[tuple, Tensor] = {}
_views: dict[tuple, Tensor] = {}   # (device, dtype, shape) -> a view of the current buffer: two aten calls saved a call


def shared_buffer(device: torch.device, dtype: torch.dtype, shape: tuple[int, int]) -> Tensor:
    """A (rows, cols) tensor in the device's shared dense-weight buffer: valid until the next product that
    writes it (the next quantized layer's call on that device)."""
    view = _views.get((device, dtype, shape))
    if view is not None:
        return view
    numel = shape[0] * shape[1]
    key = (torch.device(device), dtype)
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _buffers[key] = torch.empty(numel, device=device, dtype=dtype)
        _views.clear()   # views of the smaller buffer would keep it alive and stop sharing
    view = _views[(device, dtype, shape)] = buffer[:numel].view(shape)
    return view


class DenseProducts:
    """Base products through a dense W that ``dequantize(dtype)`` forms (in :func:`shared_buffer`), then
    cuBLAS: addmm_ onto the LoRA part, as the bf16 op does."""

    def __init__(self, dequantize):
        self.dequantize = dequantize

    def forward_into(self, x: Tensor, out: Optional[Tensor]) -> Tensor:
        w = self.dequantize(x.dtype)
        return torch.mm(x, w.t()) if out is None else out.addmm_(x, w.t())

    def backward_into(self, dy: Tensor, out: Optional[Tensor]) -> Tensor:
        w = self.dequantize(dy.dtype)
        return torch.mm(dy, w) if out is None else out.addmm_(dy, w)


class DequantLoraLinearFunction(torch.autograd.Function):
    """The op; ``lora_A`` / ``lora_B`` None gives the base alone (x Wᵀ + b)."""

    @staticmethod
    def forward(ctx, x, x_lora, lora_A, lora_B, bias, products: Any, out_features: int, scaling: float):
        kernels = fused_kernels()

        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if lora_A is not None:
            h = kernels.lora_shrink(x2 if x_lora is None else x_lora.reshape(-1, K), lora_A)
            y = kernels.lora_expand(h, lora_B, scaling, bias, x.dtype)
            products.forward_into(x2, y)
        else:
            h = None
            y = products.forward_into(x2, None)
            if bias is not None:
                y += bias
        ctx.save_for_backward(x if (lora_A is not None and x_lora is None) else None, x_lora, lora_A, lora_B, h)
        ctx.products, ctx.in_features, ctx.out_features, ctx.scaling = products, K, out_features, scaling
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*lead, out_features)

    @staticmethod
    def backward(ctx, grad_y):
        kernels = fused_kernels()

        x, x_lora, lora_A, lora_B, h = ctx.saved_tensors
        K, N, products = ctx.in_features, ctx.out_features, ctx.products
        lead = grad_y.shape[:-1]
        dy = grad_y.reshape(-1, N).contiguous()
        need_dx = ctx.needs_input_grad[0]
        dx = dx_lora = dA = dB = None
        if lora_A is None:
            dx = products.backward_into(dy, None) if need_dx else None
        else:
            g_part, db_part = kernels.lora_dy_pass_parts(dy, lora_B, h, ctx.scaling)
            if x_lora is not None:
                # dropout: the LoRA gradient belongs to x_lora; autograd applies the mask and adds it to dx
                da_part, dx_lora = kernels.lora_x_pass_parts(x_lora.reshape(-1, K), lora_A, g_part, ctx.scaling,
                                                             write_dx=True)
                if need_dx:
                    dx = products.backward_into(dy, None)
            else:
                da_part, dx = kernels.lora_x_pass_parts(x.reshape(-1, K), lora_A, g_part, ctx.scaling,
                                                        write_dx=need_dx)
                if need_dx:
                    products.backward_into(dy, dx)
            dA, dB = kernels.sum_partials(da_part, db_part)
            dA, dB = dA.to(lora_A.dtype), dB.to(lora_B.dtype)
        # a trainable bias (PEFT's bias="all" / "lora_only" on the base layer): the sum of dy over tokens
        db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.needs_input_grad[4] else None
        return (
            dx.view(*lead, K) if dx is not None else None,
            dx_lora.view(*lead, K) if dx_lora is not None else None,
            dA if ctx.needs_input_grad[2] else None,
            dB if ctx.needs_input_grad[3] else None,
            db, None, None, None,
        )


@torch.compiler.disable  # an eager autograd Function over Triton launches and a module-level buffer: not traced
def dequant_lora_linear(x: Tensor, x_lora: Optional[Tensor], lora_A: Optional[Tensor], lora_B: Optional[Tensor],
                        bias: Optional[Tensor], products, out_features: int, scaling: float) -> Tensor:
    """The fused op (Triton: a CUDA tensor, or the CPU under TRITON_INTERPRET=1). ``x_lora`` is x itself (the
    same tensor) or None without dropout."""
    return DequantLoraLinearFunction.apply(x, None if x_lora is x else x_lora, lora_A, lora_B, bias, products,
                                           out_features, float(scaling))


class DequantMatmulFunction(torch.autograd.Function):
    """x Wᵀ with W from a products object, forming W again in backward (the reference keeps no dense W)."""

    @staticmethod
    def forward(ctx, x, products: Any, out_features: int):
        ctx.products, ctx.in_features = products, x.shape[-1]
        return products.forward_into(x.reshape(-1, x.shape[-1]), None).view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_y):
        dy = grad_y.reshape(-1, grad_y.shape[-1])
        dx = ctx.products.backward_into(dy, None) if ctx.needs_input_grad[0] else None
        return (None if dx is None else dx.view(*grad_y.shape[:-1], ctx.in_features)), None, None


def dequant_lora_linear_reference(x: Tensor, x_lora: Optional[Tensor], lora_A: Optional[Tensor],
                                  lora_B: Optional[Tensor], bias: Optional[Tensor], products, out_features: int,
                                  scaling: float) -> Tensor:
    """The plain PyTorch path (any device): the base product through :class:`DequantMatmulFunction`, bias and
    LoRA branch as autograd ops in x's dtype."""
    y = DequantMatmulFunction.apply(x, products, out_features)
    if bias is not None:
        y = y + bias
    if lora_A is not None:
        x_lora = x if x_lora is None else x_lora
        y = y + (x_lora @ lora_A.t().to(x.dtype)) @ lora_B.t().to(x.dtype) * scaling
    return y


def release_shared_buffers() -> None:
    """Free the shared dense-weight buffers (after the last quantized layer is gone: merge, unload)."""
    _buffers.clear()
    _views.clear()
