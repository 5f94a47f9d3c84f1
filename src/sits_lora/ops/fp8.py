"""FP8 frozen base for the LoRA linear layer: the fp8 GEMMs, the forward and backward, the autograd Functions and
the custom ops; the casts, their kernel and the weight's quantization are in ``fp8_cast`` (re-exported here).

Notation as in ``reference``: x (T, K), the frozen weight W (N, K) stored once as e4m3 codes W8 with
w_inv (one dequantization factor, or one per output row), A (R, K), B (N, R), s the LoRA scaling.

Numerics (the same on the GPU and in emulation; Transformer Engine's DelayedScaling semantics):

    scale   = (fp8_max / amax) / 2**margin, amax from the history (delayed) or from the tensor itself
    cast    q = clamp(v · scale, ±fp8_max) rounded to nearest-even in the fp8 format; a non-finite v
            gives NaN, so a NaN / Inf activation reaches the output and the NaN/Inf policy sees it
    forward y  = bf16( (x8 · W8ᵀ) · x_inv · w_inv ) + s·h Bᵀ + b      h = x_lora Aᵀ in fp32
    dX         = (dy8 · W8) · dy_inv [· w_inv]                          + s·g A,  g = dy B
            with per-row weight scales, w_inv[n] multiplies dy's column n before the cast (the
            reduction runs over n, where _scaled_mm takes no scale)
    LoRA    dA = s·gᵀ x_lora, dB = s·dyᵀ h from the bf16 x and dy (the fused kernels of ``fused``)

On the GPU one Triton pass casts x (forward) or dy (backward) to fp8 and atomically records its
absolute maximum for the next scale; the base GEMMs run through ``torch._scaled_mm`` (K and N
multiples of 16, the second operand column-major); the LoRA output is added to the GEMM's output
in place by one more pass (``lora_expand_add_``), the traffic of the bf16 path's cuBLAS epilogue.
fp8 tensor cores read both operands K-major, so dX needs W8 transposed: one copy of N·K bytes per
backward call, by a tiled Triton transpose (``transpose_fp8``), which reads and writes coalesced tiles
where ``w8.t().contiguous()`` runs far below the copy bandwidth and costs a good part of the dX GEMM it
feeds (docs/fp8.md); keeping both layouts would double the frozen weight's memory.

Emulation (``emulate=True``): the same casts in plain PyTorch, products in fp32 on dequantized
values; runs anywhere, used by CPU tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from .fp8_cast import (
    E4M3, E5M2, FP8_MAX, current_scale, dequantize_weight, fp8_amax, fp8_cast, fp8_cast_reference, quantize_weight,
    scale_from_amax, transpose_fp8, weight_scale,
)
from .fused import lora_dy_pass_parts, lora_expand, lora_gemm, lora_shrink, lora_x_pass_parts, sum_partials

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_MAX",
    "Fp8LoraLinearFunction",
    "current_scale",
    "dequantize_weight",
    "fp8_amax",
    "fp8_cast",
    "fp8_cast_reference",
    "fp8_dequant_lora_linear",
    "fp8_lora_linear",
    "lora_expand_add_",
    "quantize_weight",
    "scale_from_amax",
    "transpose_fp8",
    "triton_fp8_matmul",
    "weight_scale",
]

# ----------------------------------------------------------------------------- a Triton fp8 GEMM (the candidate)
#
# The fp8 GEMMs run on torch._scaled_mm (cuBLAS) unless a Triton one measures faster. This is the candidate that
# bench/fp8_gemms.py times against cuBLAS; the layer does not use it. What it could win: dX reading W8 as
# stored (no transpose per backward) and, later, the LoRA term in its epilogue (no expand launch).


def triton_fp8_matmul(a8: torch.Tensor, b8: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
                      out_dtype: torch.dtype = torch.bfloat16, config: Optional[dict] = None) -> torch.Tensor:
    """(a8 @ b8) · a_inv · b_inv in ``out_dtype``: a8 (M, K), b8 (K, N) fp8 of any strides (pass W8.t() for
    the forward x8 W8ᵀ, W8 itself for dX = dy8 W8), per-tensor scales a_inv, b_inv fp32 (1,)."""
    if a8.shape[1] != b8.shape[0]:
        raise ValueError(f"inner dimensions differ: a8 is {tuple(a8.shape)}, b8 is {tuple(b8.shape)}")
    # 128 x 128 x 128 tiles on a GPU (fp8 tensor cores take K in steps of 32); 16-wide on the interpreter
    cfg = config or (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4) if a8.is_cuda
                     else dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2))
    # the LoRA GEMM of ``fused`` with its fp8 dequantization step; its epilogue could add the LoRA term too
    return lora_gemm(a8, b8, None, None, 0.0, None, out_dtype, config=cfg, scales=(a_inv, b_inv))


# ----------------------------------------------------------------------------- expand, added in place


def lora_expand_add_(c: torch.Tensor, h: torch.Tensor, lora_B: torch.Tensor, scale: float,
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """c += s·h Bᵀ + bias in place and return c. c (T, N), h (T, R) fp32 or its partial sums (P, T, R),
    B (N, R) any strides."""
    return lora_expand(h, lora_B, float(scale), bias, c.dtype, add_to=c)


# ----------------------------------------------------------------------------- forward and backward

_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, device=device, dtype=torch.float32)
    return one


def _is_row(w_inv: torch.Tensor) -> bool:
    return w_inv.numel() != 1


def fp8_linear_forward(x, x_lora, w8, w_inv, bias, lora_A, lora_B, scaling: float,
                       x_scale, x_inv, x_amax, emulate: bool):
    """(y, h) for 2-D x (T, K): y = x8 W8ᵀ · x_inv · w_inv + s·(x_lora Aᵀ) Bᵀ + b, h = x_lora Aᵀ (fp32).

    x_lora None: the LoRA input is x. lora_A None: no LoRA branch (h is None). x_amax: fp32 (1,)
    that max|x| is recorded into, or None.
    """
    T, K = x.shape
    N = w8.shape[0]
    row = _is_row(w_inv)
    lora_in = x if x_lora is None else x_lora
    if emulate:
        x8 = fp8_cast_reference(x, x_scale, x_amax, E4M3)
        acc = x8.float() @ w8.float().t()                                      # (T, N) fp32
        y = (acc * x_inv[:1] * (w_inv.reshape(1, N) if row else w_inv[:1])).to(x.dtype)
        if lora_A is None:
            return (y if bias is None else (y.float() + bias.float()).to(x.dtype)), None
        h = lora_in.to(lora_A.dtype) @ lora_A.t()                              # (T, R)
        out = y.float() + (h.float() @ lora_B.float().t()) * scaling
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype), h.float()
    x8 = fp8_cast(x, x_scale, x_amax, E4M3)
    if row:
        # row-wise _scaled_mm: scale_a (T, 1) and scale_b (1, N), both contiguous fp32
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_inv[:1].expand(T, 1).contiguous(),
                             scale_b=_cublas_scale(w_inv.view(1, N)), out_dtype=x.dtype, use_fast_accum=True)
    else:
        # fast accumulation in forward, as torchao does; gradients below accumulate exactly
        y = torch._scaled_mm(x8, w8.t(), scale_a=_cublas_scale(x_inv[:1]), scale_b=_cublas_scale(w_inv[:1]),
                             out_dtype=x.dtype, use_fast_accum=True)
    if lora_A is None:
        return (y if bias is None else y.add_(bias)), None
    h = lora_shrink(lora_in, lora_A)
    lora_expand_add_(y, h, lora_B, scaling, bias)
    return y, h


def _cublas_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scale as torch._scaled_mm may pass it to cuBLAS: 16-byte aligned.

    cuBLAS (CUDA 13) rejects an fp8 GEMM whose scale pointer is not 16-byte
    aligned with CUBLAS_STATUS_NOT_SUPPORTED. The scaling state pads its 1/scale entries to 16 bytes
    (Fp8ScalingState.scale_inv), so the layer's scales pass as they are; any other scale at a 4- or
    8-byte offset is copied here (4 bytes, no host sync).
    """
    return scale if scale.data_ptr() % 16 == 0 else scale.clone()


