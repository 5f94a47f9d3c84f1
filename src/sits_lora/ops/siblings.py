"""Several LoRA linears that read the same x (q/k/v, gate/up) as one op: one shrink pass over x forward,
one x pass for every dA and one dx backward (``sits_lora.layers.siblings`` decides which layers form a group)."""

from __future__ import annotations

from typing import Optional

import torch

from .choice import fused_kernels, gemm_backend


def lora_siblings_forward(x, weights, biases, lora_As, lora_Bs, scales, gemm: str):
    """Outputs of several LoRA linears on the same 2-D x, with one shrink pass for all of them.

    Returns (outputs, h, A) with A = [A_1; A_2; ...] (ΣR, K) and h = x Aᵀ (T, ΣR) in fp32 (A is kept for
    the backward: one concatenation per step, not two).
    """
    kernels = fused_kernels()

    ranks = [a.shape[0] for a in lora_As]
    A_all = torch.cat(lora_As) if len(lora_As) > 1 else lora_As[0]
    h = kernels.lora_shrink(x, A_all)
    outputs = []
    start = 0
    for W, b, B, s, r in zip(weights, biases, lora_Bs, scales, ranks):
        h_i = h[:, start:start + r]
        start += r
        if gemm == "triton":
            outputs.append(kernels.lora_gemm(x, W.t(), h_i, B.t(), s, b, x.dtype))
        else:
            y = kernels.lora_expand(h_i, B, s, b, x.dtype)
            y.addmm_(x, W.t())
            outputs.append(y)
    return outputs, h, A_all


def lora_siblings_backward(grads, x, weights, lora_As, lora_Bs, h, scales, gemm: str, need_dx: bool, A_all=None):
    """(dx, dAs, dBs) for siblings on one x: one read of x for every dA, one dx for all of them.

    Each sibling's dy pass writes its g, scaled by its s, into its columns of one (S, T, ΣR) stack of
    partial sums (S: the most splits any sibling wants; a sibling with fewer writes zeros past its N),
    so the one x pass reads every g with s = 1. dA's and every dB's partials are summed in one launch
    (four stacks per launch). ``grads`` may hold None for an output that received no gradient.
    """
    kernels = fused_kernels()

    ranks = [a.shape[0] for a in lora_As]
    T = x.shape[0]
    if A_all is None:
        A_all = torch.cat(lora_As) if len(lora_As) > 1 else lora_As[0]
    live = [(dy, W) for dy, W in zip(grads, weights) if dy is not None]
    splits = max(kernels.dy_pass_splits(dy, r) for dy, r in zip(grads, ranks) if dy is not None) if live else 1
    g_parts = torch.empty((splits, T, sum(ranks)), device=x.device, dtype=torch.float32)
    db_parts, dead = [], []
    start = 0
    for i, (dy, B, s, r) in enumerate(zip(grads, lora_Bs, scales, ranks)):
        cols = g_parts[:, :, start:start + r]
        if dy is None:
            cols.zero_()
            dead.append(i)
        else:
            db_parts.append(kernels.lora_dy_pass_parts(dy, B, h[:, start:start + r], s, g_part=cols, g_scale=s)[1])
        start += r
    if gemm == "triton":
        g_all = kernels.sum_leading(g_parts)
        da_part, _ = kernels.lora_x_pass_parts(x, A_all, g_all, 1.0, write_dx=False)
        dx = None
        if need_dx:
            dx = kernels.lora_gemm(live[0][0], live[0][1], g_all, A_all, 1.0, None, x.dtype) if live else g_all.new_zeros(x.shape, dtype=x.dtype)
            for dy, W in live[1:]:
                dx.addmm_(dy, W)
    else:
        da_part, dx = kernels.lora_x_pass_parts(x, A_all, g_parts, 1.0, write_dx=need_dx)
        if need_dx:
            for dy, W in live:
                dx.addmm_(dy, W)   # every sibling's dy W lands in the one dx: no autograd sums of T x K
    dA_all, *dB_live = kernels.sum_partials(da_part, *db_parts)
    dBs = []
    for i, B in enumerate(lora_Bs):
        dBs.append(torch.zeros_like(B, dtype=torch.float32) if i in dead else dB_live.pop(0))
    dAs = list(torch.split(dA_all, ranks, dim=0))
    return dx, dAs, dBs


class LoraSiblingsFunction(torch.autograd.Function):
    """Several LoRA linears that read the same x (q/k/v, gate/up) as one autograd node.

    Forward: one shrink pass over x for all of them. Backward: one x pass for every dA and one dx
    that every sibling's dy W is added into, instead of one dx per sibling summed by autograd.
    x is saved once. Inputs after x: n, then for each sibling (weight, bias, lora_A, lora_B), then
    the n scalings and the GEMM backend.
    """

    @staticmethod
    def forward(ctx, x, n, *args):
        tensors, scales, gemm = args[:4 * n], args[4 * n:5 * n], args[5 * n]
        weights, biases, As, Bs = tensors[0::4], tensors[1::4], tensors[2::4], tensors[3::4]
        K = x.shape[-1]
        outputs, h, A_all = lora_siblings_forward(x.reshape(-1, K), weights, biases, As, Bs, scales, gemm)
        ctx.save_for_backward(x, h, A_all, *weights, *As, *Bs)
        ctx.n, ctx.scales, ctx.gemm = n, scales, gemm
        return tuple(y.view(*x.shape[:-1], W.shape[0]) for y, W in zip(outputs, weights))

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        x, h, A_all, *rest = ctx.saved_tensors
        weights, As, Bs = rest[:n], rest[n:2 * n], rest[2 * n:]
        K = x.shape[-1]
        flat = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        dx, dAs, dBs = lora_siblings_backward(flat, x.reshape(-1, K), weights, As, Bs, h, ctx.scales, ctx.gemm,
                                              ctx.needs_input_grad[0], A_all)
        per_sibling = []
        for i in range(n):
            per_sibling += [None, None, dAs[i].to(As[i].dtype), dBs[i].to(Bs[i].dtype)]
        return (dx.view(x.shape) if dx is not None else None, None, *per_sibling, *([None] * n), None)


def lora_siblings_triton(x, weights, biases, lora_As, lora_Bs, scalings, gemm: Optional[str] = None) -> tuple:
    """Outputs of n LoRA linears that all read x, through one LoraSiblingsFunction (eager only)."""
    n = len(weights)
    tensors = [t for quad in zip(weights, biases, lora_As, lora_Bs) for t in quad]
    return LoraSiblingsFunction.apply(x, n, *tensors, *[float(s) for s in scalings], gemm or gemm_backend())
