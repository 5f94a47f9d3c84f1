"""Plain PyTorch LoRA linear: the oracle for every kernel and the CPU path.

Notation (shapes after flattening the leading dims into T tokens):
    x       (T, d_in)      input of the frozen base layer
    x_lora  (T, d_in)      input of the LoRA branch: dropout(x), or x itself without dropout
    W       (d_out, d_in)  frozen base weight, b (d_out,) its optional bias
    A       (r, d_in)      lora_A.weight;  B (d_out, r) lora_B.weight;  s the scaling
    h = x_lora Aᵀ          "shrink"  (T, r)
    y = x Wᵀ + b + s·h Bᵀ  "expand"  (T, d_out)

The LoRA branch runs in the adapter's dtype (PEFT keeps adapters in fp32 under a bf16 base by
default) and the sum is cast back to the base output's dtype, exactly as PEFT's ``lora.Linear``
does, so this module reproduces PEFT's numbers.

Backward, with g = dy B (T, r):
    dx      = dy W                 (+ the LoRA part, which reaches x through x_lora)
    dx_lora = s·g A
    dA      = s·gᵀ x_lora
    dB      = s·dyᵀ h
    dW      = dyᵀ x  (only if W is trainable),  db = Σ_T dy  (only if b is trainable)
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


class ProductInput(NamedTuple):
    """A LoRA input that the frozen model keeps as two factors: x = act(gate)·up, both (..., d_in) in x's dtype.

    The MLP's down projection reads such an x, and the multiply that made it keeps its factors for its own
    backward. The x pass reads the factors and forms x while loading them (ops.fused_backward), instead of a
    rebuilt x written to memory and read back. ``silu``: x = silu(gate)·up with the SiLU computed in fp32 and
    rounded to x's dtype before the multiply (Liger's fused SwiGLU); otherwise x = gate·up.
    """

    gate: Tensor
    up: Tensor
    silu: bool

    def value(self) -> Tensor:
        """x itself (the reference the kernels are tested against)."""
        gate = F.silu(self.gate.float()).to(self.gate.dtype) if self.silu else self.gate
        return gate * self.up

    def reshape(self, *shape) -> "ProductInput":
        return ProductInput(self.gate.reshape(*shape), self.up.reshape(*shape), self.silu)


def lora_linear_reference(
    x: torch.Tensor,
    x_lora: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ through plain autograd (the oracle)."""
    result = F.linear(x, weight, bias)
    x_lora = x_lora.to(lora_A.dtype)
    lora_out = F.linear(F.linear(x_lora, lora_A), lora_B) * scaling
    return (result + lora_out).to(result.dtype)