def fp8_linear_backward(dy, x, x_lora, w8, w_inv, lora_A, lora_B, h, scaling: float,
                        dy_scale, dy_inv, dy_amax, grad_dtype: torch.dtype, emulate: bool, need_dx: bool,
                        w8t: Optional[torch.Tensor] = None):
    """(dx, dx_lora, dA, dB) for 2-D tensors; dx_lora only with x_lora, dx only if needed, dA / dB
    only with a LoRA branch. dy_amax: fp32 (1,) that max|dy·w_inv| is recorded into, or None.
    ``w8t``: W8 already transposed, (K, N) contiguous (a weight formed in that layout): the transpose is skipped
    and ``w8`` may be None (not when emulating, which reads w8).
    """
    row = _is_row(w_inv)
    colscale = w_inv if row else None
    has_lora = lora_A is not None
    dX = dx_lora = dA = dB = None
    if emulate:
        if need_dx:
            dy8 = fp8_cast_reference(dy, dy_scale, dy_amax, grad_dtype, colscale)
            dX = ((dy8.float() @ w8.float()) * dy_inv[:1] * (1.0 if row else w_inv[:1])).to(dy.dtype)
        if not has_lora:
            return dX, None, None, None
        lora_in = x if x_lora is None else x_lora
        dy_l = dy.to(lora_A.dtype)
        g = dy_l @ lora_B                                                      # (T, R)
        dB = (scaling * dy_l).t() @ h.to(lora_A.dtype)
        dA = (scaling * g).t() @ lora_in.to(lora_A.dtype)
        lora_dx = (scaling * g) @ lora_A                                       # (T, K)
        if x_lora is not None:
            dx_lora = lora_dx.to(x_lora.dtype)
        elif need_dx:
            dX = (dX.float() + lora_dx.float()).to(dy.dtype)
        return dX, dx_lora, dA, dB
    if need_dx:
        dy8 = fp8_cast(dy, dy_scale, dy_amax, grad_dtype, colscale)
        if w8t is None:
            w8t = transpose_fp8(w8)                                            # (K, N): see the module docstring
        dX = torch._scaled_mm(dy8, w8t.t(), scale_a=_cublas_scale(dy_inv[:1]),
                              scale_b=_one(dy.device) if row else _cublas_scale(w_inv[:1]),
                              out_dtype=dy.dtype)
    if not has_lora:
        return dX, None, None, None
    # g stays as the dy pass's partial sums: the x pass and the expand add them as they load them
    g_part, db_part = lora_dy_pass_parts(dy, lora_B, h, scaling)
    if x_lora is not None:
        da_part, dx_lora = lora_x_pass_parts(x_lora, lora_A, g_part, scaling, write_dx=True)
    else:
        da_part, _ = lora_x_pass_parts(x, lora_A, g_part, scaling, write_dx=False)
        if need_dx:
            lora_expand_add_(dX, g_part, lora_A.t(), scaling, None)
    dA, dB = sum_partials(da_part, db_part)
    return dX, dx_lora, dA, dB


