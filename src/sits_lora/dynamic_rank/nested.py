"""Nested training's bucket draw: one bucket per sequence, shared by every layer of a forward.

A nested adapter (``rank_scheduler='static'``) trains at random buckets so that every truncation to
the first b_k rank dimensions keeps working. A truncation to k runs every layer, for every token of a
sequence, at rank k; training should see that. Drawn by each layer for each token on its own (to
session 5), a token at the full rank in one layer sat at a lower one in the next: with 4 buckets and 210
adapted layers (SmolLM2-135M, seven projections) no token ever trained at one rank through the model,
and the adapter truncated to 16 / 32 / 48 / 64 scored 2.186 / 2.207 / 2.301 / 2.429 held-out loss
against 2.172 for a static r = 64 adapter: the more rank it kept, the worse. One draw per token shared
by the layers (session 6) gave 2.176 / 2.182 / 2.202 / 2.233: better, and @16 level with static r = 16,
but still worse with more rank, plausibly because attention mixes tokens that trained at different
ranks while a truncation runs all of them at one. So the draw is one bucket per sequence (the first
leading dimension of a layer's input; a 2-D input draws per token, and a packed batch of one row gets
one bucket per forward, as DyLoRA draws), shared by every layer of the forward: 2.169 / 2.174 / 2.191 /
2.217 against 2.170 for static r = 64 trained in the same call. What more rank still loses is mostly
the learning rate, tuned at the rank-16 truncation: at half of it, 2.176 / 2.167 / 2.170 / 2.178
(bench/NOTES.md, sixth run).

``attach_forward_draw(model)`` (the tuner calls it for a nested adapter) opens a draw scope around
each training forward of ``model``. Its seed comes from torch's CPU generator at the scope's entry,
and the buckets from a generator of their own, so the draw consumes no random numbers inside the
model: a gradient-checkpoint recompute then replays dropout exactly, and takes each layer's buckets
from its forward (the layer keeps them, see DynamicRankLinear.choose_buckets). A layer called outside
any scope (on its own) draws per token for itself.
"""

from __future__ import annotations

import contextvars
import math
from typing import Optional

import torch
from torch import Tensor, nn

_HOOKS_ATTR = "_sits_lora_forward_draw_hooks"


class _ForwardDraw:
    """The buckets of one forward: one draw per (input shape, bucket count, device), from one seed."""

    def __init__(self, seed: int):
        self.seed = seed
        self.ids: dict = {}

    def bucket_ids(self, leading_shape: tuple, k: int, device: torch.device) -> Tensor:
        key = (tuple(leading_shape), k, str(device))
        ids = self.ids.get(key)
        if ids is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            rows = leading_shape[0] if len(leading_shape) > 1 else math.prod(leading_shape)
            ids = torch.randint(0, k, (rows,), device=device, generator=generator)
            ids = self.ids[key] = ids.repeat_interleave(math.prod(leading_shape) // max(rows, 1))
        return ids


_DRAW: contextvars.ContextVar[Optional[_ForwardDraw]] = contextvars.ContextVar("sits_lora_forward_draw", default=None)


def forward_bucket_ids(leading_shape: tuple, k: int, device: torch.device) -> tuple[Tensor, bool]:
    """(bucket ids (T,) uniform over k buckets, shared) for an input of this leading shape, T its product:
    the current forward's draw, one bucket per sequence (leading_shape[0]) and the same for every layer
    (shared True), or outside a scope a per-token draw of the layer's own (False)."""
    draw = _DRAW.get()
    if draw is None:
        return torch.randint(0, k, (math.prod(leading_shape),), device=device), False
    return draw.bucket_ids(leading_shape, k, device), True


def attach_forward_draw(model: nn.Module) -> None:
    """Open a shared draw around every training forward of ``model`` (once per model; idempotent)."""
    if getattr(model, _HOOKS_ATTR, None) is not None:
        return
    tokens: list = []

    def enter(module, args):
        seed = int(torch.randint(0, 2**62, ())) if module.training else None
        tokens.append(_DRAW.set(None if seed is None else _ForwardDraw(seed)))

    def leave(module, args, output):
        if tokens:
            _DRAW.reset(tokens.pop())

    setattr(model, _HOOKS_ATTR, (model.register_forward_pre_hook(enter),
                                 model.register_forward_hook(leave, always_call=True)))