def lora_linear_backward_reference(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    x_lora: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    need_weight_grad: bool = False,
    need_bias_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The gradients of :func:`lora_linear_reference`, written out.

    Returns (dx, dx_lora, dA, dB, dW, db); all tensors are 2-D (tokens flattened), dW / db are
    None unless asked for. dx and dx_lora are separate because x_lora may be a dropout of x.
    """
    dy = grad_out.reshape(-1, grad_out.shape[-1])                 # (T, d_out), base dtype
    x2 = x.reshape(-1, x.shape[-1])                                # (T, d_in)
    xl = x_lora.reshape(-1, x_lora.shape[-1]).to(lora_A.dtype)     # (T, d_in), adapter dtype
    dy_l = dy.to(lora_A.dtype)
    h = xl @ lora_A.t()                                            # (T, r)
    g = dy_l @ lora_B                                              # (T, r)
    dx = dy @ weight                                               # (T, d_in)
    dx_lora = (scaling * g) @ lora_A                               # (T, d_in)
    dA = (scaling * g).t() @ xl                                    # (r, d_in)
    dB = (scaling * dy_l).t() @ h                                  # (d_out, r)
    dW = dy.t() @ x2 if need_weight_grad else None
    db = dy.sum(0) if need_bias_grad else None
    return dx, dx_lora.to(x_lora.dtype), dA, dB, dW, db


class LoraLinearReferenceFunction(torch.autograd.Function):
    """The reference as an autograd Function with the explicit backward above.

    ``x_lora`` None means the LoRA input is x itself (no dropout): one activation is saved and dx
    carries both gradients. Saves the LoRA input (for dA), h (for dB) and the weights; x itself
    again only when W is trainable.
    """

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_A, lora_B, scaling):
        lora_in = x if x_lora is None else x_lora
        x2 = x.reshape(-1, x.shape[-1])                                       # (T, d_in)
        xl = lora_in.reshape(-1, lora_in.shape[-1]).to(lora_A.dtype)          # (T, d_in)
        base = F.linear(x2, weight, bias)                                     # (T, d_out)
        h = xl @ lora_A.t()                                                   # (T, r)
        out = (base + (h @ lora_B.t()) * scaling).to(base.dtype)
        ctx.scaling = scaling
        ctx.has_bias = bias is not None
        ctx.separate_lora_input = x_lora is not None
        ctx.lora_in_dtype = lora_in.dtype
        keep_x = weight.requires_grad and x_lora is not None
        ctx.save_for_backward(x if keep_x else None, lora_in, weight, lora_A, lora_B, h)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, lora_in, weight, lora_A, lora_B, h = ctx.saved_tensors
        if x is None and not ctx.separate_lora_input:
            x = lora_in
        s = ctx.scaling
        lead = grad_out.shape[:-1]
        dy = grad_out.reshape(-1, grad_out.shape[-1])                # (T, d_out)
        dy_l = dy.to(lora_A.dtype)
        need_x, need_xl, need_w, need_b, need_a, need_bb, _ = ctx.needs_input_grad
        need_lora_in = need_xl if ctx.separate_lora_input else need_x
        dx = dx_lora = dW = db = dA = dB = None
        g = dy_l @ lora_B if (need_lora_in or need_a) else None      # (T, r)
        if need_lora_in:
            dx_lora = ((s * g) @ lora_A).to(ctx.lora_in_dtype).reshape(*lead, lora_A.shape[1])
        if need_x:
            dx = (dy @ weight).reshape(*lead, weight.shape[1])
            if not ctx.separate_lora_input:
                dx, dx_lora = dx + dx_lora, None
        if need_a:
            xl = lora_in.reshape(-1, lora_in.shape[-1]).to(lora_A.dtype)
            dA = (s * g).t() @ xl
        if need_bb:
            dB = (s * dy_l).t() @ h
        if need_w:
            dW = dy.t() @ x.reshape(-1, x.shape[-1])
        if need_b and ctx.has_bias:
            db = dy.sum(0)
        return dx, dx_lora, dW, db, dA, dB, None


def lora_linear_torch(x, x_lora, weight, bias, lora_A, lora_B, scaling):
    """The "torch" kernel: the reference Function. Pass x_lora=x (or None) when there is no dropout."""
    return LoraLinearReferenceFunction.apply(x, None if x_lora is x else x_lora, weight, bias, lora_A, lora_B, scaling)


# ----------------------------------------------------------------------------- a rank per token
# Notation of sits_lora.ops.dynamic_rank: buckets (K,) increasing ranks ending at r; bucket_ids (T,): token t
# uses the first buckets[bucket_ids[t]] rank dimensions; bucket_weights (T, K): the router's straight-through
# one-hot, whose gradient trains the router.


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


def check_dynamic_rank_inputs(x: Tensor, lora_A: Tensor, bucket_ids: Tensor, buckets: Sequence[int],
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
    check_dynamic_rank_inputs(x, lora_A, bucket_ids, buckets, bucket_weights)
    result = F.linear(x, weight, bias)                                        # (..., d_out)
    xl = x_lora.reshape(-1, x_lora.shape[-1]).to(lora_A.dtype)                # (T, d_in)
    mask = rank_mask(bucket_ids, buckets, lora_A.shape[0], bucket_weights, dtype=lora_A.dtype)  # (T, r)
    h = F.linear(xl, lora_A) * mask                                           # (T, r)
    lora_out = F.linear(h, lora_B) * scaling                                  # (T, d_out)
    return (result + lora_out.reshape(result.shape)).to(result.dtype)
