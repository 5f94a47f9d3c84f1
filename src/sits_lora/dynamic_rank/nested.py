"""Nested training's bucket draw: one bucket per token, shared by every layer of a forward.

A nested adapter (``rank_scheduler='static'``) trains each token at a random bucket so that every
truncation to the first b_k rank dimensions keeps working. Drawn by each layer on its own, a token at
the full rank in one layer sits at a lower one in the next: with 4 buckets and 210 adapted layers
(SmolLM2-135M, seven projections) no training token ever ran at one rank k through the whole model,
which is what a truncation to k does. On the H200 the adapter truncated to 16 / 32 / 48 / 64 then
scored 2.19 / 2.21 / 2.30 / 2.43 held-out loss, against 2.17 for a static r = 64 adapter (bench/NOTES.md,
fifth run): the more rank it kept, the worse. Here the draw is made once per forward of the model
and every layer reads it, so each token trains one truncation of the whole model, as inference runs it.

``attach_forward_draw(model)`` (the tuner calls it for a nested adapter) opens a draw scope around
each training forward of ``model``. Its seed comes from torch's CPU generator at the scope's entry,
and the tokens' buckets from a generator of their own, so the draw consumes no random numbers
inside the model: a gradient-checkpoint recompute then replays dropout exactly, and takes each
layer's buckets from its forward (the layer keeps them, see DynamicRankLinear.choose_buckets).
A layer called outside any scope (on its own) draws for itself, as before.
"""

from __future__ import annotations

import contextvars
from typing import Optional

import torch
from torch import Tensor, nn

_HOOKS_ATTR = "_sits_lora_forward_draw_hooks"


class _ForwardDraw:
    """The buckets of one forward: one draw per (token count, bucket count, device), from one seed."""

    def __init__(self, seed: int):
        self.seed = seed
        self.ids: dict = {}

    def bucket_ids(self, tokens: int, k: int, device: torch.device) -> Tensor:
        key = (tokens, k, str(device))
        ids = self.ids.get(key)
        if ids is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            ids = self.ids[key] = torch.randint(0, k, (tokens,), device=device, generator=generator)
        return ids


_DRAW: contextvars.ContextVar[Optional[_ForwardDraw]] = contextvars.ContextVar("sits_lora_forward_draw", default=None)


def forward_bucket_ids(tokens: int, k: int, device: torch.device) -> tuple[Tensor, bool]:
    """(bucket ids (T,) uniform over k buckets, shared): the current forward's draw, the same for every
    layer with this many tokens (shared True), or outside a scope a draw of the layer's own (False)."""
    draw = _DRAW.get()
    if draw is None:
        return torch.randint(0, k, (tokens,), device=device), False
    return draw.bucket_ids(tokens, k, device), True


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
