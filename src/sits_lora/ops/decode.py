"""The LoRA linear for a few rows (decoding: one token per sample) as one kernel, forward only.

While generating, a layer sees T = batch rows, one new token each. The frozen weight is read once per step whatever
T is, and at T <= 64 reading it is the whole cost: a merged model issues one GEMV-like GEMM per projection. The
training path's split (base GEMM, shrink, expand) or the small-call ATen path's three matmuls issue three launches
and three passes where the merged model has one; under CUDA graphs (sits_lora.serving.graph_decode), where launches
cost no host time, those extra kernels are most of what an unmerged adapter costs (docs/serving.md, "Decode steps
as CUDA graphs"). Here one program per tile of BLOCK_N output columns (and BLOCK_M rows) streams its stripe of W
and, alongside it, all of A, so that each program has the rows' h = x·Aᵀ (r numbers a row: recomputed per program
from L2, a fraction of the stripe's bytes) and adds s·h·B_tileᵀ before its one store:

    y[rows, tile] = x[rows] W[tile]ᵀ (+ b[tile]) + s · (x[rows] Aᵀ) B[tile]ᵀ        one launch, W read once

h is accumulated in fp32 and scaled before it is rounded to the activation dtype for the B product (PEFT rounds h
and the LoRA output separately: this path is at least as exact). Adapter weights in another dtype (PEFT keeps fp32
adapters over a bf16 base) are cast to the activation dtype as they are loaded. Block sizes are measured per GPU
and shape (``ops.tuning``, kernel "decode"; bench/decode_kernels.py).

Split K (a configuration's ``SPLIT_K`` > 1): a long K (a down projection's 8192 or 14336) leaves N / BLOCK_N
programs, too few to stream W at the GPU's bandwidth. Each of SPLIT_K programs per tile then takes one slice of K:
its part of x Wᵀ and of h, and s·h_slice·B_tileᵀ (the LoRA term is linear in h, so the slices' terms add up to
it), written in fp32 to its own plane of a (SPLIT_K, M, N) buffer; a second small kernel adds the planes in a fixed
order (deterministic, unlike atomics) and rounds once. Two launches instead of one: it pays only where the tuning
measured it faster, and the default configuration does not split.

Several adapters in one batch (``lora_linear_decode_mixed``, PEFT's ``adapter_names`` while decoding): the same
kernel reads the adapters' stacks (ops.mixed_batch.stack_adapters) as one LoRA of rank G·R_max, h = x·A_allᵀ, then
keeps, for each row, only its own adapter's R_max columns of h, scaled by that adapter's s (a row of no adapter
keeps none), before the B product: one launch per projection where the segmented path issues the base GEMM, a
shrink and an expand. Every program reads all the adapters' A (G times a single adapter's, from L2), which is
why serving.mixed_batch passes stacks cast to the activations' dtype (half the bytes of PEFT's fp32 adapters).

Sibling projections (``lora_linear_decode_siblings``: q / k / v, gate / up, which read the same x): one launch
computes all of them. The grid is the siblings' output tiles one after another; a program finds its sibling from its
tile index, picks that sibling's W, b, A, B, s and output, and reads them with sibling 0's strides (so they must
share dtype, strides and rank: ``siblings_fuse``); each sibling gets its own contiguous output (with split K, its
columns of the planes, which the summing kernel hands to its output). A decode call's cost at these sizes is mostly
not its bytes (a 1B k / v projection reads 2 MB, well under a microsecond at the GPU's bandwidth, and the call
takes several times that): the group's one launch replaces the merged model's three GEMMs (two for gate / up). The
configuration is tuned at the group's total width.

One row (batch-1 decoding): tl.dot needs 16 rows, so the call above pads the row to 16 and the products run on
tensor cores over a staged W tile. ``_lora_decode_gemv_kernel`` instead multiplies each loaded W tile with the row
in registers and sums along K (a GEMV: fp32 products of the activation-dtype values, as the dot's), h likewise from
A, then rounds s·h to the activation dtype before the B product, as above. It runs only where a measured
configuration of its own is stored (``tuning.measured_config("decode_gemv", ...)``, which bench/decode_kernels.py
writes where it beat the tuned dot kernel), or when a call's ``config`` says ``GEMV=True``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .choice import DECODE_MAX_ROWS as MAX_ROWS   # above it the training kernels' split pays (prefill, training)
from .geometry import block_rank, cdiv, dot_precision
from .launch import TritonLauncher
from .tuning import config_for, measured_config


def rows_block(rows: int) -> int:
    """The row block a call of ``rows`` rows runs at (tl.dot needs 16): 16, 32 or 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


