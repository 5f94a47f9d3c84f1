"""What SitsHardwareCallback reads of a run before its first step: the optimizer's kind (for the memory plan), the
frozen weights' element size, the sequence length and the bytes of a batch (from the dataset, by indexing only: the
sampler's random state is untouched)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def optimizer_kind(name: str) -> str:
    """The memory plan's optimizer kind for a TrainingArguments.optim name."""
    name = name.lower()
    if "8bit" in name:
        return "adamw_8bit"
    if name.startswith("adafactor"):
        return "adafactor"
    if name.startswith("sgd"):
        return "sgd"
    if "lion" in name:
        return "lion"
    return "adamw"


def weight_bytes(model: nn.Module) -> int:
    """Bytes per element of the first frozen floating-point parameter (2 where there is none)."""
    for p in model.parameters():
        if p.is_floating_point() and not p.requires_grad:
            return p.element_size()
    return 2


def dataset_of(train_dataloader):
    """The dataloader's dataset where it can be indexed, else None (an iterable dataset)."""
    dataset = getattr(train_dataloader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None
    return dataset


def infer_seq_len(train_dataloader) -> Optional[int]:
    """The longest ``input_ids`` among the first 64 examples (indexing only: the sampler's RNG is untouched)."""
    dataset = dataset_of(train_dataloader)
    if dataset is None:
        return None
    longest = 0
    try:
        for i in range(min(64, len(dataset))):
            example = dataset[i]
            ids = example.get("input_ids") if isinstance(example, dict) else None
            if ids is not None:
                longest = max(longest, len(ids))
    except (KeyError, TypeError, IndexError):
        return None
    return longest or None


def batch_bytes(train_dataloader, batch: int) -> int:
    """Bytes of a collated batch of ``batch`` examples like the dataset's first (0 where unknown)."""
    dataset = dataset_of(train_dataloader)
    if dataset is None or len(dataset) == 0:
        return 0
    example = dataset[0]
    if not isinstance(example, dict):
        return 0
    total = 0
    for value in example.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * max(value.element_size(), 8 if not value.is_floating_point() else 4)
        elif isinstance(value, (list, tuple)):
            total += len(value) * 8  # collated to int64
    return total * batch


__all__ = ["batch_bytes", "dataset_of", "infer_seq_len", "optimizer_kind", "weight_bytes"]
