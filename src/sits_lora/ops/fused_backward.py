"""Triton kernels of the LoRA linear layer's backward, and their launchers (notation and the launch plan: ``fused``).

The dy pass reads dy once for g = dy B and dB; the x pass reads x once for dA and, on the cuBLAS path, s·g A into
dx; one launch sums the partial sums of dA and dB; the per-token rank limit zeroes g beyond each token's rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .geometry import block_rank, cdiv, split_geometry
from .launch import TritonLauncher
from .reference import ProductInput


# ----------------------------------------------------------------------------- backward: the dy pass


@triton.jit
def _lora_dy_pass_kernel(
    dy_ptr, b_ptr, h_ptr, g_part_ptr, db_part_ptr,
    T, N, R, N_PER_SPLIT, scale, g_scale,
    stride_dyt, stride_dyn, stride_bn, stride_br, stride_ht, stride_hr, stride_gs, stride_gt,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One read of dy: g partials (per N split) and dB partials (per token block).

    g_part[split, t, r]   = g_scale · Σ_{n in split} dy[t, n] B[n, r]   (a split past N writes zeros)
    db_part[tblock, n, r] = s · Σ_{t in tblock} dy[t, n] h[t, r]
    """
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    offs_nb = tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + offs_t[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                mask=(offs_t[:, None] < T) & (offs_r[None, :] < R), other=0.0) * scale   # (BT, BR) fp32
    g = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    n_start = pid_s * N_PER_SPLIT
    n_stop = tl.minimum(n_start + N_PER_SPLIT, N)
    for n0 in range(n_start, n_stop, BLOCK_N):
        n = n0 + offs_nb
        n_ok = n < n_stop
        dy = tl.load(dy_ptr + offs_t[:, None] * stride_dyt + n[None, :] * stride_dyn,
                     mask=(offs_t[:, None] < T) & n_ok[None, :], other=0.0)               # (BT, BN)
        b = tl.load(b_ptr + n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                    mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0)                # (BN, BR)
        g = tl.dot(dy, b.to(dy.dtype), g, input_precision=DOT_PRECISION)
        db = tl.dot(tl.trans(dy), h.to(dy.dtype), input_precision=DOT_PRECISION)         # (BN, BR)
        tl.store(db_part_ptr + pid_t * N * R + n[:, None] * R + offs_r[None, :], db,
                 mask=n_ok[:, None] & (offs_r[None, :] < R))
    tl.store(g_part_ptr + pid_s * stride_gs + offs_t[:, None] * stride_gt + offs_r[None, :], g * g_scale,
             mask=(offs_t[:, None] < T) & (offs_r[None, :] < R))


_DY_PASS = TritonLauncher(_lora_dy_pass_kernel)


def dy_pass_splits(dy: torch.Tensor, R: int, config: Optional[dict] = None) -> int:
    """How many N splits (g partials) the dy pass makes for dy (T, N) at rank R."""
    T, N = dy.shape
    return split_geometry("dy_pass", dy.device, T, N, R, dy.dtype, config)[1][1]


