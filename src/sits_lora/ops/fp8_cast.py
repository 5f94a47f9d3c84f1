"""FP8 casts for the frozen base: the scale rule, the fused cast kernel (x or dy to fp8, its absolute maximum
recorded for the next scale) and its PyTorch reference, the weight's tiled byte transpose, and the weight's
quantization once. The fp8 linear op that uses them is ``fp8``; the numerics are in its docstring.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .fused import cdiv

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def scale_from_amax(amax: torch.Tensor, fp8_max, margin: int, fallback) -> torch.Tensor:
    """(fp8_max / amax) / 2**margin where that is finite and amax > 0, else ``fallback`` (TE's rule)."""
    sf = (fp8_max / amax) / (2.0 ** margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(sf)
    return torch.where(ok, sf, fallback)


# ----------------------------------------------------------------------------- the fused cast


@triton.jit
def _fp8_cast_kernel(
    x_ptr, out_ptr, scale_ptr, amax_ptr, colscale_ptr,
    T, C,
    stride_xt, stride_xc, stride_ot,
    FP8_MAX: tl.constexpr, HAS_COLSCALE: tl.constexpr, WRITE_OUT: tl.constexpr, RECORD_AMAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out = fp8(clamp(x·colscale·scale)), amax = max(amax, max|x·colscale|): one read of x.

    Each program walks BLOCK_T whole rows, so the amax costs one atomic per program, not per tile.
    """
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    t_ok = offs_t < T
    if WRITE_OUT:
        scale = tl.load(scale_ptr)
    running = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + offs_c
        mask = t_ok[:, None] & (c[None, :] < C)
        v = tl.load(x_ptr + offs_t[:, None] * stride_xt + c[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
        if HAS_COLSCALE:
            v = v * tl.load(colscale_ptr + c, mask=c < C, other=0.0)[None, :]
        a = tl.abs(v)
        finite = a < float("inf")                      # False for Inf and NaN
        if RECORD_AMAX:
            running = tl.maximum(running, tl.where(finite, a, float("inf")))
        if WRITE_OUT:
            q = tl.minimum(tl.maximum(v * scale, -FP8_MAX), FP8_MAX)
            q = tl.where(finite, q, float("nan"))
            tl.store(out_ptr + offs_t[:, None] * stride_ot + c[None, :],
                     q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    if RECORD_AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(running, axis=1), axis=0))


def _cast_config(device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(BLOCK_T=16, BLOCK_C=32, num_warps=4)
    # 16 rows x 512 columns of bf16 per step: 16 KiB in flight per program; T = 8192 gives 512
    # programs (about four per SM of a 132-SM Hopper GPU) and 512 atomics on the amax.
    return dict(BLOCK_T=16, BLOCK_C=512, num_warps=8)


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, amax: Optional[torch.Tensor], dtype: torch.dtype,
             colscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (T, C) any strides -> contiguous fp8 (T, C); records max|x·colscale| into amax[0] (atomic max).

    scale, amax: fp32 tensors whose first element is used; colscale: optional fp32 (C,).
    """
    T, C = x.shape
    out = torch.empty((T, C), device=x.device, dtype=dtype)
    cfg = _cast_config(x.device)
    _fp8_cast_kernel[(cdiv(T, cfg["BLOCK_T"]),)](
        x, out, scale, amax if amax is not None else scale, colscale if colscale is not None else scale,
        T, C, x.stride(0), x.stride(1), out.stride(0),
        FP8_MAX=FP8_MAX[dtype], HAS_COLSCALE=colscale is not None, WRITE_OUT=True, RECORD_AMAX=amax is not None,
        **cfg,
    )
    return out


def fp8_amax(x: torch.Tensor, colscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max|x·colscale| as an fp32 (1,) tensor (Inf where x holds a NaN or Inf), one read of x."""
    T, C = x.shape
    amax = torch.zeros(1, device=x.device, dtype=torch.float32)
    cfg = _cast_config(x.device)
    _fp8_cast_kernel[(cdiv(T, cfg["BLOCK_T"]),)](
        x, amax, amax, amax, colscale if colscale is not None else amax,
        T, C, x.stride(0), x.stride(1), 0,
        FP8_MAX=448.0, HAS_COLSCALE=colscale is not None, WRITE_OUT=False, RECORD_AMAX=True, **cfg,
    )
    return amax


def _amax_reference(v: torch.Tensor) -> torch.Tensor:
    a = v.abs().amax().reshape(1)
    return torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)


def fp8_cast_reference(x: torch.Tensor, scale: torch.Tensor, amax: Optional[torch.Tensor], dtype: torch.dtype,
                       colscale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The cast in plain PyTorch: the oracle of :func:`fp8_cast` and the emulation path."""
    v = x.float()
    if colscale is not None:
        v = v * colscale
    if amax is not None:
        amax[:1].copy_(torch.maximum(amax[:1], _amax_reference(v)))
    fmax = FP8_MAX[dtype]
    q = (v * scale[:1]).clamp(-fmax, fmax)
    q = torch.where(torch.isfinite(v), q, torch.full_like(q, float("nan")))
    return q.to(dtype)


def current_scale(t: torch.Tensor, dtype: torch.dtype, margin: int, emulate: bool,
                  colscale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale), fp32 (1,), from t's own amax: the first step before any history, and eval."""
    if emulate or not t.is_cuda:
        v = t.float() * colscale if colscale is not None else t.float()
        amax = _amax_reference(v)
    else:
        amax = fp8_amax(t, colscale)
    scale = scale_from_amax(amax, FP8_MAX[dtype], margin, torch.ones_like(amax))
    return scale, scale.reciprocal()


# ----------------------------------------------------------------------------- the weight's transpose


@triton.jit
def _transpose_bytes_kernel(src_ptr, dst_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst (C, R) = src (R, C)ᵀ for contiguous 1-byte elements: each program moves one BLOCK_R × BLOCK_C
    tile, read along src's rows and written along dst's rows, so both sides are coalesced."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < R) & (c[None, :] < C)
    tile = tl.load(src_ptr + r[:, None].to(tl.int64) * C + c[None, :], mask=mask, other=0)
    tl.store(dst_ptr + c[:, None].to(tl.int64) * R + r[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_fp8(w8: torch.Tensor) -> torch.Tensor:
    """W8ᵀ as a contiguous (K, N) tensor of W8's dtype, from a contiguous (N, K) fp8 W8.

    The bytes are moved as uint8 (the same code for e4m3 and e5m2, and the interpreter needs no fp8).
    """
    if not w8.is_contiguous():
        w8 = w8.contiguous()
    R, C = w8.shape
    out = torch.empty((C, R), device=w8.device, dtype=torch.uint8)
    # 64 x 64 bytes on the CPU interpreter (quick); 128 x 128 (16 KiB) per program on a GPU
    block = 128 if w8.is_cuda else 64
    _transpose_bytes_kernel[(cdiv(R, block), cdiv(C, block))](
        w8.view(torch.uint8), out, R, C, BLOCK_R=block, BLOCK_C=block, num_warps=8 if w8.is_cuda else 4)
    return out.view(w8.dtype)


# ----------------------------------------------------------------------------- the weight, once


def quantize_weight(weight: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8 e4m3 (N, K), w_inv fp32): W ≈ W8 · w_inv, with w_inv (1,) ("tensor") or (N,) ("row").

    The weight is frozen, so its scale comes from its own exact amax, once (no margin, no history).
    """
    w = weight.detach().float()
    scale = weight_scale(w, granularity)
    w8 = (w * scale.reshape(-1, 1)).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3)
    return w8, scale.reciprocal()


def weight_scale(weight: torch.Tensor, granularity: str) -> torch.Tensor:
    """fp32 scale that maps W onto e4m3's range: (1,) for "tensor", (N,) for "row"; W8 = e4m3(W · scale)."""
    w = weight.detach().float()
    if granularity == "tensor":
        amax = w.abs().amax().reshape(1)
    elif granularity == "row":
        amax = w.abs().amax(dim=1)
    else:
        raise ValueError(f"fp8_weight_scale={granularity!r} is invalid: allowed values are 'tensor', 'row'.")
    if not torch.isfinite(amax).all():
        raise ValueError("the base weight holds NaN or Inf values; it cannot be quantized to fp8. Check the "
                         "checkpoint, or set fp8='off'.")
    return scale_from_amax(amax, FP8_MAX[E4M3], 0, torch.ones_like(amax))


def dequantize_weight(w8: torch.Tensor, w_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W8 · w_inv in ``dtype`` (the precision a merged fp8 base has: e4m3 values times their scale)."""
    return (w8.float() * w_inv.reshape(-1, 1)).to(dtype)
