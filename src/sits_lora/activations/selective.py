"""Selective gradient checkpointing: keep what attention computed, recompute the rest of the layer.

Full checkpointing keeps one tensor per layer and recomputes the whole layer in backward. At long context the
recompute is dominated by attention, whose cost grows with the square of the sequence while its output is one
T x h tensor (plus a log-sum-exp per head and token). ``selective_checkpointing_kwargs()`` is transformers'
``gradient_checkpointing_kwargs`` for non-reentrant checkpointing with a policy (torch's
``create_selective_checkpoint_contexts``) that keeps the outputs of ``scaled_dot_product_attention``'s kernels
and recomputes everything else:

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=selective_checkpointing_kwargs())

The textbook policy, keeping every matrix product's output and recomputing only the elementwise ops, does not
pay with LoRA on a frozen base: a frozen product needs neither its input nor its output for its own backward,
so keeping the outputs of q/k/v/o and gate/up/down (and of the LoRA branch) holds more than no checkpointing at
all (measured on the CPU: docs/memory.md).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _attention_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")
    # some exist only in some builds
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


ATTENTION_OPS = _attention_ops()


def _keep_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _context():
    return create_selective_checkpoint_contexts(_keep_attention)


def selective_checkpointing_kwargs() -> dict:
    """``gradient_checkpointing_kwargs`` (transformers) for checkpointing that keeps attention's outputs and
    recomputes the rest of each layer. Also usable as ``torch.utils.checkpoint.checkpoint(fn, *args,
    **selective_checkpointing_kwargs())``."""
    return {"use_reentrant": False, "context_fn": _context}


def is_selective(block) -> bool:
    """Whether ``block`` is checkpointed with :func:`selective_checkpointing_kwargs`'s policy."""
    func = getattr(block, "_gradient_checkpointing_func", None)
    keywords = getattr(func, "keywords", None) or {}
    return bool(getattr(block, "gradient_checkpointing", False)) and keywords.get("context_fn") is _context
