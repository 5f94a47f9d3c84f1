"""Nested training's bucket draw: one bucket per sequence, shared by every layer of a forward.

A nested adapter (``rank_scheduler='static'``) trains at random buckets so that every truncation to
the first b_k rank dimensions keeps working. A truncation to k runs every layer, for every token of a
sequence, at rank k; training should see that. Drawn by each layer for each token on its own, a token at the
full rank in one layer sits at a lower one in the next: with a few buckets and hundreds of adapted layers no token
ever trains at one rank through the model, and the truncations score worse the more rank they keep. One draw per
token shared by the layers is better, but still worse with more rank, plausibly because attention mixes tokens
that trained at different ranks while a truncation runs all of them at one. So the draw is one bucket per sequence
(the first leading dimension of a layer's input; a 2-D input draws per token, and a packed batch of one row gets
one bucket per forward, as DyLoRA draws), shared by every layer of the forward; what more rank still loses then is
mostly the learning rate, tuned at the smallest truncation (docs/dynamic-rank.md).

``attach_forward_draw(model)`` (the tuner calls it for a nested adapter) opens a draw scope around
each training forward of ``model``. Its seed comes from torch's CPU generator at the scope's entry,
and each sequence's bucket is a hash of (seed, sequence index): the same in every layer without a
shared cache, and the draw consumes no random numbers inside the model, so a gradient-checkpoint
recompute replays dropout exactly and takes each layer's buckets from its forward (the layer keeps
them, see DynamicRankVariant.choose_buckets). A layer called outside any scope draws per token for
itself. The seed stays a tensor and the state a plain object, so that torch.compile traces the
draw (a Python int of the seed, or a context variable, broke the graph).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

_HOOKS_ATTR = "_sits_lora_forward_draw_hooks"
_MASK32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (Wellons' lowbias32 shape, multipliers below 2**31 so that int64 products
    never overflow) of int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


class _DrawState:
    """Inside a training forward of a model with a shared draw? A plain object, as scope._ForwardState
    (which says why)."""

    def __init__(self):
        self.open = False


_STATE = _DrawState()
_SEED_ATTR = "_sits_lora_draw_seed"


def shared_bucket_ids(seed: Tensor, leading_shape: tuple, k: int, device: torch.device) -> Tensor:
    """(T,) bucket ids uniform over k: one per sequence (leading_shape[0]; per token for a 2-D input),
    a function of (seed, sequence index) only, repeated over the sequence's tokens."""
    rows = leading_shape[0] if len(leading_shape) > 1 else math.prod(leading_shape)
    seed = seed.to(device)
    index = torch.arange(rows, device=device, dtype=torch.int64)
    mixed = _hash32(_hash32(index ^ (seed & _MASK32)) ^ ((seed >> 32) & _MASK32))
    ids = mixed % k
    per_row = math.prod(leading_shape) // max(rows, 1)
    return ids.repeat_interleave(per_row) if per_row > 1 else ids


def forward_bucket_ids(leading_shape: tuple, k: int, device: torch.device,
                       seed: Optional[Tensor] = None) -> tuple[Tensor, bool]:
    """(bucket ids (T,) uniform over k buckets, shared) for an input of this leading shape, T its product:
    inside a training forward of a model with a shared draw (``seed``: the layer's, see
    attach_forward_draw), one bucket per sequence (leading_shape[0]), the same for every layer (shared
    True); otherwise a per-token draw of the layer's own (False)."""
    if seed is None or not _STATE.open:
        return torch.randint(0, k, (math.prod(leading_shape),), device=device), False
    return shared_bucket_ids(seed, leading_shape, k, device), True


def layer_draw_seed(layer: nn.Module) -> Optional[Tensor]:
    """The seed tensor of the shared draw the layer's model opens (None: the layer draws on its own)."""
    return getattr(layer, _SEED_ATTR, None)


def attach_forward_draw(model: nn.Module) -> None:
    """Open a shared draw around every training forward of ``model``, and give its layers the draw's seed
    (a CPU int64 tensor on the model, refilled in place at each forward). Idempotent: a second call hands
    the seed to layers added since. The hooks find the seed on the module they run for, so that a deep
    copy of the model (an EMA or reference model) draws with its own seed, which its layers share."""
    seed = getattr(model, _SEED_ATTR, None)
    if getattr(model, _HOOKS_ATTR, None) is None or seed is None:
        # One tensor, refilled in place: torch.compile traces an in-place refill of a tensor that exists
        # before the graph and reads of it in each layer, but breaks on storing a tensor it made.
        seed = torch.zeros((), dtype=torch.int64)
        setattr(model, _SEED_ATTR, seed)
        previous: list = []

        def enter(module, args):
            previous.append(_STATE.open)
            _STATE.open = bool(module.training)
            if module.training:
                getattr(module, _SEED_ATTR).copy_(torch.randint(0, 2**62, ()))

        def leave(module, args, output):
            if previous:
                _STATE.open = previous.pop()

        setattr(model, _HOOKS_ATTR, (model.register_forward_pre_hook(enter),
                                     model.register_forward_hook(leave, always_call=True)))
    for module in model.modules():
        if hasattr(module, "nested_ids"):  # a layer holding a dynamic-rank adapter
            setattr(module, _SEED_ATTR, seed)