def lora_dy_pass_parts(dy: torch.Tensor, lora_B: torch.Tensor, h: torch.Tensor, scale: float,
                       config: Optional[dict] = None, g_part: Optional[torch.Tensor] = None,
                       g_scale: float = 1.0) -> tuple:
    """(g partials (S, T, R), dB partials (P, N, R)), fp32, from one read of dy: g = Σ_s g_part[s] = dy B,
    dB = Σ_p db_part[p] = s·dyᵀ h. The x pass sums the g partials as it loads them and ``sum_partials``
    sums dB's with dA's in one launch: no torch reduction between the passes.

    ``g_part``: write g's partials into this (S, T, R) view (unit stride along R; siblings pass their
    columns of one shared buffer), S splits whatever dy_pass_splits says, each scaled by ``g_scale``."""
    T, N = dy.shape
    R = h.shape[1]
    cfg, (t_blocks, splits), BLOCK_R, precision, n_per_split = split_geometry("dy_pass", dy.device, T, N, R,
                                                                               dy.dtype, config)
    if g_part is None:
        g_part = torch.empty((splits, T, R), device=dy.device, dtype=torch.float32)
    else:
        splits = g_part.shape[0]
        n_per_split = cdiv(cdiv(N, splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    # dB partials cost (T / BLOCK_T)·N·R·4 bytes: a tall token block keeps them small against dy.
    db_part = torch.empty((t_blocks, N, R), device=dy.device, dtype=torch.float32)
    _DY_PASS((t_blocks, splits),
             dy, lora_B, h, g_part, db_part, T, N, R, n_per_split, scale, g_scale,
             *dy.stride(), *lora_B.stride(), *h.stride(), *g_part.stride()[:2],
             BLOCK_R=BLOCK_R, DOT_PRECISION=precision, **cfg)
    return g_part, db_part


def lora_dy_pass(dy: torch.Tensor, lora_B: torch.Tensor, h: torch.Tensor, scale: float, config: Optional[dict] = None):
    """(g, dB) from one read of dy: g = dy B (T, R) fp32, dB = s·dyᵀ h (N, R) fp32."""
    g_part, db_part = lora_dy_pass_parts(dy, lora_B, h, scale, config)
    return sum_leading(g_part), sum_leading(db_part)


def sum_leading(parts: torch.Tensor) -> torch.Tensor:
    return parts[0] if parts.shape[0] == 1 else parts.sum(0)


# ----------------------------------------------------------------------------- backward: the x pass


@triton.jit
def _lora_x_pass_kernel(
    x_ptr, up_ptr, a_ptr, g_ptr, da_part_ptr, dx_ptr,
    T, K, R, T_PER_SPLIT, G_PARTS, scale,
    stride_xt, stride_xk, stride_ar, stride_ak, stride_gs, stride_gt, stride_gr, stride_dxt, stride_dxk,
    WRITE_DX: tl.constexpr, X_FORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One read of x: dA partials per token split, and optionally dx_lora = s·g A.

    g arrives as G_PARTS partial sums (g = Σ_s g[s], the dy pass's N splits), added here as they are
    loaded; the partials are small (T·R fp32 each) and stay in L2 across the K blocks.
    da_part[split, r, k] = s · Σ_{t in split} g[t, r] x[t, k]
    X_FORM (_X_FORMS): x as given, or formed from its two factors (x_ptr the gate, up_ptr the up, same strides) as
    ops.reference.ProductInput.value does: gate·up, or silu(gate)·up with the SiLU in fp32 rounded to x's dtype.
    """
    pid_s = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    offs_tb = tl.arange(0, BLOCK_T)
    k_ok = offs_k < K
    r_ok = offs_r < R
    if WRITE_DX:
        a = tl.load(a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)        # (BR, BK)
    da = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    t_start = pid_s * T_PER_SPLIT
    t_stop = tl.minimum(t_start + T_PER_SPLIT, T)
    for t0 in range(t_start, t_stop, BLOCK_T):
        offs_t = t0 + offs_tb
        t_ok = offs_t < t_stop
        x_offs = offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk
        x_ok = t_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + x_offs, mask=x_ok, other=0.0)                                   # (BT, BK)
        if X_FORM == 1:
            x = x * tl.load(up_ptr + x_offs, mask=x_ok, other=0.0)
        elif X_FORM == 2:
            gate = x.to(tl.float32)
            x = (gate * tl.sigmoid(gate)).to(x.dtype) * tl.load(up_ptr + x_offs, mask=x_ok, other=0.0)
        g_ptrs = g_ptr + offs_t[:, None] * stride_gt + offs_r[None, :] * stride_gr
        g_ok = t_ok[:, None] & r_ok[None, :]
        g = tl.load(g_ptrs, mask=g_ok, other=0.0)                                          # (BT, BR) fp32
        for part in range(1, G_PARTS):
            g += tl.load(g_ptrs + part * stride_gs, mask=g_ok, other=0.0)
        da = tl.dot(tl.trans(g.to(x.dtype)), x, da, input_precision=DOT_PRECISION)
        if WRITE_DX:
            dx = tl.dot(g, a, input_precision=DOT_PRECISION) * scale
            tl.store(dx_ptr + offs_t[:, None] * stride_dxt + offs_k[None, :] * stride_dxk,
                     dx.to(dx_ptr.dtype.element_ty), mask=t_ok[:, None] & k_ok[None, :])
    tl.store(da_part_ptr + pid_s * R * K + offs_r[:, None] * K + offs_k[None, :], da * scale,
             mask=r_ok[:, None] & k_ok[None, :])


_X_PASS = TritonLauncher(_lora_x_pass_kernel)
# X_FORM: x itself, gate·up, silu(gate)·up
_X_FORMS = {False: 1, True: 2}


def lora_x_pass_parts(x, lora_A: torch.Tensor, g: torch.Tensor, scale: float, write_dx: bool,
                      config: Optional[dict] = None):
    """(dA partials (S, R, K) fp32, dx_lora or None): dA = Σ_s da_part[s] = s·gᵀ x; dx_lora = s·g A (T, K) in
    x's dtype. ``g``: (T, R), or its partial sums (P, T, R) as lora_dy_pass_parts writes them. ``x``: (T, K), or
    an ops.reference.ProductInput of two contiguous (T, K) factors, which the kernel multiplies as it loads them."""
    if type(x) is ProductInput:
        x, up, form = x.gate, x.up, _X_FORMS[x.silu]
        if up.stride() != x.stride():
            raise ValueError(f"lora_x_pass_parts: the factors' strides differ ({tuple(x.stride())} and "
                             f"{tuple(up.stride())}); pass the formed input instead")
    else:
        up, form = x, 0
    T, K = x.shape
    g_parts = g.shape[0] if g.dim() == 3 else 1
    R = g.shape[-1]
    cfg, (splits, k_blocks), BLOCK_R, precision, t_per_split = split_geometry(
        "x_pass_product" if form else "x_pass", x.device, T, K, R, x.dtype, config)
    da_part = torch.empty((splits, R, K), device=x.device, dtype=torch.float32)
    dx = torch.empty((T, K), device=x.device, dtype=x.dtype) if write_dx else None
    g_strides = g.stride()
    _X_PASS((splits, k_blocks),
            x, up, lora_A, g, da_part, dx if write_dx else x,
            T, K, R, t_per_split, g_parts, scale,
            *x.stride(), *lora_A.stride(), g_strides[0] if g_parts > 1 else 0, *g_strides[-2:],
            K if write_dx else 0, 1 if write_dx else 0,  # dx is fresh: contiguous
            WRITE_DX=write_dx, X_FORM=form, BLOCK_R=BLOCK_R, DOT_PRECISION=precision, **cfg)
    return da_part, dx


def lora_x_pass(x: torch.Tensor, lora_A: torch.Tensor, g: torch.Tensor, scale: float, write_dx: bool,
                config: Optional[dict] = None):
    """(dA, dx_lora or None): dA = s·gᵀ x (R, K) fp32; dx_lora = s·g A (T, K) in x's dtype."""
    da_part, dx = lora_x_pass_parts(x, lora_A, g, scale, write_dx, config)
    return sum_leading(da_part), dx


# ----------------------------------------------------------------------------- backward: the two partial sums


@triton.jit
def _sum_stack(part_ptr, out_ptr, parts, size, block_id, BLOCK: tl.constexpr):
    offs = block_id * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = part_ptr + offs
    for _ in range(0, parts):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += size  # pointer arithmetic is 64-bit: no int32 overflow at T·N·R > 2³¹
    tl.store(out_ptr + offs, acc, mask=ok)


@triton.jit
def _sum_partials_kernel(
    p0, o0, parts0, size0, p1, o1, parts1, size1, p2, o2, parts2, size2, p3, o3, parts3, size3,
    end0, end1, end2,
    BLOCK: tl.constexpr,
):
    """out_i = Σ_p part_i[p] for up to four contiguous fp32 stacks in one launch. Programs [0, end0) sum
    stack 0, [end0, end1) stack 1, and so on; each adds its BLOCK elements in part order (deterministic)."""
    pid = tl.program_id(0)
    if pid < end0:
        _sum_stack(p0, o0, parts0, size0, pid, BLOCK)
    elif pid < end1:
        _sum_stack(p1, o1, parts1, size1, pid - end0, BLOCK)
    elif pid < end2:
        _sum_stack(p2, o2, parts2, size2, pid - end1, BLOCK)
    else:
        _sum_stack(p3, o3, parts3, size3, pid - end2, BLOCK)


_SUM_PARTIALS = TritonLauncher(_sum_partials_kernel)
_SUM_BLOCK = 256


def sum_partials(*stacks: torch.Tensor) -> list:
    """[Σ_p stack[p] for each stack]: contiguous fp32 stacks of partial sums (the dA and dB partials of a
    layer's backward, or of several siblings'), four per launch; a one-part stack is a view, no work."""
    sums = [parts[0] if parts.shape[0] == 1 else torch.empty(parts.shape[1:], device=parts.device,
                                                              dtype=torch.float32) for parts in stacks]
    pending = [(parts, out) for parts, out in zip(stacks, sums) if parts.shape[0] > 1]
    for first in range(0, len(pending), 4):
        group = pending[first:first + 4]
        args, ends, programs = [], [], 0
        for parts, out in group:
            size = out.numel()
            args += (parts, out, parts.shape[0], size)
            programs += -(-size // _SUM_BLOCK)
            ends.append(programs)
        # unused slots: no programs reach them
        args += (group[0][0], group[0][1], 0, 0) * (4 - len(group))
        ends += [programs] * (3 - len(ends))
        _SUM_PARTIALS((programs,), *args, *ends[:3], BLOCK=_SUM_BLOCK, num_warps=4, num_stages=1)
    return sums


# ----------------------------------------------------------------------------- backward: the per-token rank limit


@triton.jit
def _limit_grad_kernel(
    g_ptr, limit_ptr, g_out_ptr, h_ptr, ends_ptr, dw_ptr, T, R, K, scale,
    stride_gt, stride_gr, stride_ht, stride_hr, stride_wt, stride_wk,
    BUCKET_GRAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """g_out[t, r] = g[t, r] for r < limit[t], else 0 (g_out has g's strides); with BUCKET_GRAD also
    dw[t, k] = s · Σ_{r < ends[k]} h[t, r] g[t, r], the router's bucket-weight gradient (h unlimited)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    ok = (offs_t[:, None] < T) & (offs_r[None, :] < R)
    g_offs = offs_t[:, None] * stride_gt + offs_r[None, :] * stride_gr
    g = tl.load(g_ptr + g_offs, mask=ok, other=0.0)                                        # (BT, BR) fp32
    limit = tl.load(limit_ptr + offs_t, mask=offs_t < T, other=0)
    tl.store(g_out_ptr + g_offs, tl.where(offs_r[None, :] < limit[:, None], g, 0.0), mask=ok)
    if BUCKET_GRAD:
        h = tl.load(h_ptr + offs_t[:, None] * stride_ht + offs_r[None, :] * stride_hr, mask=ok, other=0.0)
        hg = h * g
        for k in range(0, K):
            end = tl.load(ends_ptr + k)
            total = tl.sum(tl.where(offs_r[None, :] < end, hg, 0.0), 1) * scale             # (BT,)
            tl.store(dw_ptr + offs_t * stride_wt + k * stride_wk, total, mask=offs_t < T)


_LIMIT_GRAD = TritonLauncher(_limit_grad_kernel)


def limit_grad(g: torch.Tensor, rank_limit: torch.Tensor, scale: float, h_full: Optional[torch.Tensor] = None,
               bucket_ends: Optional[torch.Tensor] = None) -> tuple:
    """(g limited, bucket-weight gradient or None) from one read of g (T, R) fp32.

    g limited: g[t, r] zeroed for r >= rank_limit[t] ((T,) int32), what dA and dx read, so the x pass
    runs the static kernel. With the unlimited ``h_full`` and ``bucket_ends`` (K,): the (T, K) fp32
    gradient of the router's bucket weights, s · Σ_{r < bucket_ends[k]} h[t, r] g[t, r] (it reads h and g
    beyond each token's limit). Limiting h and g once here and in the shrink, instead of in every pass
    that reads them, is what made the per-token-rank passes as fast as the static ones (docs/dynamic-rank.md);
    the bucket gradient in one kernel replaces six torch kernels."""
    T, R = g.shape
    g_out = torch.empty_like(g)
    bucket_grad = h_full is not None
    if bucket_grad and bucket_ends is None:
        raise ValueError("limit_grad: h_full needs bucket_ends (the rank at each bucket's end)")
    K = bucket_ends.shape[0] if bucket_grad else 0
    d_weights = torch.empty((T, K), device=g.device, dtype=torch.float32) if bucket_grad else None
    # without the bucket gradient its pointers are placeholders the kernel never reads
    h, ends, dw = (h_full, bucket_ends, d_weights) if bucket_grad else (g, rank_limit, g)
    BLOCK_T = 64
    _LIMIT_GRAD((cdiv(T, BLOCK_T),),
        g, rank_limit, g_out, h, ends, dw, T, R, K, scale,
        g.stride(0), g.stride(1), h.stride(0), h.stride(1), dw.stride(0), dw.stride(1),
        BUCKET_GRAD=bucket_grad, BLOCK_T=BLOCK_T, BLOCK_R=block_rank(R),
    )
    return g_out, d_weights
