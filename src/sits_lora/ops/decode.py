"""The LoRA linear for a few rows (decoding: one token per sample) as one kernel, forward only.

While generating, a layer sees T = batch rows, one new token each. The frozen weight is read once per step whatever
T is, and at T <= 64 reading it is the whole cost: a merged model issues one GEMV-like GEMM per projection. The
training path's split (base GEMM, shrink, expand) or the small-call ATen path's three matmuls issue three launches
and three passes where the merged model has one; under CUDA graphs (sits_lora.serving.graph_decode), where launches
cost no host time, those extra kernels are most of what an unmerged adapter costs (bench/NOTES.md, "Decode steps
as CUDA graphs"). Here one program per tile of BLOCK_N output columns (and BLOCK_M rows) streams its stripe of W
and, alongside it, all of A, so that each program has the rows' h = x·Aᵀ (r numbers a row: recomputed per program
from L2, a fraction of the stripe's bytes) and adds s·h·B_tileᵀ before its one store:

    y[rows, tile] = x[rows] W[tile]ᵀ (+ b[tile]) + s · (x[rows] Aᵀ) B[tile]ᵀ        one launch, W read once

h is accumulated in fp32 and scaled before it is rounded to the activation dtype for the B product (PEFT rounds h
and the LoRA output separately: this path is at least as exact). Adapter weights in another dtype (PEFT keeps fp32
adapters over a bf16 base) are cast to the activation dtype as they are loaded. Block sizes are measured per GPU
and shape (``ops.tuning``, kernel "decode"; bench/decode_kernels.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .choice import DECODE_MAX_ROWS as MAX_ROWS   # above it the training kernels' split pays (prefill, training)
from .fused import block_rank, cdiv, dot_precision
from .launch import TritonLauncher
from .tuning import config_for


def rows_block(rows: int) -> int:
    """The row block a call of ``rows`` rows runs at (tl.dot needs 16): 16, 32 or 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


@triton.jit
def _lora_decode_kernel(
    x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, y_ptr,
    M, N, K, R, scaling,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ar, stride_ak, stride_bn, stride_br, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty     # the activation dtype: every product runs in it
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    r_ok = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)                          # (BM, BK)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)                          # (BK, BN)
        acc = tl.dot(x, w.to(dtype), acc, input_precision=DOT_PRECISION)
        a = tl.load(a_ptr + offs_r[None, :] * stride_ar + k[:, None] * stride_ak,
                    mask=r_ok[None, :] & k_ok[:, None], other=0.0)                          # (BK, BR)
        h = tl.dot(x, a.to(dtype), h, input_precision=DOT_PRECISION)
    b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                mask=r_ok[:, None] & n_ok[None, :], other=0.0)                              # (BR, BN)
    acc = tl.dot((h * scaling).to(dtype), b.to(dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


_DECODE = TritonLauncher(_lora_decode_kernel)
# Shared memory a configuration may plan for: under the H200's 227 KiB a block (and under the A100's 163 KiB)
_SMEM_BUDGET = 160 * 1024
_FITTED: dict = {}   # (the tuned configuration's items, row block, rank block, dtype sizes) -> the fitted one


def fitted(cfg: dict, block_m: int, block_r: int, x_bytes: int, adapter_bytes: int) -> dict:
    """``cfg`` with BLOCK_K, then num_stages, lowered until one pipeline of x, W and A tiles fits the shared memory
    budget (a tuned configuration was measured at one row block and rank; a call may bring larger ones)."""
    cfg = dict(cfg)

    def need(c):
        per_stage = c["BLOCK_K"] * (block_m * x_bytes + c["BLOCK_N"] * x_bytes + block_r * adapter_bytes)
        return per_stage * c["num_stages"]

    while need(cfg) > _SMEM_BUDGET and cfg["BLOCK_K"] > 32:
        cfg["BLOCK_K"] //= 2
    while need(cfg) > _SMEM_BUDGET and cfg["num_stages"] > 1:
        cfg["num_stages"] -= 1
    return cfg


def lora_linear_decode(x: Tensor, weight: Tensor, bias: Optional[Tensor], lora_A: Tensor, lora_B: Tensor,
                       scaling: float, config: Optional[dict] = None) -> Tensor:
    """y = x Wᵀ + b + s·(x Aᵀ) Bᵀ in one kernel for x of at most :data:`MAX_ROWS` rows (any leading shape), W in x's
    dtype; no autograd (a call that needs gradients takes the training path). ``config``: launch configuration
    (BLOCK_N, BLOCK_K, num_warps, num_stages) instead of the tuned one (tuning, benchmarks)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N, R = x2.shape[0], weight.shape[0], lora_A.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"lora_linear_decode: {M} rows; the decode kernel takes at most {MAX_ROWS}")
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    BLOCK_M, BLOCK_R = rows_block(M), block_rank(R)
    if config is None:   # a decode step makes this call per projection: the fitting is looked up, not redone
        tuned = config_for("decode", x.device, (BLOCK_M, K, N, BLOCK_R), x.dtype)
        key = (tuple(tuned.items()), BLOCK_M, BLOCK_R, x.element_size(), lora_A.element_size())
        config = _FITTED.get(key)
        if config is None:
            config = _FITTED[key] = fitted(tuned, BLOCK_M, BLOCK_R, x.element_size(), lora_A.element_size())
    cfg = config
    BLOCK_N = cfg["BLOCK_N"]
    _DECODE((cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)), x2, weight, bias if bias is not None else weight, lora_A, lora_B,
            y, M, N, K, R, float(scaling),
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), lora_A.stride(0), lora_A.stride(1),
            lora_B.stride(0), lora_B.stride(1), y.stride(0), y.stride(1),
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=cfg["BLOCK_K"], BLOCK_R=BLOCK_R,
            DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.view(*x.shape[:-1], N)


__all__ = ["MAX_ROWS", "fitted", "lora_linear_decode", "rows_block"]
