"""What merging an adapter into its base weights involves, for the plans that weigh merging against dispatching
(sits_lora.serving.plan for decoding, sits_lora.diffusion.plan for denoising): which adapters a model holds merged,
whether one can be merged, and the time of a call on the model's device."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from .timing import gpu_seconds, host_seconds


def tuner_layers(model: nn.Module) -> list:
    """Every PEFT tuner layer of ``model`` (a PeftModel, or a model with adapters added by ``add_adapter``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def merged_adapters(model: nn.Module) -> set:
    """The names of the adapters merged into ``model``'s weights now."""
    return {a for m in tuner_layers(model) for a in m.merged_adapters}


def why_not_mergeable(model: nn.Module, adapter: str) -> Optional[str]:
    """Why ``adapter`` cannot be merged into this model's weights, or None."""
    for layer in tuner_layers(model):
        if adapter not in getattr(layer, "lora_A", {}):
            continue
        weight = getattr(layer.get_base_layer(), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return (f"its base weights are not plain floating point "
                    f"({getattr(weight, 'dtype', type(layer.get_base_layer()).__name__)})")
        if weight.requires_grad:
            return "the base weights are being trained"
    return None


@contextmanager
def base_weights_kept(model: nn.Module, *adapters: str) -> Iterator[None]:
    """Inside: merge and unmerge the ``adapters`` as often as a timer likes; after: the base weights of the layers
    holding any of them hold exactly their values from before, in the same tensors (a recorded CUDA graph keeps
    reading them). Merging adds s·BA into the weight and unmerging subtracts it, in the weight's dtype: in bf16
    each round trip leaves rounding behind, and a timer makes dozens (and a model merged before the timing is
    unmerged for it and merged again after)."""
    kept = []
    for layer in tuner_layers(model):
        if any(adapter in getattr(layer, "lora_A", {}) for adapter in adapters):
            weight = layer.get_base_layer().weight
            kept.append((weight, weight.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, copy in kept:
                weight.copy_(copy)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() with the project's timer (utils.timing: CUDA events on a GPU, the host clock
    otherwise, at most ``repeats`` timed calls there)."""
    if device.type == "cuda":
        return gpu_seconds(fn) * 1e3
    return host_seconds(fn, reps=repeats) * 1e3


__all__ = ["base_weights_kept", "merged_adapters", "time_ms", "tuner_layers", "why_not_mergeable"]
