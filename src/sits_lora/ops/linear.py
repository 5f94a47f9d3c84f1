"""The LoRA linear op: y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ on the fused kernels, forward and backward.

``lora_linear_forward`` / ``lora_linear_backward`` drive the kernels of ``fused`` on 2-D tensors (the
launch plan is in ``fused``'s docstring). Around them: one torch custom op, ``sits_lora::lora_linear``
with ``sits_lora::lora_linear_backward``, registered with ``torch.library`` so that ``torch.compile``
sees one opaque node per layer instead of breaking the graph, and ``LoraLinearFunction``, the same
forward and backward without the op dispatcher, which eager mode calls. ``lora_linear`` picks the
reference or this path. The Triton kernels load on first use (Triton is optional: the reference runs
without it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .aten import lora_linear_aten
from .choice import KernelUnavailableError, fused_kernels, gemm_backend
from .reference import ProductInput, lora_linear_torch


def lora_linear_forward(x, x_lora, weight, bias, lora_A, lora_B, scale: float, gemm: str):
    """(y, h) for 2-D x (T, K): y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ, h = x_lora Aᵀ (fp32).

    x_lora None means the LoRA input is x itself (no dropout).
    """
    kernels = fused_kernels()

    h = kernels.lora_shrink(x if x_lora is None else x_lora, lora_A)
    if gemm == "triton":
        y = kernels.lora_gemm(x, weight.t(), h, lora_B.t(), scale, bias, x.dtype)
    else:
        y = kernels.lora_expand(h, lora_B, scale, bias, x.dtype)
        y.addmm_(x, weight.t())          # cuBLAS with beta = 1: the epilogue reads C, no extra pass
    return y, h


def lora_linear_backward(dy, x, x_lora, weight, lora_A, lora_B, h, scale: float, gemm: str, need_dx: bool):
    """(dx, dx_lora, dA, dB) for 2-D tensors; dx_lora is None unless x_lora is given, dx None unless needed.
    ``x`` may be a ProductInput (x is read only by the x pass, which forms it from the factors).

    Launches, cuBLAS path without dropout: the dy pass, the x pass (which sums g's partials and writes
    s·g A into dx), one launch summing dA's and dB's partials, and cuBLAS adding dy W into dx."""
    kernels = fused_kernels()

    g_part, db_part = kernels.lora_dy_pass_parts(dy, lora_B, h, scale)
    if gemm == "triton" and x_lora is None:
        g = kernels.sum_leading(g_part)
        da_part, _ = kernels.lora_x_pass_parts(x, lora_A, g, scale, write_dx=False)
        dx = kernels.lora_gemm(dy, weight, g, lora_A, scale, None, dy.dtype) if need_dx else None
        dA, dB = kernels.sum_partials(da_part, db_part)
        return dx, None, dA, dB
    dx = dx_lora = None
    if x_lora is not None:
        # dropout: the LoRA gradient belongs to x_lora, autograd applies the mask and adds it to dx
        da_part, dx_lora = kernels.lora_x_pass_parts(x_lora, lora_A, g_part, scale, write_dx=True)
        if need_dx:
            dx = kernels.lora_gemm(dy, weight, None, None, 0.0, None, dy.dtype) if gemm == "triton" else dy @ weight
    else:
        da_part, dx = kernels.lora_x_pass_parts(x, lora_A, g_part, scale, write_dx=need_dx)
        if need_dx:
            dx.addmm_(dy, weight)   # cuBLAS with beta = 1 adds dy W to the LoRA part already in dx
    dA, dB = kernels.sum_partials(da_part, db_part)
    return dx, dx_lora, dA, dB


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("sits_lora::lora_linear", mutates_args=())
def _lora_linear_op(
    x: Tensor, x_lora: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
    lora_A: Tensor, lora_B: Tensor, scaling: float, gemm: str,
) -> tuple[Tensor, Tensor]:
    K = x.shape[-1]
    y, h = lora_linear_forward(
        x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
        weight, bias, lora_A, lora_B, scaling, gemm,
    )
    return y.view(*x.shape[:-1], weight.shape[0]), h


@_lora_linear_op.register_fake
def _(x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm):
    tokens = x.numel() // x.shape[-1]
    return x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(tokens, lora_A.shape[0], dtype=torch.float32)


@torch.library.custom_op("sits_lora::lora_linear_backward", mutates_args=())
def _lora_linear_backward_op(
    grad_out: Tensor, x: Optional[Tensor], x_lora: Optional[Tensor], weight: Tensor,
    lora_A: Tensor, lora_B: Tensor, h: Tensor, scaling: float, gemm: str, need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dx_lora, dA, dB); an output that was not asked for is an empty tensor."""
    N = grad_out.shape[-1]
    K = weight.shape[1]
    lead = grad_out.shape[:-1]
    dx, dx_lora, dA, dB = lora_linear_backward(
        grad_out.reshape(-1, N), None if x is None else x.reshape(-1, K),
        None if x_lora is None else x_lora.reshape(-1, K),
        weight, lora_A, lora_B, h, scaling, gemm, need_dx,
    )
    return (
        grad_out.new_empty(0) if dx is None else dx.view(*lead, K),
        grad_out.new_empty(0) if dx_lora is None else dx_lora.view(*lead, K),
        dA.to(lora_A.dtype),
        dB.to(lora_B.dtype),
    )


