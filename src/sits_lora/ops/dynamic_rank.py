"""The LoRA linear with a rank per token: the fused-kernel op, the bucketed algorithm in PyTorch, the dispatch.

The oracle (the mask multiply through plain autograd) is ``reference.dynamic_rank_lora_linear_reference``.

Notation of ``sits_lora.ops.reference`` (x, x_lora, W, b, A (r, d_in), B (d_out, r), s), plus:
    buckets         (K,) strictly increasing ranks b_0 < ... < b_{K-1} = r
    bucket_ids      (T,) integer: token t uses the first buckets[bucket_ids[t]] rank dimensions
    bucket_weights  (T, K) float, optional: the router's straight-through vector. Its value must be
                    one_hot(bucket_ids); its gradient is what trains the router.
    step            (K, r): step[k, i] = 1 if i < b_k else 0 (the monotone mask of bucket k)
    mask            (T, r) = bucket_weights @ step, or step[bucket_ids] without bucket_weights
    h = x_lora Aᵀ   (T, r)
    y = x Wᵀ + b + s · (h ⊙ mask) Bᵀ

Backward, with g = dy B (T, r):
    dx_lora = s·(g ⊙ mask) A,   dA = s·(g ⊙ mask)ᵀ x_lora,   dB = s·dyᵀ (h ⊙ mask)
    d bucket_weights = s·(h ⊙ g) stepᵀ   (T, K): the prefix sums of h⊙g at the bucket boundaries.
The last one needs h and g over all r dimensions for every token, so a kernel may skip the rank
tiles above a token's bucket in the forward pass and in dx / dA / dB, but not where it computes
d bucket_weights (router training); without a router (eval, 'random', 'static') it skips them all.

:func:`dynamic_rank_lora_linear_grouped` is the bucketed algorithm in PyTorch: tokens sorted by
bucket (:func:`group_tokens_by_bucket`), each group multiplied by the first b_k columns only. The
Triton path (kernel="triton") keeps h and g over all r columns (the router's gradient needs them;
both are memory-bound passes over x and dy, where fewer columns save nothing) and applies each
token's limit where the rank is summed over: the expand kernel runs only the 16-wide rank tiles its
block's tokens use (with ``group_tokens``, tokens sorted by limit first, so that blocks are uniform);
dB and dA read h and g masked.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .choice import fused_kernels
from .linear import lora_input_grads
from .reference import check_dynamic_rank_inputs, device_constant, dynamic_rank_lora_linear_reference

DYNAMIC_RANK_KERNELS = ("torch", "triton")


class BucketGroups(NamedTuple):
    """Token indices sorted by bucket, the layout a bucketed kernel reads.

    token_order          (T,) int64: the token indices, bucket 0's first, each group in ascending order
    bucket_offsets       (K+1,) int64: group k is token_order[bucket_offsets[k]:bucket_offsets[k+1]]
    padded_token_order   (P,) int64 or None: with ``block_size``, each group padded to a multiple of
                         block_size with the sentinel T (an out-of-range index a kernel masks off)
    block_bucket         (P // block_size,) int64 or None: the bucket of each block of padded_token_order
    """

    token_order: Tensor
    bucket_offsets: Tensor
    padded_token_order: Optional[Tensor] = None
    block_bucket: Optional[Tensor] = None


def _x_side(kernels, dy, x, x_lora, weight, lora_A, g, scale, need_dx):
    """(dA, dx, dx_lora) from g = dy B (T, R), with cuBLAS for dy W (``kernels``: ops.fused, loaded by the caller)."""
    dx = dx_lora = None
    if x_lora is not None:
        dA, dx_lora = kernels.lora_x_pass(x_lora, lora_A, g, scale, write_dx=True)
        if need_dx:
            dx = dy @ weight
    else:
        dA, dx = kernels.lora_x_pass(x, lora_A, g, scale, write_dx=need_dx)
        if need_dx:
            dx.addmm_(dy, weight)
    return dA, dx, dx_lora


def dynamic_rank_forward(x, x_lora, weight, bias, lora_A, lora_B, scale: float, rank_limit, keep_full: bool,
                         token_order=None):
    """(y, h limited, h or None) for 2-D x: token t uses the first rank_limit[t] ((T,) int32) rank columns.

    The shrink writes h already limited, so the expand and, in the backward, the dy pass are the static
    kernels; ``keep_full`` also keeps the unlimited h for the router's gradient. With ``token_order`` (tokens
    sorted by limit) the expand takes its blocks in that order and skips the rank tiles above each
    block's largest limit (see lora_expand). The frozen GEMM is cuBLAS.
    """
    kernels = fused_kernels()

    h, h_full = kernels.lora_shrink_limited(x if x_lora is None else x_lora, lora_A, rank_limit, keep_full)
    grouped = token_order is not None
    y = kernels.lora_expand(h, lora_B, scale, bias, x.dtype, rank_limit=rank_limit if grouped else None,
                    token_order=token_order)
    y.addmm_(x, weight.t())
    return y, h, h_full


def dynamic_rank_backward(dy, x, x_lora, weight, lora_A, lora_B, h, scale: float, need_dx: bool, rank_limit,
                          h_full=None, bucket_ends=None):
    """(dx, dx_lora, dA, dB, bucket-weight gradient or None) for dynamic_rank_forward's outputs: the
    static dy and x passes around one limit_grad (g limited, and the router's gradient from h_full)."""
    kernels = fused_kernels()

    g, dB = kernels.lora_dy_pass(dy, lora_B, h, scale)
    g, d_weights = kernels.limit_grad(g, rank_limit, scale, h_full, bucket_ends)
    dA, dx, dx_lora = _x_side(kernels, dy, x, x_lora, weight, lora_A, g, scale, need_dx)
    return dx, dx_lora, dA, dB, d_weights


class DynamicRankLoraFunction(torch.autograd.Function):
    """The LoRA linear with a rank per token (sits_lora.dynamic_rank) on the fused kernels.

    Token t uses the first rank_limit[t] rank dimensions. With ``bucket_weights`` (T, K) (the
    router's straight-through one-hot; value ignored here, rank_limit carries the choice) its
    gradient s·Σ_{i < b_k} h[t, i] g[t, i] is returned, which reads h and g beyond each token's
    limit: only then is the unlimited h kept as well (one more (T, r) fp32 tensor per layer). Eager
    only: under torch.compile the layer runs the PyTorch reference.
    """

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_A, lora_B, bucket_weights, scaling, rank_limit, bucket_ends,
                token_order):
        K = x.shape[-1]
        y, h, h_full = dynamic_rank_forward(x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
                                            weight, bias, lora_A, lora_B, scaling, rank_limit,
                                            keep_full=ctx.needs_input_grad[6], token_order=token_order)
        ctx.save_for_backward(x if x_lora is None else None, x_lora, weight, lora_A, lora_B, h, h_full, rank_limit,
                              bucket_ends)
        ctx.scaling = scaling
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, x_lora, weight, lora_A, lora_B, h, h_full, rank_limit, bucket_ends = ctx.saved_tensors
        N, K = weight.shape
        dx, dx_lora, dA, dB, d_weights = dynamic_rank_backward(
            grad_y.reshape(-1, N), None if x is None else x.reshape(-1, K),
            None if x_lora is None else x_lora.reshape(-1, K), weight, lora_A, lora_B, h, ctx.scaling,
            ctx.needs_input_grad[0], rank_limit, h_full, bucket_ends)
        grads = lora_input_grads(ctx, grad_y.shape[:-1], K, dx, dx_lora, dA, dB, lora_A, lora_B)
        return (*grads, d_weights, None, None, None, None)


