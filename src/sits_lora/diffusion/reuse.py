"""A pipeline's denoiser, and turning the cross-attention K / V reuse of sits_lora.layers.siblings on or off for all of it."""

from __future__ import annotations

from torch import nn

from ..layers.siblings import CROSS_ATTENTION_NAMES


def denoiser_of(pipe_or_model, caller: str) -> nn.Module:
    """``pipe.unet`` or ``pipe.transformer`` of a diffusers pipeline, or the module given; ``caller`` names the
    function in the error."""
    if isinstance(pipe_or_model, nn.Module):
        return pipe_or_model
    model = getattr(pipe_or_model, "unet", None) or getattr(pipe_or_model, "transformer", None)
    if model is None:
        raise TypeError(f"{caller} needs a pipeline with a .unet or .transformer, or the denoiser module; "
                        f"got {type(pipe_or_model).__name__}")
    return model


def reuse_cross_attention_kv(model: nn.Module, enabled: bool = True) -> int:
    """Whether the sits_lora to_k / to_v layers of ``model``'s cross-attention modules keep their outputs across
    calls with the same ``encoder_hidden_states`` (on by default; see sits_lora.layers.siblings). Returns how many
    cross-attention groups it set; 0 means none exists (the adapter does not target both to_k and to_v, or sibling
    fusion is off). Turning it off also drops what the groups hold."""
    groups = cross_attention_groups(model)
    for group in groups:
        group.reuse_across_calls = enabled
        if not enabled:
            group.release()
    return len(groups)


def cross_attention_groups(model: nn.Module) -> list:
    """The sibling groups of ``model``'s cross-attention to_k / to_v layers (sits_lora.layers.siblings.SiblingGroup)."""
    groups = {}
    for parent in model.modules():
        if getattr(parent, "is_cross_attention", False) is not True:
            continue
        for name in CROSS_ATTENTION_NAMES:
            group = getattr(getattr(parent, name, None), "sibling_group", None)
            if group is not None:
                groups[id(group)] = group
    return list(groups.values())
