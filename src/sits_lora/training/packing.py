"""Packed batches of fixed shape, so that the native step can record them: TRL's ``SFTConfig(packing=True)`` makes
padding-free batches (the rows of a batch joined into one, each document its own sequence), each batch with its own
length and its own number of documents. A recording fixes both. Here:

- :class:`FixedTokenBudget` wraps the trainer's collator: every batch is padded to the same token budget
  (``per_device_train_batch_size x max_length``; the tail is labelled -100 and split into pad sequences of at most
  ``max_length`` tokens), and its sequence boundaries ``cu_seq_lens_q`` / ``_k`` to a fixed capacity (extra
  boundaries repeat the budget: empty sequences). ``max_length_q`` / ``_k`` become ``max_length``, the longest a
  packed document can be. The count TRL logs as ``num_tokens`` (the batch before padding) travels as
  ``packed_tokens``.
- :func:`varlen_attention` (the attention implementation ``"sits_varlen"``) reads those boundaries as device tensors:
  on a CUDA GPU with PyTorch's varlen flash attention (``torch.nn.attention.varlen``, PyTorch 2.10 and later), where
  nothing waits for the GPU; elsewhere (the CPU path, the tests) with a block-diagonal causal mask built on the device
  from the boundaries. transformers' own packed path derives the boundaries from ``position_ids`` with a host sync in
  every mask build, which a recording cannot hold.

``budget_packing_support`` says whether a trainer's packed batches can take this path; the native step switches the
model's attention to ``"sits_varlen"`` for the run and back when ``train()`` returns.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn.functional as F

ATTENTION = "sits_varlen"
IGNORE_INDEX = -100
# what the budget collator adds to TRL's padding-free batch, read by the objective (TRL's num_tokens)
PACKED_TOKENS = "packed_tokens"


def _varlen_kernel():
    """PyTorch's varlen flash attention, or None where this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_kernel_support(device: torch.device, head_dim: Optional[int] = None) -> str:
    """Why packed batches cannot run through the varlen kernel on ``device`` with heads of ``head_dim`` ("" when
    they can)."""
    if device.type != "cuda":
        return ""   # the block-diagonal reference runs anywhere; only CUDA records
    if _varlen_kernel() is None:
        return (f"PyTorch {torch.__version__} has no varlen flash attention (torch.nn.attention.varlen, PyTorch 2.10 "
                "and later)")
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"attention heads of {head_dim} (the varlen flash kernel takes multiples of 8 up to 256)"
    return ""


def _causal_varlen(query, key, value, cu_seq, max_length: int, scale: float):
    """Causal attention within each sequence of (T, H, D) tensors whose boundaries ``cu_seq`` gives, by PyTorch's
    varlen kernel: causal through ``is_causal`` (PyTorch 2.10, 2.11) or ``window_size=(-1, 0)`` (later); the
    key / value heads repeated for grouped queries where the kernel does not take them."""
    kernel = _varlen_kernel()
    params = inspect.signature(kernel).parameters
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale != query.shape[-1] ** -0.5:
        raise ValueError(f"varlen_attention: this PyTorch's varlen kernel takes no scale, and the model's is {scale}")
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return kernel(query, key, value, cu_seq, cu_seq, max_length, max_length, **kwargs)


def _block_diagonal_mask(cu_seq: torch.Tensor, length: int) -> torch.Tensor:
    """(length, length) bool: token i attends to token j when j <= i in the same sequence, from the boundaries
    (built on the device: no host sync)."""
    positions = torch.arange(length, device=cu_seq.device)
    sequence = torch.searchsorted(cu_seq.to(torch.int64), positions, right=True)       # (T,): sequence of each token
    return (sequence[:, None] == sequence[None, :]) & (positions[None, :] <= positions[:, None])


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                     cu_seq_lens_q: Optional[torch.Tensor] = None, cu_seq_lens_k: Optional[torch.Tensor] = None,
                     max_length_q: Optional[int] = None, max_length_k: Optional[int] = None, **kwargs):
    """transformers' attention interface (query (B, H, T, D), key / value (B, Hkv, T, D); returns (B, T, H, D) and
    no weights) for packed batches: causal within each sequence of ``cu_seq_lens_q``. Without boundaries (an
    unpacked batch) it is transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"varlen_attention: a packed batch is one row of tokens, got {query.shape[0]} rows")
    if dropout:
        raise ValueError(f"varlen_attention: attention dropout {dropout} is not supported on packed batches")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))                     # (T, H, D), (T, Hkv, D)
    if q.is_cuda:
        out = _causal_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q.to(torch.int32),
                             int(max_length_q or q.shape[0]), scale)                   # (T, H, D)
        return out.unsqueeze(0), None
    groups = q.shape[1] // k.shape[1]
    mask = _block_diagonal_mask(cu_seq_lens_q, q.shape[0])
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, dim=1),
                                         value.repeat_interleave(groups, dim=1), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous(), None                                      # (1, T, H, D)


_REGISTERED = False


def register_varlen_attention() -> None:
    """Make ``"sits_varlen"`` an attention implementation transformers models accept (once per process), with the
    flash implementations' mask (None for a packed batch: the kernel reads the boundaries instead)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(ATTENTION, varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, flash_attention_mask)
    _REGISTERED = True