@_lora_linear_backward_op.register_fake
def _(grad_out, x, x_lora, weight, lora_A, lora_B, h, scaling, gemm, need_dx):
    lead = grad_out.shape[:-1]
    K = weight.shape[1]
    return (
        grad_out.new_empty(*lead, K) if need_dx else grad_out.new_empty(0),
        grad_out.new_empty(*lead, K) if x_lora is not None else grad_out.new_empty(0),
        lora_A.new_empty(lora_A.shape),
        lora_B.new_empty(lora_B.shape),
    )


def _setup_context(ctx, inputs, output):
    x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm = inputs
    _, h = output
    # Saved: the LoRA input once (x, or x_lora under dropout), the weights (no copies) and h (T x r).
    ctx.save_for_backward(x if x_lora is None else None, x_lora, weight, lora_A, lora_B, h)
    ctx.scaling = scaling
    ctx.gemm = gemm


def _backward(ctx, grad_y, grad_h):
    x, x_lora, weight, lora_A, lora_B, h = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    dx, dx_lora, dA, dB = _lora_linear_backward_op(
        grad_y.contiguous(), x, x_lora, weight, lora_A, lora_B, h, ctx.scaling, ctx.gemm, need_dx
    )
    return (
        dx if need_dx else None,
        dx_lora if x_lora is not None else None,
        None, None,
        dA if ctx.needs_input_grad[4] else None,
        dB if ctx.needs_input_grad[5] else None,
        None, None,
    )


_lora_linear_op.register_autograd(_backward, setup_context=_setup_context)


def lora_input_grads(ctx, lead, K: int, dx, dx_lora, dA, dB, lora_A, lora_B) -> tuple:
    """Gradients of (x, x_lora, weight, bias, lora_A, lora_B), the inputs the LoRA Functions start with."""
    return (
        dx.view(*lead, K) if ctx.needs_input_grad[0] else None,
        dx_lora.view(*lead, K) if dx_lora is not None else None,
        None, None,
        _as_dtype(dA, lora_A.dtype) if ctx.needs_input_grad[4] else None,
        _as_dtype(dB, lora_B.dtype) if ctx.needs_input_grad[5] else None,
    )


def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    # .to with the dtype it already has still goes through the dispatcher: skipped for fp32 adapters, the common case
    return t if t.dtype == dtype else t.to(dtype)


