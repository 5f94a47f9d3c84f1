"""Per-token dynamic rank in plain PyTorch: the oracle of the bucketed kernel, and the CPU path.

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

KERNELS = ("torch", "triton")


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


_CONSTANTS: dict = {}


def device_constant(key: tuple, device, build) -> Tensor:
    """A small constant tensor built once per device: building it from Python data each forward would copy
    host to device, and such a copy waits for the GPU (one stall per layer per step)."""
    full_key = key + (str(device),)
    value = _CONSTANTS.get(full_key)
    if value is None:
        value = _CONSTANTS[full_key] = build().to(device)
    return value


def rank_step_matrix(buckets: Sequence[int], r: int, device=None, dtype=torch.float32) -> Tensor:
    """(K, r) with row k = 1 on the first buckets[k] columns, 0 after."""
    def build():
        b = torch.tensor(list(buckets)).unsqueeze(1)                         # (K, 1)
        return (torch.arange(r).unsqueeze(0) < b).to(dtype)                  # (K, r)

    return device_constant(("step", tuple(buckets), r, dtype), device, build)


def rank_mask(bucket_ids: Tensor, buckets: Sequence[int], r: int, bucket_weights: Optional[Tensor] = None,
              dtype=torch.float32) -> Tensor:
    """(T, r) per-token mask: step[bucket_ids], or bucket_weights @ step (differentiable)."""
    step = rank_step_matrix(buckets, r, device=bucket_ids.device, dtype=dtype)
    if bucket_weights is not None:
        return bucket_weights.to(dtype) @ step
    return step[bucket_ids.reshape(-1)]


def _check_inputs(x: Tensor, lora_A: Tensor, bucket_ids: Tensor, buckets: Sequence[int],
                  bucket_weights: Optional[Tensor]) -> None:
    tokens = x.numel() // x.shape[-1]
    if bucket_ids.numel() != tokens:
        raise ValueError(f"bucket_ids has {bucket_ids.numel()} entries for {tokens} tokens")
    if list(buckets)[-1] != lora_A.shape[0]:
        raise ValueError(f"the last bucket ({list(buckets)[-1]}) must equal the rank of lora_A ({lora_A.shape[0]})")
    if bucket_weights is not None and tuple(bucket_weights.shape) != (tokens, len(buckets)):
        raise ValueError(f"bucket_weights has shape {tuple(bucket_weights.shape)}, expected ({tokens}, {len(buckets)})")


def dynamic_rank_lora_linear_reference(
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
) -> Tensor:
    """y = x Wᵀ + b + s·((x_lora Aᵀ) ⊙ mask) Bᵀ through plain autograd (the oracle; mask multiply).

    Runs the LoRA branch in the adapter's dtype and casts the sum to the base output's dtype, as
    ``sits_lora.ops.reference`` and PEFT do. Any leading dims; bucket_ids has one entry per token.
    """
    _check_inputs(x, lora_A, bucket_ids, buckets, bucket_weights)
    result = F.linear(x, weight, bias)                                        # (..., d_out)
    xl = x_lora.reshape(-1, x_lora.shape[-1]).to(lora_A.dtype)                # (T, d_in)
    mask = rank_mask(bucket_ids, buckets, lora_A.shape[0], bucket_weights, dtype=lora_A.dtype)  # (T, r)
    h = F.linear(xl, lora_A) * mask                                           # (T, r)
    lora_out = F.linear(h, lora_B) * scaling                                  # (T, d_out)
    return (result + lora_out.reshape(result.shape)).to(result.dtype)


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
    _check_inputs(x, lora_A, bucket_ids, buckets, None)
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
        from ..ops import lora_linear_dynamic_rank_triton

        _check_inputs(x, lora_A, bucket_ids, buckets, bucket_weights)
        ends = device_constant(("bucket_ends", tuple(buckets)), x.device, lambda: torch.tensor(list(buckets)))
        rank_limit = ends.index_select(0, bucket_ids.reshape(-1)).to(torch.int32)          # (T,)
        return lora_linear_dynamic_rank_triton(x, None if x_lora is x else x_lora, weight, bias, lora_A, lora_B,
                                               scaling, rank_limit, ends, bucket_weights)
    raise ValueError(f"unknown dynamic-rank kernel {kernel!r}; available: {', '.join(KERNELS)}")
