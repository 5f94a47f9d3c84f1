"""Triton kernels for the LoRA linear layer, and their launchers: the building blocks that the ops
(``linear``, ``siblings``, ``dynamic_rank``, ``fp8``) drive. The forward's kernels are here, the backward's in
``fused_backward`` (imported here: callers reach every kernel through this module), the launch geometry in
``geometry``.

Notation as in ``reference``: x (T, K) the input, W (N, K) the frozen weight, A (R, K), B (N, R),
s the scaling, h = x Aᵀ (T, R), g = dy B (T, R). R is the LoRA rank (or the summed ranks of
sibling layers that share x).

Where the time goes. The base layer's two GEMMs (forward x Wᵀ, backward dy W) are compute-bound
and are the floor. The LoRA arithmetic is 2·R·(K+N)/(K·N) of it (under 1 % at R=16, K=N=4096);
what costs is every extra pass over x (T·K), dy and the output (T·N). The kernels here make the
fewest passes we know how to make:

    forward   shrink: one read of x -> h.  Then one of two GEMM paths:
              "triton": a GEMM whose epilogue adds s·h Bᵀ (+ bias) to each output tile: no extra
                        pass over the output at all.
              "cublas": expand writes C = s·h Bᵀ + bias once, cuBLAS computes C += x Wᵀ in place
                        (its epilogue reads C): one write and one read of the output.
    backward  dy pass: one read of dy -> g and dB (partial sums per token block, no atomics, so
                        results are deterministic).
              dX:      "triton": GEMM dy W with epilogue s·g A.  "cublas": the x pass writes
                        s·g A, cuBLAS adds dy W in place.
              x pass:  one read of x -> dA (and, for "cublas" or with dropout, s·g A).

Every kernel accumulates in fp32 and loads fp32 master adapter weights, casting them to the
activation dtype for the tensor-core dot (bf16/fp16) or keeping fp32 ("ieee") for fp32 inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import tuning
from .fused_backward import (
    dy_pass_splits, limit_grad, lora_dy_pass, lora_dy_pass_parts, lora_x_pass, lora_x_pass_parts, sum_leading,
    sum_partials,
)
from .geometry import block_rank, cdiv, dot_precision, grid_geometry
from .launch import TritonLauncher
from .reference import ProductInput

# every kernel's launcher, the backward's included: callers reach them all through this module (ops.choice)
__all__ = [
    "block_rank", "cdiv", "dot_precision", "dy_pass_splits", "limit_grad", "lora_dy_pass", "lora_dy_pass_parts",
    "lora_expand", "lora_gemm", "lora_shrink", "lora_shrink_limited", "lora_x_pass", "lora_x_pass_parts",
    "sum_leading", "sum_partials", "tune_layer_kernels",
]

# ----------------------------------------------------------------------------- shrink: h = x Aᵀ


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, h_full_ptr, limit_ptr,
    T, K, R,
    stride_xt, stride_xk, stride_ar, stride_ak, stride_ht, stride_hr,
    HAS_LIMIT: tl.constexpr, WRITE_FULL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h = x Aᵀ; with HAS_LIMIT h[t, r] = 0 for r >= limit[t] (and the unlimited h to h_full with
    WRITE_FULL, same strides), so that the passes after it run the static kernels unchanged."""
    pid_t = tl.program_id(0)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + k[None, :] * stride_xk,
                    mask=(offs_t[:, None] < T) & (k[None, :] < K), other=0.0)             # (BT, BK)
        a = tl.load(a_ptr + k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                    mask=(k[:, None] < K) & (offs_r[None, :] < R), other=0.0)             # (BK, BR)
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = offs_t[:, None] * stride_ht + offs_r[None, :] * stride_hr
    ok = (offs_t[:, None] < T) & (offs_r[None, :] < R)
    if HAS_LIMIT:
        if WRITE_FULL:
            tl.store(h_full_ptr + out, acc, mask=ok)
        limit = tl.load(limit_ptr + offs_t, mask=offs_t < T, other=0)
        acc = tl.where(offs_r[None, :] < limit[:, None], acc, 0.0)
    tl.store(h_ptr + out, acc, mask=ok)