class FixedTokenBudget:
    """A collator wrapper: TRL's padding-free batch (module docstring) padded to ``budget`` tokens and ``capacity``
    sequences. ``max_length``: the longest a packed document is (TRL's ``max_length``)."""

    def __init__(self, collator: Any, budget: int, max_length: int, capacity: int, pad_token_id: int):
        self.collator, self.budget, self.max_length = collator, int(budget), int(max_length)
        self.capacity, self.pad_token_id = int(capacity), int(pad_token_id)

    def __getattr__(self, name):          # the wrapped collator's settings (padding_free, pad_to_multiple_of, ...)
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, examples: list) -> dict:
        batch = self.collator(examples)
        ids = batch["input_ids"]                                                      # (1, n)
        n = ids.shape[1]
        if n > self.budget:
            raise ValueError(f"FixedTokenBudget: a packed batch of {n} tokens is over the budget of {self.budget}; "
                             "each packed row must be at most max_length tokens")
        pad = self.budget - n
        # the pad tail as sequences of at most max_length tokens, each its own: no real token attends to them
        tail = [min(self.max_length, pad - start) for start in range(0, pad, self.max_length)]
        positions = torch.cat([batch["position_ids"][0]] + [torch.arange(m) for m in tail]) if tail else \
            batch["position_ids"][0]
        bounds = batch["cu_seq_lens_q"].to(torch.int64).tolist()
        for m in tail:
            bounds.append(bounds[-1] + m)
        if len(bounds) > self.capacity + 1:
            raise ValueError(f"FixedTokenBudget: {len(bounds) - 1} sequences in a batch, over the capacity of "
                             f"{self.capacity}")
        bounds += [self.budget] * (self.capacity + 1 - len(bounds))
        cu = torch.tensor(bounds, dtype=torch.int32)
        return {
            "input_ids": F.pad(ids, (0, pad), value=self.pad_token_id),
            "labels": F.pad(batch["labels"], (0, pad), value=IGNORE_INDEX),
            "position_ids": positions.unsqueeze(0),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
            "max_length_q": self.max_length, "max_length_k": self.max_length,
            PACKED_TOKENS: torch.tensor(n),
        }


def packed_rows_capacity(train_dataset: Any, batch_size: int) -> Optional[int]:
    """The most documents ``batch_size`` packed rows of ``train_dataset`` can hold (its ``seq_lengths`` column, TRL's
    best-fit-decreasing packing), plus one pad sequence a row; None without that column."""
    try:
        lengths = train_dataset["seq_lengths"]
    except (KeyError, TypeError, IndexError, ValueError):
        return None
    most = max((len(row) for row in lengths), default=0)
    return batch_size * (most + 1) if most else None


def budget_packing_support(trainer: Any) -> tuple[str, Optional[FixedTokenBudget]]:
    """(why the trainer's packed batches cannot take a fixed budget, "" when they can or when it packs none; the
    collator that pads them, or None) for a TRL SFTTrainer trained with ``packing=True`` and padding-free batches."""
    args = trainer.args
    # TRL's trainer turns padding-free on by itself for its best-fit-decreasing packing (trainer.padding_free)
    if not (getattr(args, "packing", False) and getattr(trainer, "padding_free", getattr(args, "padding_free", False))):
        return "", None
    collator = trainer.data_collator
    if type(collator).__name__ != "DataCollatorForLanguageModeling" or not getattr(collator, "padding_free", False):
        return f"a collator of its own ({type(collator).__name__})", None
    max_length = getattr(args, "max_length", None)
    if not max_length:
        return "max_length=None (packed rows without a bound)", None
    capacity = packed_rows_capacity(trainer.train_dataset, args.per_device_train_batch_size)
    if capacity is None:
        return (f"packing_strategy={getattr(args, 'packing_strategy', None)!r} leaves no per-row document lengths "
                "(seq_lengths)"), None
    budget = args.per_device_train_batch_size * max_length
    return "", FixedTokenBudget(collator, budget, max_length, capacity, collator.pad_token_id)


__all__ = ["ATTENTION", "FixedTokenBudget", "PACKED_TOKENS", "budget_packing_support", "packed_rows_capacity",
           "register_varlen_attention", "varlen_attention", "varlen_kernel_support"]