class Fp8LoraLinearFunction(torch.autograd.Function):
    """The fp8 base + bf16 LoRA layer as one autograd node.

    Inputs: x, x_lora (None: no dropout), lora_A, lora_B (None, None: no LoRA branch), w8, w_inv,
    bias, scaling, then the scaling state: ``scales`` (dict, see :func:`fp8_lora_linear`).
    Saves the LoRA input (for dA), h (for dB) and W8 (for dX), no fp8 copy of x.
    """

    @staticmethod
    def forward(ctx, x, x_lora, lora_A, lora_B, w8, w_inv, bias, scaling, scales):
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        xl2 = None if x_lora is None else x_lora.reshape(-1, K)
        x_scale, x_inv = _input_scales(x2, scales)
        amax = scales["amax"]
        y, h = fp8_linear_forward(x2, xl2, w8, w_inv, bias, lora_A, lora_B, scaling, x_scale, x_inv,
                                  None if amax is None else amax[0:1], scales["emulate"])
        ctx.save_for_backward(x if x_lora is None else None, x_lora, lora_A, lora_B, w8, w_inv, h)
        ctx.scaling, ctx.scales = scaling, scales
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], w8.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, x_lora, lora_A, lora_B, w8, w_inv, h = ctx.saved_tensors
        scales = ctx.scales
        N, K = w8.shape
        lead = grad_y.shape[:-1]
        dy = grad_y.reshape(-1, N)
        need_dx = ctx.needs_input_grad[0]
        dy_scale, dy_inv = _gradient_scales(dy, w_inv, scales, need_dx)
        amax = scales["amax"]
        dx, dx_lora, dA, dB = fp8_linear_backward(
            dy, None if x is None else x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
            w8, w_inv, lora_A, lora_B, h, ctx.scaling, dy_scale, dy_inv,
            None if amax is None else amax[1:2], scales["grad_dtype"], scales["emulate"], need_dx,
        )
        return _gradients(ctx, dy, lead, K, dx, dx_lora, dA, dB, lora_A, lora_B)