def lora_shrink(x: torch.Tensor, lora_A: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """h = x Aᵀ in fp32. x (T, K) any strides, A (R, K)."""
    return _shrink(x, lora_A, config, None, False)[0]


def lora_shrink_limited(x: torch.Tensor, lora_A: torch.Tensor, rank_limit: torch.Tensor, keep_full: bool,
                        config: Optional[dict] = None) -> tuple:
    """(h limited, h or None) in fp32: h = x Aᵀ with h[t, r] = 0 for r >= rank_limit[t] ((T,) int32), and
    the unlimited h as well when ``keep_full`` (the router's gradient reads it beyond each limit)."""
    return _shrink(x, lora_A, config, rank_limit, keep_full)


_SHRINK = TritonLauncher(_lora_shrink_kernel)


def _shrink(x, lora_A, config, rank_limit, keep_full):
    T, K = x.shape
    R = lora_A.shape[0]
    h = torch.empty((T, R), device=x.device, dtype=torch.float32)
    h_full = torch.empty_like(h) if rank_limit is not None and keep_full else None
    cfg, grid, BLOCK_R, precision = grid_geometry("shrink", x.device, T, K, R, x.dtype, config)
    _SHRINK(grid,
        x, lora_A, h, h_full if h_full is not None else h, rank_limit if rank_limit is not None else h, T, K, R,
        *x.stride(), *lora_A.stride(), R, 1,  # h is fresh: contiguous
        HAS_LIMIT=rank_limit is not None, WRITE_FULL=h_full is not None,
        BLOCK_R=BLOCK_R, DOT_PRECISION=precision, **cfg,
    )
    return h, h_full


# ----------------------------------------------------------------------------- expand: C = s·h Bᵀ + bias


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, bias_ptr, c_ptr, limit_ptr, order_ptr,
    T, N, R, scale, H_PARTS,
    stride_ht, stride_hr, stride_hp, stride_bn, stride_br, stride_ct, stride_cn,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_LIMIT: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C = s·h Bᵀ + bias, or C += s·h Bᵀ + bias with ACCUMULATE (one read and one write of C).

    HAS_LIMIT (per-token rank): token t uses the first limit[t] columns of h only. A block whose
    largest limit is below R runs the 16-wide rank tiles up to it, skipping the rest; a block with a
    token at the full rank runs one full-width dot, as the static kernel does (four 16-wide dots in
    a loop instead cost a visible share of the whole layer). The limit is applied by a select after a
    load under the static kernel's mask, not as the load's mask: a mask that varies along the contiguous
    rank axis can keep the compiler from vectorizing the load (as the load's mask, the expand ran
    clearly slower than the static one; docs/dynamic-rank.md). dynamic_rank_forward
    passes the limit only with grouped tokens: in token order h comes limited from the shrink.
    GROUPED: the block's tokens are order[block's range] (tokens sorted by limit), so that most
    blocks hold one limit and skip every tile above it. Without a limit, h may arrive as H_PARTS partial
    sums stride_hp apart (the dy pass's g partials, for the fp8 backward's s·g A), added as loaded.
    """
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < T
    rows = offs_t
    if GROUPED:
        rows = tl.load(order_ptr + offs_t, mask=t_ok, other=0)
    if HAS_LIMIT:
        limit = tl.load(limit_ptr + rows, mask=t_ok, other=0)                                # (BT,)
        r_hi = tl.max(limit, 0)
        if r_hi >= R:
            offs_r = tl.arange(0, BLOCK_R)
            h = tl.load(h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                        mask=t_ok[:, None] & (offs_r[None, :] < R), other=0.0)              # (BT, BR) fp32
            h = tl.where(offs_r[None, :] < limit[:, None], h, 0.0)
            b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                        mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)     # (BR, BN)
            acc = tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, r_hi, 16):
                offs_r = r0 + tl.arange(0, 16)
                h = tl.load(h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                            mask=t_ok[:, None] & (offs_r[None, :] < R), other=0.0)          # (BT, 16) fp32
                h = tl.where(offs_r[None, :] < limit[:, None], h, 0.0)
                b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                            mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)     # (16, BN)
                acc = tl.dot(h, b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        acc = acc * scale
    else:
        offs_r = tl.arange(0, BLOCK_R)
        h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr
        h_ok = t_ok[:, None] & (offs_r[None, :] < R)
        h = tl.load(h_ptrs, mask=h_ok, other=0.0)                                          # (BT, BR) fp32
        for part in range(1, H_PARTS):
            h += tl.load(h_ptrs + part * stride_hp, mask=h_ok, other=0.0)
        b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                    mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)        # (BR, BN)
        acc = tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION) * scale
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = t_ok[:, None] & (offs_n[None, :] < N)
    c_ptrs = c_ptr + rows[:, None] * stride_ct + offs_n[None, :] * stride_cn
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


_EXPAND = TritonLauncher(_lora_expand_kernel)


def lora_expand(h: torch.Tensor, lora_B: torch.Tensor, scale: float, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, config: Optional[dict] = None, add_to: Optional[torch.Tensor] = None,
                rank_limit: Optional[torch.Tensor] = None, token_order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C = s·h Bᵀ + bias in out_dtype; with ``add_to``, add into that (T, N) tensor in place and return it.
    h (T, R) fp32, or its partial sums (P, T, R) (no rank_limit then), B (N, R). ``rank_limit`` (T,) int32:
    token t uses h[t, :rank_limit[t]] only; ``token_order`` (T,) int32, a permutation: blocks take their
    tokens in that order (see the kernel)."""
    h_parts = h.shape[0] if h.dim() == 3 else 1
    T, R = h.shape[-2:]
    N = lora_B.shape[0]
    c = torch.empty((T, N), device=h.device, dtype=out_dtype) if add_to is None else add_to
    cfg, grid, BLOCK_R, precision = grid_geometry("expand", h.device, T, N, R, out_dtype, config)
    _EXPAND(grid,
        h, lora_B, bias if bias is not None else h, c,
        rank_limit if rank_limit is not None else h, token_order if token_order is not None else h,
        T, N, R, scale, h_parts,
        *h.stride()[-2:], h.stride(0) if h_parts > 1 else 0, *lora_B.stride(), *c.stride(),
        HAS_BIAS=bias is not None, ACCUMULATE=add_to is not None, HAS_LIMIT=rank_limit is not None,
        GROUPED=token_order is not None, BLOCK_R=BLOCK_R,
        DOT_PRECISION=precision, **cfg,
    )
    return c