@triton.jit
def _lora_decode_kernel(
    x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, y_ptr, row_adapter_ptr, scale_ptr,
    M, N, K, R, scaling, rank_per_adapter, k_per_split, stride_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ar, stride_ak, stride_bn, stride_br, stride_ym, stride_yn,
    tiles_1, tiles_2, n_1, n_2, s_1, s_2, w_1, w_2, bias_1, bias_2, a_1, a_2, b_1, b_2, y_1, y_2, ym_1, ym_2,
    scale_1, scale_2,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, MIXED: tl.constexpr, SIBLINGS: tl.constexpr,
):
    dtype = x_ptr.dtype.element_ty     # the activation dtype: every product runs in it
    split = tl.program_id(2)           # the slice of K (0 when the call does not split)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    tile = tl.program_id(0)
    if SIBLINGS > 1:   # output tiles from tiles_1 on are sibling 1's, from tiles_2 on sibling 2's (module docstring)
        second = tile >= tiles_1
        third = tile >= tiles_2
        tile -= tl.where(third, tiles_2, tl.where(second, tiles_1, 0))
        N = tl.where(third, n_2, tl.where(second, n_1, N))
        scaling = tl.where(third, s_2, tl.where(second, s_1, scaling))
        w_ptr = tl.where(third, w_2, tl.where(second, w_1, w_ptr))
        bias_ptr = tl.where(third, bias_2, tl.where(second, bias_1, bias_ptr))
        a_ptr = tl.where(third, a_2, tl.where(second, a_1, a_ptr))
        b_ptr = tl.where(third, b_2, tl.where(second, b_1, b_ptr))
        y_ptr = tl.where(third, y_2, tl.where(second, y_1, y_ptr))
        if MIXED:
            scale_ptr = tl.where(third, scale_2, tl.where(second, scale_1, scale_ptr))
        stride_ym = tl.where(third, ym_2, tl.where(second, ym_1, stride_ym))
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    r_ok = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_end
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
    if MIXED:   # each row keeps its own adapter's columns of h (rank_per_adapter of them), scaled by its s
        column_adapter = offs_r // rank_per_adapter
        row_adapter = tl.load(row_adapter_ptr + offs_m, mask=m_ok, other=-1)
        column_scale = tl.load(scale_ptr + column_adapter, mask=r_ok, other=0.0)
        keep = (row_adapter[:, None] == column_adapter[None, :]) & r_ok[None, :]
        h = tl.where(keep, h * column_scale[None, :], 0.0)
    else:
        h = h * scaling
    acc = tl.dot(h.to(dtype), b.to(dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:   # once: by the first slice
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    tl.store(y_ptr + split * stride_split + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _lora_decode_gemv_kernel(
    x_ptr, w_ptr, bias_ptr, a_ptr, b_ptr, y_ptr,
    N, K, R, scaling, k_per_split, stride_split,
    stride_xk, stride_wn, stride_wk, stride_ar, stride_ak, stride_bn, stride_br,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One row: y[tile] = x W[tile]ᵀ (+ b[tile]) + s·(x Aᵀ) B[tile]ᵀ, products summed along K in registers."""
    dtype = x_ptr.dtype.element_ty
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    r_ok = offs_r < R
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_end
        x = tl.load(x_ptr + k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)                   # (BK,)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :] * stride_wk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)                                # (BN, BK)
        acc += tl.sum(w.to(dtype).to(tl.float32) * x[None, :], axis=1)
        a = tl.load(a_ptr + offs_r[:, None] * stride_ar + k[None, :] * stride_ak,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)                                # (BR, BK)
        h += tl.sum(a.to(dtype).to(tl.float32) * x[None, :], axis=1)
    b = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)                                    # (BN, BR)
    hs = (h * scaling).to(dtype).to(tl.float32)
    acc += tl.sum(b.to(dtype).to(tl.float32) * hs[None, :], axis=1)
    if HAS_BIAS:   # once: by the first slice
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)
    tl.store(y_ptr + split * stride_split + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_splits_kernel(parts_ptr, y_ptr, size, width, col_1, col_2, n_0, n_1, n_2, y_1, y_2,
                       SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, SIBLINGS: tl.constexpr):
    """y = the sum of the SPLIT_K planes of ``parts`` (each ``size`` fp32 values), in plane order, rounded once.
    Siblings: a plane's rows are ``width`` wide, sibling 1's columns from col_1 on, sibling 2's from col_2 on; each
    sibling's sum goes to its own output (y_ptr, y_1, y_2; rows n_0, n_1, n_2 wide)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(parts_ptr + split * size + offs, mask=ok, other=0.0)
    dest = y_ptr + offs
    if SIBLINGS > 1:
        row = offs // width
        col = offs % width
        second = col >= col_1
        third = col >= col_2
        at = row * tl.where(third, n_2, tl.where(second, n_1, n_0)) + col - tl.where(third, col_2,
                                                                                     tl.where(second, col_1, 0))
        dest = tl.where(third, y_2 + at, tl.where(second, y_1 + at, y_ptr + at))
    tl.store(dest, acc.to(y_ptr.dtype.element_ty), mask=ok)


_DECODE = TritonLauncher(_lora_decode_kernel)
_DECODE_GEMV = TritonLauncher(_lora_decode_gemv_kernel)
_SUM_SPLITS = TritonLauncher(_sum_splits_kernel)
_SUM_BLOCK = 1024
# Shared memory a configuration may plan for: under Hopper GPUs' 227 KiB a block (and under the 163 KiB of the
# data-center GPUs of the generation before)
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
    (BLOCK_N, BLOCK_K, num_warps, num_stages, optionally SPLIT_K; GEMV=True for the one-row kernel) instead of the
    tuned one (tuning, benchmarks)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], weight.shape[0]
    gemv = None
    if config is None and M == 1:   # one row: the one-row kernel where it was measured faster on this GPU and shape
        gemv = measured_config("decode_gemv", x.device, (K, N, block_rank(lora_A.shape[0])), x.dtype)
    elif config is not None and config.get("GEMV", False):
        gemv = config
    if gemv is not None:
        if M != 1:
            raise ValueError(f"lora_linear_decode: config GEMV=True runs one row; this call has {M}")
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        return _gemv(x2, weight, bias, lora_A, lora_B, float(scaling), gemv, y).view(*x.shape[:-1], N)
    return _decode(x, [(weight, bias, lora_A, lora_B, float(scaling))], None, lora_A.shape[0], config)[0]


def lora_linear_decode_siblings(x: Tensor, siblings: list, config: Optional[dict] = None) -> list:
    """Each sibling's y_i = x W_iᵀ + b_i + s_i·(x A_iᵀ) B_iᵀ, from one kernel, for two or three projections that read
    the same x (q / k / v, gate / up): ``siblings`` a list of (W, b or None, A, B, s), one output each. Their W, A and
    B must share dtype, strides and rank, and have a bias all or none (:func:`siblings_fuse` says whether they do)."""
    if not 1 <= len(siblings) <= 3 or not siblings_fuse(siblings):
        raise ValueError(f"lora_linear_decode_siblings: {len(siblings)} projections; one kernel takes 1 to 3 whose W, "
                         "A and B share dtype, layout and rank, with a bias on all or none")
    return _decode(x, [(w, b, A, B, float(s)) for w, b, A, B, s in siblings], None, siblings[0][2].shape[0], config)


def siblings_fuse(siblings: list) -> bool:
    """Whether projections (W, b, A, B, s) can share one decode kernel: the kernel reads siblings 1 and 2 with
    sibling 0's strides and dtypes, so the tensors at each position must agree in both, and the ranks must be
    equal."""
    first = siblings[0]
    for other in siblings[1:]:
        for t0, t in zip(first, other):
            if (t0 is None) != (t is None):
                return False
            if isinstance(t0, Tensor) and (t.dtype != t0.dtype or t.device != t0.device or t.dim() != t0.dim()
                                           or t.shape[1:] != t0.shape[1:] or t.stride() != t0.stride()):
                return False
    return True


def lora_linear_decode_mixed(x: Tensor, weight: Tensor, bias: Optional[Tensor], A: Tensor, B: Tensor,
                             scalings: Tensor, row_adapter: Tensor, config: Optional[dict] = None) -> Tensor:
    """y = x Wᵀ + b, plus for each row i of adapter g = row_adapter[i] (-1: none) s_g·(x_i A_gᵀ) B_gᵀ, in one
    kernel for at most :data:`MAX_ROWS` rows (module docstring). A (G, R_max, K), B (G, N, R_max) and scalings (G,) as
    ops.mixed_batch.stack_adapters makes them; row_adapter one integer per row of x flattened to (rows, K)."""
    return lora_linear_decode_mixed_siblings(x, [(weight, bias, A, B, scalings)], row_adapter, config)[0]


def lora_linear_decode_mixed_siblings(x: Tensor, siblings: list, row_adapter: Tensor,
                                      config: Optional[dict] = None) -> list:
    """:func:`lora_linear_decode_mixed` for one to three projections of one x from one kernel: ``siblings`` a list of
    (W, b, A, B, scalings) with each projection's stacks, one output each. Their stacks must hold the same adapters
    at the same rank (``row_adapter`` indexes all of them) and share dtypes and layouts."""
    projections = []
    for weight, bias, A, B, scalings in siblings:
        G, R, K = A.shape
        if B.shape != (G, weight.shape[0], R) or scalings.shape != (G,):
            raise ValueError(f"lora_linear_decode_mixed: stacks of {G} adapters expected as A (G, R, K) "
                             f"{tuple(A.shape)}, B (G, N, R) {tuple(B.shape)}, scalings (G,) {tuple(scalings.shape)}")
        # one LoRA of rank G·R: A's rows and B's columns adapter after adapter (views for stack_adapters' layouts)
        projections.append((weight, bias, A.reshape(G * R, K), B.permute(1, 0, 2).reshape(weight.shape[0], G * R),
                            scalings))
    shapes = {tuple(A.shape) for _, _, A, _, _ in siblings}
    if len(siblings) > 1 and (len(shapes) > 1 or not siblings_fuse(projections) or len(siblings) > 3):
        raise ValueError(f"lora_linear_decode_mixed: {len(siblings)} projections; one kernel takes 1 to 3 whose "
                         "stacks hold the same adapters at the same rank, with the same dtypes and layouts")
    K = x.shape[-1]
    if row_adapter.numel() != x.numel() // K:
        raise ValueError(f"lora_linear_decode_mixed: {row_adapter.numel()} row adapters for {x.numel() // K} rows")
    return _decode(x, projections, row_adapter, siblings[0][2].shape[1], config)


def _split_plan(K: int, cfg: dict) -> tuple:
    """(slices, K per slice): a slice is whole K blocks, no more slices than blocks."""
    split_k = max(1, min(int(cfg.get("SPLIT_K", 1)), cdiv(K, cfg["BLOCK_K"])))
    return split_k, cdiv(cdiv(K, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]


def _decode(x: Tensor, siblings: list, row_adapter: Optional[Tensor], rank_per_adapter: int,
            config: Optional[dict]) -> list:
    """siblings: (W, b, A, B, s) each; with row_adapter (a mixed batch) s is the adapters' scalings (G,)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    weight, bias, lora_A, lora_B, _ = siblings[0]
    widths = [s[0].shape[0] for s in siblings]
    M, N, R = x2.shape[0], sum(widths), lora_A.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"lora_linear_decode: {M} rows; the decode kernel takes at most {MAX_ROWS}")
    ys = [torch.empty((M, n), device=x.device, dtype=x.dtype) for n in widths]
    BLOCK_M, BLOCK_R = rows_block(M), block_rank(R)
    if config is None:   # a decode step makes this call per projection: the fitting is looked up, not redone
        tuned = config_for("decode", x.device, (BLOCK_M, K, N, BLOCK_R), x.dtype)
        key = (tuple(tuned.items()), BLOCK_M, BLOCK_R, x.element_size(), lora_A.element_size())
        config = _FITTED.get(key)
        if config is None:
            config = _FITTED[key] = fitted(tuned, BLOCK_M, BLOCK_R, x.element_size(), lora_A.element_size())
    cfg = config
    BLOCK_N, BLOCK_K = cfg["BLOCK_N"], cfg["BLOCK_K"]
    # a slice with nothing left of K writes zeros (its plane must still be written)
    split_k, k_per_split = _split_plan(K, cfg)
    tiles = [cdiv(n, BLOCK_N) for n in widths] + [0, 0]
    columns = [0, widths[0], widths[0] + (widths[1] if len(widths) > 1 else 0)]
    if split_k == 1:   # each sibling's tiles go to its own output
        out = ys[0]
        outs, out_rows = ys + [ys[0]] * (3 - len(ys)), widths + [0, 0]
    else:              # to its columns of the planes, summed into its output below
        out = torch.empty((split_k, M, N), device=x.device, dtype=torch.float32)
        outs, out_rows = [out[..., c:] for c in columns], [N] * 3
    # siblings 1 and 2 (unused ones: sibling 0 again); a missing bias: W, never read (HAS_BIAS)
    more = siblings[1:] + [siblings[0]] * (3 - len(siblings))
    W1, W2 = more[0][0], more[1][0]
    b1, b2 = (W1 if more[0][1] is None else more[0][1]), (W2 if more[1][1] is None else more[1][1])
    mixed = row_adapter is not None
    # a mixed batch reads each sibling's scalings (G,) from memory; one adapter's scaling is a number
    scales, numbers = ([s[4] for s in (siblings[0], *more)], [1.0] * 3) if mixed else ([out] * 3, [
        s[4] for s in (siblings[0], *more)])
    _DECODE((sum(tiles), cdiv(M, BLOCK_M), split_k), x2, weight, bias if bias is not None else weight, lora_A,
            lora_B, out, row_adapter if mixed else out, scales[0], M, widths[0], K, R, numbers[0],
            rank_per_adapter, k_per_split, M * N if split_k > 1 else 0,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), lora_A.stride(0), lora_A.stride(1),
            lora_B.stride(0), lora_B.stride(1), out_rows[0], out.stride(-1),
            tiles[0], tiles[0] + tiles[1], W1.shape[0], W2.shape[0], numbers[1], numbers[2],
            W1, W2, b1, b2, more[0][2], more[1][2], more[0][3], more[1][3], outs[1], outs[2], out_rows[1], out_rows[2],
            scales[1], scales[2],
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R,
            DOT_PRECISION=dot_precision(x.dtype), MIXED=mixed, SIBLINGS=len(siblings), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    if split_k > 1:
        _sum_splits(out, ys, columns)
    return [y.view(*x.shape[:-1], n) for y, n in zip(ys, widths)]


def _sum_splits(planes: Tensor, ys: list, columns: list) -> None:
    """ys (each (M, n_i)) = the planes' sum over their first dimension, sibling i's columns from columns[i] on."""
    split_k, M, N = planes.shape
    widths = [y.shape[-1] for y in ys] + [0, 0]
    outs = ys + [ys[0]] * (3 - len(ys))
    cols = [columns[1] if len(ys) > 1 else N, columns[2] if len(ys) > 2 else N]
    _SUM_SPLITS((cdiv(M * N, _SUM_BLOCK),), planes, ys[0], M * N, N, cols[0], cols[1], widths[0], widths[1], widths[2],
                outs[1], outs[2], SPLIT_K=split_k, BLOCK=_SUM_BLOCK, SIBLINGS=len(ys), num_warps=4)


def _gemv(x2: Tensor, weight: Tensor, bias: Optional[Tensor], lora_A: Tensor, lora_B: Tensor, scaling: float,
          cfg: dict, y: Tensor) -> Tensor:
    K, N, R = x2.shape[1], weight.shape[0], lora_A.shape[0]
    BLOCK_N, BLOCK_K = cfg["BLOCK_N"], cfg["BLOCK_K"]
    split_k, k_per_split = _split_plan(K, cfg)
    out = y if split_k == 1 else torch.empty((split_k, 1, N), device=x2.device, dtype=torch.float32)
    _DECODE_GEMV((cdiv(N, BLOCK_N), split_k), x2, weight, bias if bias is not None else weight, lora_A, lora_B, out,
                 N, K, R, float(scaling), k_per_split, N if split_k > 1 else 0,
                 x2.stride(1), weight.stride(0), weight.stride(1), lora_A.stride(0), lora_A.stride(1),
                 lora_B.stride(0), lora_B.stride(1),
                 HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_R=block_rank(R),
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split_k > 1:
        _sum_splits(out, [y], [0])
    return y


__all__ = ["MAX_ROWS", "fitted", "lora_linear_decode", "lora_linear_decode_mixed", "lora_linear_decode_mixed_siblings",
           "lora_linear_decode_siblings", "rows_block", "siblings_fuse"]
