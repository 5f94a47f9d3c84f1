"""Several adapters in one batch: each sample's rows take their own adapter's LoRA, in one segmented shrink and one
segmented expand, however many adapters the batch holds.

PEFT serves a batch whose samples ask for different adapters (``model(..., adapter_names=[...])``) with a Python
loop over the adapters: per adapter, an index of its samples, a gather of their rows, two small matmuls and a
scatter-add: four launches and a host round of indexing per adapter and layer. Here the rows are grouped by adapter
once per batch (``MixedBatchPlan``: the rows in adapter order and a table of row blocks, each block inside one
adapter's rows, made on the host from the names and shared by every layer of the model), and two kernels run the
whole batch:

    shrink   h[row] = x[row] A_gᵀ           one program per row block (block of adapter g), h (T, R_max) fp32
    expand   y[row] += s_g · h[row] B_gᵀ    one program per row block and output tile, in place on the base output

with every adapter's A and B stacked (``stack_adapters``: (G, R_max, K) and (G, N, R_max), ranks zero-padded) so
that a program reads its block's adapter by index. Rows whose sample takes no adapter ("__base__", or an adapter
this layer does not have) are in no block: their output is the base layer's. Forward only: PEFT refuses
``adapter_names`` in training mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .geometry import block_rank, cdiv, dot_precision
from .launch import TritonLauncher

BLOCK_ROWS = 16   # rows per block: tl.dot needs 16; a decode batch has one row per sample, so blocks of one adapter's
                  # samples are as full as the batch has samples of it


@dataclass(frozen=True)
class MixedBatchPlan:
    """The rows of a batch grouped by adapter: ``order`` (rows in adapter order, int32, on the device) and
    ``blocks`` ((n, 3) int32: start and end in ``order``, adapter index), ``row_adapter`` ((rows,) int64, -1 for no
    adapter; on the device, for the reference)."""

    order: torch.Tensor
    blocks: torch.Tensor
    row_adapter: torch.Tensor


def mixed_batch_plan(sample_adapter: Sequence[int], rows_per_sample: int, device) -> MixedBatchPlan:
    """The plan for samples whose adapter index is ``sample_adapter[b]`` (-1: none), each ``rows_per_sample`` rows
    of the flattened input (sample b is rows b·rows_per_sample ... (b+1)·rows_per_sample - 1)."""
    row_adapter = torch.tensor(list(sample_adapter), dtype=torch.int64).repeat_interleave(rows_per_sample)
    adapted = (row_adapter >= 0).nonzero().squeeze(1)
    by_adapter = torch.argsort(row_adapter[adapted], stable=True)
    order = adapted[by_adapter]                                                  # rows in adapter order
    adapters, counts = torch.unique_consecutive(row_adapter[order], return_counts=True)
    blocks, start = [], 0
    for g, count in zip(adapters.tolist(), counts.tolist()):
        blocks += [(s, min(s + BLOCK_ROWS, start + count), g) for s in range(start, start + count, BLOCK_ROWS)]
        start += count
    return MixedBatchPlan(
        order=(order if order.numel() else torch.zeros(1, dtype=torch.int64)).to(torch.int32).to(device),
        blocks=torch.tensor(blocks or [(0, 0, 0)], dtype=torch.int32).reshape(-1, 3).to(device),
        row_adapter=row_adapter.to(device),
    )


def stack_adapters(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], scalings: Sequence[float]):
    """(A (G, R_max, K), B (G, N, R_max), scalings (G,) fp32) of adapters with ranks r_g (A_g (r_g, K),
    B_g (N, r_g)), in the promotion of their dtypes, zero beyond each rank. A is contiguous, so A viewed as
    (G·R_max, K) is every adapter's rows in turn; B is laid out (N, G, R_max) in memory (a permuted view), so B
    viewed as (N, G·R_max) is every adapter's columns in turn: the one-kernel decode path
    (ops.decode.lora_linear_decode_mixed) reads the stacks as one LoRA of rank G·R_max."""
    R = max(a.shape[0] for a in As)
    dtype = torch.result_type(As[0], Bs[0])
    for a, b in zip(As[1:], Bs[1:]):
        dtype = torch.promote_types(dtype, torch.promote_types(a.dtype, b.dtype))
    K, N, device = As[0].shape[1], Bs[0].shape[0], As[0].device
    A = torch.zeros((len(As), R, K), dtype=dtype, device=device)
    B = torch.zeros((N, len(Bs), R), dtype=dtype, device=device).permute(1, 0, 2)
    for g, (a, b) in enumerate(zip(As, Bs)):
        A[g, : a.shape[0]] = a
        B[g, :, : b.shape[1]] = b
    return A, B, torch.tensor([float(s) for s in scalings], dtype=torch.float32, device=device)


@triton.jit
def _block_rows(order_ptr, blocks_ptr, block, BLOCK_T: tl.constexpr):
    """(rows (BT,) int64, which of them are in the block, adapter g) of row block ``block``."""
    start = tl.load(blocks_ptr + block * 3)
    end = tl.load(blocks_ptr + block * 3 + 1)
    g = tl.load(blocks_ptr + block * 3 + 2).to(tl.int64)
    offs = start + tl.arange(0, BLOCK_T)
    ok = offs < end
    rows = tl.load(order_ptr + offs, mask=ok, other=0).to(tl.int64)
    return rows, ok, g


@triton.jit
def _lora_mixed_shrink_kernel(
    x_ptr, a_ptr, h_ptr, order_ptr, blocks_ptr,
    K, R,
    stride_xt, stride_xk, stride_ag, stride_ar, stride_ak, stride_ht, stride_hr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """h[row] = x[row] A_gᵀ for the rows order[start:end] of one block of adapter g."""
    rows, ok, g = _block_rows(order_ptr, blocks_ptr, tl.program_id(0), BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :] * stride_xk,
                    mask=ok[:, None] & (k[None, :] < K), other=0.0)                          # (BT, BK)
        a = tl.load(a_ptr + g * stride_ag + k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                    mask=(k[:, None] < K) & (offs_r[None, :] < R), other=0.0)                # (BK, BR)
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=DOT_PRECISION)
    tl.store(h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr, acc,
             mask=ok[:, None] & (offs_r[None, :] < R))


@triton.jit
def _lora_mixed_expand_kernel(
    h_ptr, b_ptr, scale_ptr, y_ptr, order_ptr, blocks_ptr,
    N, R,
    stride_ht, stride_hr, stride_bg, stride_bn, stride_br, stride_yt, stride_yn,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """y[row, tile] += s_g · h[row] B_g[tile]ᵀ for the rows order[start:end] of one block of adapter g."""
    rows, ok, g = _block_rows(order_ptr, blocks_ptr, tl.program_id(0), BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                mask=ok[:, None] & (offs_r[None, :] < R), other=0.0)                         # (BT, BR) fp32
    b = tl.load(b_ptr + g * stride_bg + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)               # (BR, BN)
    acc = tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION) * tl.load(scale_ptr + g)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y_ok = ok[:, None] & (offs_n[None, :] < N)
    y = tl.load(y_ptrs, mask=y_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=y_ok)


_SHRINK = TritonLauncher(_lora_mixed_shrink_kernel)
_EXPAND = TritonLauncher(_lora_mixed_expand_kernel)


def lora_mixed_batch_triton(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                            scalings: torch.Tensor, plan: MixedBatchPlan) -> torch.Tensor:
    """y (rows, N), the base layer's output, plus each row's adapter's LoRA, in place; x (rows, K). A (G, R, K),
    B (G, N, R), scalings (G,) fp32 as ``stack_adapters`` makes them."""
    rows, K = x.shape
    N, R = B.shape[1], B.shape[2]
    n_blocks = plan.blocks.shape[0]
    h = torch.empty((rows, R), device=x.device, dtype=torch.float32)
    BLOCK_R = block_rank(R)
    precision = dot_precision(x.dtype)
    _SHRINK((n_blocks,), x, A, h, plan.order, plan.blocks, K, R,
            x.stride(0), x.stride(1), A.stride(0), A.stride(1), A.stride(2), h.stride(0), h.stride(1),
            BLOCK_T=BLOCK_ROWS, BLOCK_K=64, BLOCK_R=BLOCK_R, DOT_PRECISION=precision)
    BLOCK_N = 64
    _EXPAND((n_blocks, cdiv(N, BLOCK_N)), h, B, scalings, y, plan.order, plan.blocks, N, R,
            h.stride(0), h.stride(1), B.stride(0), B.stride(1), B.stride(2), y.stride(0), y.stride(1),
            BLOCK_T=BLOCK_ROWS, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PRECISION=precision)
    return y


def lora_mixed_batch_reference(x: torch.Tensor, y: torch.Tensor, As: Sequence[torch.Tensor],
                               Bs: Sequence[torch.Tensor], scalings: Sequence[float],
                               row_adapter: torch.Tensor) -> torch.Tensor:
    """The oracle, as PEFT's mixed batch computes it: y + per adapter g, s_g · (x[rows of g] A_gᵀ) B_gᵀ in the
    adapter's dtype (a new tensor)."""
    out = y.clone()
    for g, (a, b, s) in enumerate(zip(As, Bs, scalings)):
        index = (row_adapter == g).nonzero().squeeze(1)
        if index.numel():
            out[index] += ((x[index].to(a.dtype) @ a.t()) @ b.t() * s).to(out.dtype)
    return out