# ----------------------------------------------------------------------------- GEMM + low-rank epilogue


@triton.jit
def _lora_gemm_kernel(
    a_ptr, b_ptr, out_ptr, l_ptr, r_ptr, bias_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K, R, scale,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
    stride_lm, stride_lr, stride_rr, stride_rn,
    HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out = (a b)·[a_scale·b_scale] + s·L Rw + bias; a (M, K), b (K, N), L (M, R) fp32, Rw (R, N).

    HAS_SCALES: a and b are fp8 codes and the base product is dequantized by the two per-tensor scales
    (fp32 (1,) each) before the epilogue (ops.fp8.triton_fp8_matmul)."""
    # 1. tile order grouped along M so that consecutive programs reuse b tiles in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # 2. the base product
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_SCALES:
        acc = acc * tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
    # 3. epilogue: the low-rank term and the bias, added while the tile is in registers
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        lo = tl.load(l_ptr + offs_m[:, None] * stride_lm + offs_r[None, :] * stride_lr,
                     mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0.0)
        ro = tl.load(r_ptr + offs_r[:, None] * stride_rr + offs_n[None, :] * stride_rn,
                     mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)
        # accumulate into acc: a separate (BLOCK_M, BLOCK_N) product would double the registers
        acc = tl.dot(lo.to(tl.float32) * scale, ro.to(tl.float32), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_GEMM = TritonLauncher(_lora_gemm_kernel)


def _gemm_config(M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    # Hopper-sized tiles for bf16 / fp16; `sits-lora compile` can tune them per shape.
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def lora_gemm(a: torch.Tensor, b: torch.Tensor, lora_left: Optional[torch.Tensor], lora_right: Optional[torch.Tensor],
              scale: float, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
              config: Optional[dict] = None, scales: Optional[tuple] = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) + s·L (M, R) @ Rw (R, N) + bias, any strides, out (M, N) contiguous.

    ``scales`` (a_inv, b_inv): fp32 (1,) tensors multiplying a @ b (fp8 a and b, see ops.fp8)."""
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), device=a.device, dtype=out_dtype)
    cfg = dict(config or _gemm_config(M, N, K, a.dtype))
    has_lora = lora_left is not None
    R = lora_left.shape[1] if has_lora else 0
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    dummy = a
    _GEMM(grid,
        a, b, out, lora_left if has_lora else dummy, lora_right if has_lora else dummy,
        bias if bias is not None else dummy,
        scales[0] if scales is not None else dummy, scales[1] if scales is not None else dummy,
        M, N, K, R, scale,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        lora_left.stride(0) if has_lora else 0, lora_left.stride(1) if has_lora else 0,
        lora_right.stride(0) if has_lora else 0, lora_right.stride(1) if has_lora else 0,
        HAS_LORA=has_lora, HAS_BIAS=bias is not None, HAS_SCALES=scales is not None, BLOCK_R=block_rank(max(R, 1)),
        DOT_PRECISION=dot_precision(a.dtype), **cfg,
    )
    return out