def _input_scales(x2: torch.Tensor, scales: dict) -> tuple:
    """(scale, 1/scale) that cast x: the state's delayed ones, or x's own amax."""
    if scales["delayed"]:
        return scales["scale"][0:1], scales["scale_inv"][0:1]
    return current_scale(x2, E4M3, scales["margin"], scales["emulate"])


def _gradient_scales(dy: torch.Tensor, w_inv: torch.Tensor, scales: dict, need_dx: bool) -> tuple:
    """(scale, 1/scale) that cast dy for dX (None, None when dX is not needed and the scaling is current)."""
    if scales["delayed"]:
        return scales["scale"][1:2], scales["scale_inv"][1:2]
    if not need_dx:
        return None, None
    colscale = w_inv if _is_row(w_inv) else None
    return current_scale(dy, scales["grad_dtype"], scales["margin"], scales["emulate"], colscale)


def _gradients(ctx, dy, lead, K, dx, dx_lora, dA, dB, lora_A, lora_B) -> tuple:
    """The backward's return tuple of both fp8 autograd Functions (their first seven inputs agree)."""
    return (
        dx.view(*lead, K) if ctx.needs_input_grad[0] else None,
        dx_lora.view(*lead, K) if dx_lora is not None else None,
        dA.to(lora_A.dtype) if dA is not None and ctx.needs_input_grad[2] else None,
        dB.to(lora_B.dtype) if dB is not None and ctx.needs_input_grad[3] else None,
        None, None,
        dy.float().sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[6] else None,
        None, None,
    )


class Fp8DequantLoraLinearFunction(torch.autograd.Function):
    """The fp8 op over a frozen weight held in another format (bitsandbytes' 4-bit bytes): W8 is formed for each
    GEMM, not kept. ``source.fp8_weight(transposed)`` returns W8 (N, K) in e4m3, or on the GPU with transposed=True
    W8ᵀ (K, N) contiguous (the layout dX's GEMM reads, formed in one pass instead of forming W8 and transposing it);
    its values are W · (1 / w_inv). Backward forms W8ᵀ again from the source, which holds the module's packed tensors:
    nothing dense is saved. Same inputs as :class:`Fp8LoraLinearFunction` with ``source`` in place of ``w8``."""

    @staticmethod
    def forward(ctx, x, x_lora, lora_A, lora_B, source, w_inv, bias, scaling, scales):
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        xl2 = None if x_lora is None else x_lora.reshape(-1, K)
        x_scale, x_inv = _input_scales(x2, scales)
        amax = scales["amax"]
        w8 = source.fp8_weight(False)
        N = w8.shape[0]
        y, h = fp8_linear_forward(x2, xl2, w8, w_inv, bias, lora_A, lora_B, scaling, x_scale, x_inv,
                                  None if amax is None else amax[0:1], scales["emulate"])
        ctx.save_for_backward(x if x_lora is None else None, x_lora, lora_A, lora_B, w_inv, h)
        ctx.source, ctx.scaling, ctx.scales, ctx.in_features, ctx.out_features = source, scaling, scales, K, N
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, grad_y):
        x, x_lora, lora_A, lora_B, w_inv, h = ctx.saved_tensors
        scales, K, N = ctx.scales, ctx.in_features, ctx.out_features
        lead = grad_y.shape[:-1]
        dy = grad_y.reshape(-1, N)
        need_dx = ctx.needs_input_grad[0]
        emulate = scales["emulate"]
        w8 = w8t = None
        if need_dx:  # the emulation reads W8 as it is; the GPU's dX GEMM reads it transposed
            if emulate:
                w8 = ctx.source.fp8_weight(False)
            else:
                w8t = ctx.source.fp8_weight(True)
        dy_scale, dy_inv = _gradient_scales(dy, w_inv, scales, need_dx)
        amax = scales["amax"]
        dx, dx_lora, dA, dB = fp8_linear_backward(
            dy, None if x is None else x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
            w8, w_inv, lora_A, lora_B, h, ctx.scaling, dy_scale, dy_inv,
            None if amax is None else amax[1:2], scales["grad_dtype"], emulate, need_dx, w8t=w8t,
        )
        return _gradients(ctx, dy, lead, K, dx, dx_lora, dA, dB, lora_A, lora_B)