def _forward_2d(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, gemm: str):
    """(y with x's leading dims, h): lora_linear_forward on x flattened to 2-D."""
    K = x.shape[-1]
    y, h = lora_linear_forward(x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
                               weight, bias, lora_A, lora_B, scaling, gemm)
    return y.view(*x.shape[:-1], weight.shape[0]), h


def _backward_2d(ctx, grad_y, x, x_lora, weight, lora_A, lora_B, h, gemm: str):
    """Gradients of the LoRA Functions' first six inputs: lora_linear_backward on 2-D views."""
    N, K = weight.shape
    dx, dx_lora, dA, dB = lora_linear_backward(
        grad_y.reshape(-1, N), None if x is None else x.reshape(-1, K),
        None if x_lora is None else x_lora.reshape(-1, K),
        weight, lora_A, lora_B, h, ctx.scaling, gemm, ctx.needs_input_grad[0],
    )
    return lora_input_grads(ctx, grad_y.shape[:-1], K, dx, dx_lora, dA, dB, lora_A, lora_B)


class LoraLinearFunction(torch.autograd.Function):
    """The same forward and backward as the custom op, without the op dispatcher in between.

    Eager mode calls this: torch.library's Python dispatch costs tens of microseconds per call,
    which is not hidden behind a layer's GPU time when the layer is small. Under torch.compile the
    custom op is used instead (dynamo needs an op it can put in the graph).
    """

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm, product=None):
        y, h = _forward_2d(x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm)
        if product is None:
            _setup_context(ctx, (x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm), (None, h))
            ctx.product_silu = None
        else:
            # x is the product of two tensors that the frozen model keeps for its own backward: saving those costs
            # no memory, and the x pass forms x from them as it reads (no rebuilt x written and read back)
            ctx.save_for_backward(product.gate, product.up, weight, lora_A, lora_B, h)
            ctx.scaling, ctx.gemm, ctx.product_silu = scaling, gemm, product.silu
        return y

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.product_silu is None:
            x, x_lora, weight, lora_A, lora_B, h = ctx.saved_tensors
        else:
            gate, up, weight, lora_A, lora_B, h = ctx.saved_tensors
            x, x_lora = ProductInput(gate, up, ctx.product_silu), None
        grads = _backward_2d(ctx, grad_y, x, x_lora, weight, lora_A, lora_B, h, ctx.gemm)
        return (*grads, None, None, None)


def lora_linear_triton(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, gemm: Optional[str] = None,
                       product: Optional[ProductInput] = None) -> Tensor:
    """The fused Triton path. x_lora None: the LoRA input is x (no dropout); ``product``: see lora_linear."""
    gemm = gemm or gemm_backend()
    if torch.compiler.is_compiling():
        y, _ = _lora_linear_op(x, x_lora, weight, bias, lora_A, lora_B, float(scaling), gemm)
        return y
    if x_lora is not None:
        product = None
    return LoraLinearFunction.apply(x, x_lora, weight, bias, lora_A, lora_B, float(scaling), gemm, product)


def lora_linear(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, kernel: str = "torch",
                product: Optional[ProductInput] = None) -> Tensor:
    """y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ with the resolved kernel ("torch", "triton" or "aten", ops.aten).

    Pass ``x_lora=x`` (the same tensor) when there is no dropout; the Triton path then fuses the
    LoRA gradient into dx and keeps one saved activation. ``product``: x's value as two factors that the frozen
    model keeps (sits_lora.activations finds them); the eager Triton path without dropout then saves the factors
    instead of x and its x pass reads them. The other paths ignore it and save x.
    """
    if kernel == "torch":
        return lora_linear_torch(x, x_lora, weight, bias, lora_A, lora_B, scaling)
    if kernel == "aten":
        return lora_linear_aten(x, x_lora, weight, bias, lora_A, lora_B, scaling)
    if kernel == "triton":
        return lora_linear_triton(x, None if x_lora is x else x_lora, weight, bias, lora_A, lora_B, scaling,
                                  product=product)
    raise KernelUnavailableError(f"unknown kernel {kernel!r}")