# ----------------------------------------------------------------------------- tuning


def tune_layer_kernels(K: int, N: int, R: int, dtype: torch.dtype, device, tokens: int = 8192, save: bool = True,
                       skip: Optional[set] = None, product_input: bool = False) -> dict:
    """Measure every launch configuration of the four side kernels for one layer shape on this GPU.

    ``product_input``: also the x pass over an input read as its two SwiGLU factors ("x_pass_product": a down
    projection whose input the activations module rebuilds).

    Returns {kernel: {"best": config, "best_ms": ..., "default_ms": ...}}; the choices go to the
    on-disk cache that training reads (sits_lora.ops.tuning). Keys in ``skip`` (kernel, dims) are
    not measured again; measured ones are added to it.
    """
    T = tokens
    x = torch.randn(T, K, device=device, dtype=dtype)
    dy = torch.randn(T, N, device=device, dtype=dtype)
    A = torch.randn(R, K, device=device) / K**0.5
    B = torch.randn(N, R, device=device) / R**0.5
    h = lora_shrink(x, A)
    g, _ = lora_dy_pass(dy, B, h, 1.0)
    block_r = block_rank(R)
    runs = {
        "shrink": ((K, block_r), lambda cfg: lora_shrink(x, A, config=cfg)),
        "expand": ((N, block_r), lambda cfg: lora_expand(h, B, 1.0, None, dtype, config=cfg)),
        "dy_pass": ((N, block_r), lambda cfg: lora_dy_pass(dy, B, h, 1.0, config=cfg)),
        "x_pass": ((K, block_r), lambda cfg: lora_x_pass(x, A, g, 1.0, True, config=cfg)),
    }
    if product_input:
        factors = ProductInput(x, torch.randn_like(x), True)
        runs["x_pass_product"] = ((K, block_r), lambda cfg: lora_x_pass(factors, A, g, 1.0, True, config=cfg))
    report = {}
    for kernel, (dims, run) in runs.items():
        if skip is not None:
            if (kernel, dims) in skip:
                continue
            skip.add((kernel, dims))
        before = tuning.config_for(kernel, torch.device(device), dims, dtype)
        best, timings = tuning.tune(kernel, torch.device(device), dims, dtype, run, save=save)
        default = tuning.CONFIG_SPACE[kernel][0]
        report[kernel] = {
            "dims": list(dims),
            "best": best,
            "best_ms": min(ms for ms, _ in timings),
            "default_ms": next((ms for ms, cfg in timings if cfg == default), None),
            # what config_for gave before this run (an entry of a GPU of the same compute capability, say)
            "before": before,
            "before_ms": next((ms for ms, cfg in timings if cfg == before), None),
            "configs_tried": len(timings),
        }
    return report