# ----------------------------------------------------------------------------- custom ops (torch.compile)
#
# Under torch.compile each fp8 layer is one opaque op pair, as the bf16 path's sits_lora::lora_linear.
# The ops are functional: each returns the amax it saw, and the caller folds it into the state's
# buffer (in forward here, in the registered backward for dy), which AOTAutograd turns into buffer
# updates of the compiled graphs.


def _scales_from(t, scale, scale_inv, slot: int, delayed: bool, dtype, margin: int, emulate: bool, colscale=None):
    if delayed:
        return scale[slot:slot + 1], scale_inv[slot:slot + 1]
    return current_scale(t, dtype, margin, emulate, colscale)


@torch.library.custom_op("sits_lora::fp8_lora_linear", mutates_args=())
def _fp8_lora_linear_op(
    x: torch.Tensor, x_lora: Optional[torch.Tensor], lora_A: Optional[torch.Tensor], lora_B: Optional[torch.Tensor],
    w8: torch.Tensor, w_inv: torch.Tensor, bias: Optional[torch.Tensor], scaling: float,
    scale: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, delayed: bool, margin: int,
    grad_e5m2: bool, emulate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h or an empty tensor, the amax of x). ``amax`` is only carried for the backward."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    x_scale, x_inv = _scales_from(x2, scale, scale_inv, 0, delayed, E4M3, margin, emulate)
    seen = torch.zeros(1, device=x.device, dtype=torch.float32)
    y, h = fp8_linear_forward(x2, None if x_lora is None else x_lora.reshape(-1, K), w8, w_inv, bias, lora_A, lora_B,
                              scaling, x_scale, x_inv, seen, emulate)
    return y.view(*x.shape[:-1], w8.shape[0]), (x.new_empty(0, dtype=torch.float32) if h is None else h), seen


@_fp8_lora_linear_op.register_fake
def _(x, x_lora, lora_A, lora_B, w8, w_inv, bias, scaling, scale, scale_inv, amax, delayed, margin, grad_e5m2, emulate):
    tokens = x.numel() // x.shape[-1]
    h = x.new_empty(0 if lora_A is None else tokens, 0 if lora_A is None else lora_A.shape[0], dtype=torch.float32)
    return x.new_empty(*x.shape[:-1], w8.shape[0]), h, x.new_empty(1, dtype=torch.float32)


