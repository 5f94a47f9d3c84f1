"""Where things are in a transformers model, under whatever wraps it (PEFT, DDP, torch.compile)."""

from __future__ import annotations

import torch
from torch import nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT / DDP / compile wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        for attr in ("module", "_orig_mod"):
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module):
                model = inner
                break
        else:
            base = getattr(model, "base_model", None)  # PeftModel -> its tuner (which has peft_config) -> .model
            inner = getattr(base, "model", None)
            if isinstance(inner, nn.Module) and hasattr(base, "peft_config") and base is not model:
                model = inner
    return model


def decoder_layers(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """(path, blocks) of the longest ModuleList of same-class modules: the decoder layers."""
    best: tuple[str, list[nn.Module]] = ("", [])
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best[1]):
            classes = {type(m) for m in module}
            if len(classes) == 1:
                best = (name, list(module))
    return best


def text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def restore_forwards(model: nn.Module, wrapper_type: type) -> int:
    """Put back each module's own forward where a ``wrapper_type`` instance replaced it (the wrapper keeps what it
    replaced as ``original``: an instance forward, or None when the class's ran). Returns how many were restored."""
    restored = 0
    for module in model.modules():
        current = vars(module).get("forward")
        if isinstance(current, wrapper_type):
            if current.original is not None:
                module.forward = current.original
            else:
                del module.forward
            restored += 1
    return restored


def stored_bytes(weight) -> int:
    """Bytes a weight holds: the tensor's, plus the bitsandbytes 4-bit quantization state attached to it (absmax,
    code tables, the nested state of double quantization), read by duck typing: bitsandbytes is not imported."""
    return _tensor_bytes(weight) + _quant_state_bytes(getattr(weight, "quant_state", None))


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _quant_state_bytes(state) -> int:
    if state is None:
        return 0
    own = sum(_tensor_bytes(getattr(state, name, None)) for name in ("absmax", "code", "offset"))
    return own + _quant_state_bytes(getattr(state, "state2", None))


def base_layer_of(module: nn.Module) -> nn.Module:
    get = getattr(module, "get_base_layer", None)
    return get() if callable(get) else module


def linear_dims(module: nn.Module) -> tuple[int, int]:
    base = base_layer_of(module)
    if hasattr(base, "in_features"):
        return int(base.in_features), int(base.out_features)
    weight = base.weight
    return int(weight.shape[1]), int(weight.shape[0])


def is_adapted(module: nn.Module) -> bool:
    """A PEFT tuner layer (it has a base layer) with trainable parameters."""
    return callable(getattr(module, "get_base_layer", None)) and any(p.requires_grad for p in module.parameters())


def checkpointed_layers(model: nn.Module) -> int:
    """How many decoder blocks of ``model`` run under gradient checkpointing now."""
    _, blocks = decoder_layers(unwrap_model(model))
    return sum(1 for b in blocks if getattr(b, "gradient_checkpointing", False) is True)