def lora_linear_dynamic_rank_triton(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, rank_limit: Tensor,
                                    bucket_ends: Tensor, bucket_weights: Optional[Tensor] = None,
                                    group_tokens: bool = False) -> Tensor:
    """y = x Wᵀ + b + s·((x_lora Aᵀ) ⊙ [r < rank_limit]) Bᵀ on the fused kernels (see DynamicRankLoraFunction).

    rank_limit (T,) int32 on x's device; bucket_ends (K,) int64, the ranks of the buckets; x_lora None:
    the LoRA input is x. ``group_tokens`` sorts the tokens by limit for the expand kernel (one sort
    per layer call) so that its blocks skip the rank tiles above their bucket. Off by default: the sort
    costs more GPU time than the skipped tiles save (the expand is bound by writing its output, not by
    its rank-64 arithmetic), and in token order the kernels already cost what the static kernel at
    r_max costs (docs/dynamic-rank.md).
    """
    order = torch.argsort(rank_limit).to(torch.int32) if group_tokens else None
    return DynamicRankLoraFunction.apply(x, x_lora, weight, bias, lora_A, lora_B, bucket_weights, float(scaling),
                                         rank_limit, bucket_ends, order)


def group_tokens_by_bucket(bucket_ids: Tensor, num_buckets: int, block_size: Optional[int] = None) -> BucketGroups:
    """Sort token indices by bucket (stable), with per-bucket offsets; optionally pad each group to blocks.

    The same layout as vLLM's LoRA kernels and MoE block alignment: a kernel launches one program
    per block of ``padded_token_order``, reads its rank limit from ``buckets[block_bucket[block]]``
    and masks the sentinel entries (== T).
    """
    ids = bucket_ids.reshape(-1).long()
    tokens = ids.numel()
    if tokens and (int(ids.min()) < 0 or int(ids.max()) >= num_buckets):
        raise ValueError(f"bucket_ids must lie in [0, {num_buckets}), found [{int(ids.min())}, {int(ids.max())}]")
    token_order = torch.sort(ids, stable=True).indices                               # (T,)
    counts = torch.bincount(ids, minlength=num_buckets)                              # (K,)
    offsets = torch.zeros(num_buckets + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    if block_size is None:
        return BucketGroups(token_order, offsets)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    padded_counts = (counts + block_size - 1) // block_size * block_size              # (K,)
    padded_offsets = torch.zeros(num_buckets + 1, dtype=torch.long, device=ids.device)
    padded_offsets[1:] = torch.cumsum(padded_counts, 0)
    total = int(padded_offsets[-1])
    padded = torch.full((total,), tokens, dtype=torch.long, device=ids.device)
    # position of each sorted token inside the padded layout: its rank within its group + the group start
    sorted_ids = ids[token_order]
    within = torch.arange(tokens, device=ids.device) - offsets[sorted_ids]
    padded[padded_offsets[sorted_ids] + within] = token_order
    block_bucket = torch.repeat_interleave(torch.arange(num_buckets, device=ids.device), padded_counts // block_size)
    return BucketGroups(token_order, offsets, padded, block_bucket)


def dynamic_rank_lora_linear_grouped(
    x: Tensor,
    x_lora: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    bucket_ids: Tensor,
    buckets: Sequence[int],
    groups: Optional[BucketGroups] = None,
) -> Tensor:
    """The bucketed algorithm in PyTorch: each bucket's tokens use only the first b_k rank columns.

    Equal to the reference with hard buckets (no ``bucket_weights``: it cannot train a router, see
    the module docstring). It does b_k / r of the LoRA work per token but one gather / scatter per
    bucket, so it is the kernel's blueprint and a test of the grouping, not a faster CPU path.
    """
    check_dynamic_rank_inputs(x, lora_A, bucket_ids, buckets, None)
    result = F.linear(x, weight, bias)                                        # (..., d_out)
    xl = x_lora.reshape(-1, x_lora.shape[-1]).to(lora_A.dtype)                # (T, d_in)
    groups = groups if groups is not None else group_tokens_by_bucket(bucket_ids, len(buckets))
    lora_out = xl.new_zeros(xl.shape[0], lora_B.shape[0])                     # (T, d_out)
    for k, b in enumerate(buckets):
        start, end = int(groups.bucket_offsets[k]), int(groups.bucket_offsets[k + 1])
        if start == end:
            continue
        idx = groups.token_order[start:end]                                   # (T_k,)
        h = F.linear(xl[idx], lora_A[:b])                                     # (T_k, b)
        lora_out = lora_out.index_add(0, idx, F.linear(h, lora_B[:, :b]))     # (T, d_out)
    return (result + (lora_out * scaling).reshape(result.shape)).to(result.dtype)


def dynamic_rank_lora_linear(
    x: Tensor,
    x_lora: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    lora_A: Tensor,
    lora_B: Tensor,
    scaling: float,
    bucket_ids: Tensor,
    buckets: Sequence[int],
    bucket_weights: Optional[Tensor] = None,
    kernel: str = "torch",
) -> Tensor:
    """The per-token-rank LoRA linear with the chosen implementation (see the module docstring).

    "torch" is the reference. "triton" runs the fused kernels (``sits_lora.ops.lora_linear_dynamic_rank_triton``:
    rank tiles above a block's largest bucket skipped in the expand kernel) with the
    same result: outputs and the gradients of x, x_lora, lora_A, lora_B and bucket_weights. Its
    inputs must already have the dtypes autocast would give them (the layer casts them).
    """
    if kernel == "torch":
        return dynamic_rank_lora_linear_reference(x, x_lora, weight, bias, lora_A, lora_B, scaling, bucket_ids,
                                                  buckets, bucket_weights)
    if kernel == "triton":
        check_dynamic_rank_inputs(x, lora_A, bucket_ids, buckets, bucket_weights)
        ends = device_constant(("bucket_ends", tuple(buckets)), x.device, lambda: torch.tensor(list(buckets)))
        rank_limit = ends.index_select(0, bucket_ids.reshape(-1)).to(torch.int32)          # (T,)
        return lora_linear_dynamic_rank_triton(x, None if x_lora is x else x_lora, weight, bias, lora_A, lora_B,
                                               scaling, rank_limit, ends, bucket_weights)
    raise ValueError(f"unknown dynamic-rank kernel {kernel!r}; available: {', '.join(DYNAMIC_RANK_KERNELS)}")