@torch.library.custom_op("sits_lora::fp8_lora_linear_backward", mutates_args=())
def _fp8_lora_linear_backward_op(
    dy: torch.Tensor, x: Optional[torch.Tensor], x_lora: Optional[torch.Tensor], lora_A: Optional[torch.Tensor],
    lora_B: Optional[torch.Tensor], w8: torch.Tensor, w_inv: torch.Tensor, h: torch.Tensor, scaling: float,
    scale: torch.Tensor, scale_inv: torch.Tensor, delayed: bool, margin: int, grad_e5m2: bool, emulate: bool,
    need_dx: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dx_lora, dA, dB, the amax of dy); an output not asked for is an empty tensor."""
    N, K = w8.shape
    lead = dy.shape[:-1]
    dy2 = dy.reshape(-1, N)
    grad_dtype = E5M2 if grad_e5m2 else E4M3
    seen = torch.zeros(1, device=dy.device, dtype=torch.float32)
    dy_scale = dy_inv = None
    if need_dx:
        colscale = w_inv if _is_row(w_inv) else None
        dy_scale, dy_inv = _scales_from(dy2, scale, scale_inv, 1, delayed, grad_dtype, margin, emulate, colscale)
    dx, dx_lora, dA, dB = fp8_linear_backward(
        dy2, None if x is None else x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K), w8, w_inv,
        lora_A, lora_B, None if lora_A is None else h, scaling, dy_scale, dy_inv, seen, grad_dtype, emulate, need_dx)
    # a fresh empty tensor per missing output: a custom op's outputs must not alias each other
    return (dy.new_empty(0) if dx is None else dx.view(*lead, K),
            dy.new_empty(0) if dx_lora is None else dx_lora.view(*lead, K),
            dy.new_empty(0) if dA is None else dA.to(lora_A.dtype),
            dy.new_empty(0) if dB is None else dB.to(lora_B.dtype), seen)


@_fp8_lora_linear_backward_op.register_fake
def _(dy, x, x_lora, lora_A, lora_B, w8, w_inv, h, scaling, scale, scale_inv, delayed, margin, grad_e5m2, emulate,
      need_dx):
    lead = dy.shape[:-1]
    K = w8.shape[1]
    return (dy.new_empty(*lead, K) if need_dx else dy.new_empty(0),
            dy.new_empty(*lead, K) if x_lora is not None else dy.new_empty(0),
            dy.new_empty(0) if lora_A is None else lora_A.new_empty(lora_A.shape),
            dy.new_empty(0) if lora_B is None else lora_B.new_empty(lora_B.shape),
            dy.new_empty(1, dtype=torch.float32))


def _fp8_setup_context(ctx, inputs, output):
    (x, x_lora, lora_A, lora_B, w8, w_inv, bias, scaling, scale, scale_inv, amax, delayed, margin, grad_e5m2,
     emulate) = inputs
    _, h, seen = output
    ctx.mark_non_differentiable(h, seen)
    ctx.save_for_backward(x if x_lora is None else None, x_lora, lora_A, lora_B, w8, w_inv, h, scale, scale_inv)
    # not saved_tensors: the forward itself bumps the buffer's version after this (its x amax)
    ctx.amax = amax
    ctx.options = (scaling, delayed, margin, grad_e5m2, emulate)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _fp8_backward(ctx, grad_y, grad_h, grad_amax):
    x, x_lora, lora_A, lora_B, w8, w_inv, h, scale, scale_inv = ctx.saved_tensors
    amax = ctx.amax
    scaling, delayed, margin, grad_e5m2, emulate = ctx.options
    need_dx = ctx.needs_input_grad[0]
    dx, dx_lora, dA, dB, seen = _fp8_lora_linear_backward_op(
        grad_y.contiguous(), x, x_lora, lora_A, lora_B, w8, w_inv, h, scaling, scale, scale_inv, delayed, margin,
        grad_e5m2, emulate, need_dx)
    amax[1:2].copy_(torch.maximum(amax[1:2], seen))
    return (dx if need_dx else None, dx_lora if x_lora is not None else None,
            dA if ctx.needs_input_grad[2] else None, dB if ctx.needs_input_grad[3] else None,
            None, None,
            grad_y.reshape(-1, grad_y.shape[-1]).float().sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[6] else None,
            None, None, None, None, None, None, None, None)


_fp8_lora_linear_op.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)


def fp8_lora_linear(x, x_lora, lora_A, lora_B, w8, w_inv, bias, scaling: float, scales: dict) -> torch.Tensor:
    """y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ with an fp8 base, any leading dims.

    ``scales``: "delayed" (bool: use the state's scales; False: each tensor's own amax),
    "scale", "scale_inv", "amax" (fp32 (2,) views of the state: slot 0 the input x, slot 1 the
    gradient dy; "amax" None records nothing), "margin", "grad_dtype" (e4m3 or e5m2), "emulate".
    Pass x_lora=None without dropout; lora_A = lora_B = None for the base alone.

    Eager mode runs :class:`Fp8LoraLinearFunction` (no op dispatch per call); under torch.compile
    the custom ops above, when the state records (training).
    """
    if torch.compiler.is_compiling() and scales["amax"] is not None:
        amax = scales["amax"]
        y, _, seen = _fp8_lora_linear_op(
            x, x_lora, lora_A, lora_B, w8, w_inv, bias, float(scaling), scales["scale"], scales["scale_inv"], amax,
            scales["delayed"], scales["margin"], scales["grad_dtype"] == E5M2, scales["emulate"])
        amax[0:1].copy_(torch.maximum(amax[0:1], seen.detach()))
        return y
    return Fp8LoraLinearFunction.apply(x, x_lora, lora_A, lora_B, w8, w_inv, bias, float(scaling), scales)


@torch.compiler.disable  # an eager autograd Function over a weight formed per call into a shared buffer: not traced
def fp8_dequant_lora_linear(x, x_lora, lora_A, lora_B, source, w_inv, bias, scaling: float, scales: dict) -> torch.Tensor:
    """:func:`fp8_lora_linear` with W8 formed per GEMM by ``source`` (see :class:`Fp8DequantLoraLinearFunction`)."""
    return Fp8DequantLoraLinearFunction.apply(x, x_lora, lora_A, lora_B, source, w_inv, bias, float(scaling), scales)
