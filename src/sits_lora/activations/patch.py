"""Attach input recomputation to a model's adapted layers (and the norms that may feed them)."""

from __future__ import annotations

import weakref

from torch import nn

from .recompute import InputRecompute, remember_norm_io

# norm module -> its forward-hook handle (one hook per norm, however many adapters are injected)
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _is_norm(module: nn.Module) -> bool:
    # RMSNorm / LayerNorm of torch, transformers (LlamaRMSNorm, Qwen3RMSNorm, ...) and Liger (LigerRMSNorm)
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _norm_width(norm: nn.Module):
    weight = getattr(norm, "weight", None)
    return weight.shape[-1] if weight is not None and weight.dim() >= 1 else None


def attach_input_recompute(model: nn.Module, layer_cls) -> int:
    """Give every ``layer_cls`` layer of ``model`` an InputRecompute; return how many got one.

    A layer's candidate norms are the norms that are children of its ancestors and as wide as its input
    (a decoder layer's input_layernorm / post_attention_layernorm, not Qwen3's per-head q_norm); each is
    hooked once to remember its last input and output. Which producer a layer's input really comes
    from is decided per call (``InputRecompute.saving``).
    """
    modules = dict(model.named_modules())
    attached = 0
    for name, layer in modules.items():
        if not isinstance(layer, layer_cls):
            continue
        norms = []
        parts = name.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            parent = modules.get(".".join(parts[:depth]))
            if parent is None:
                continue
            for child in parent.children():
                if _is_norm(child) and _norm_width(child) == layer.in_features and child not in norms:
                    norms.append(child)
        for norm in norms:
            if norm not in _HOOKED:
                _HOOKED[norm] = norm.register_forward_hook(remember_norm_io)
        layer.input_recompute = InputRecompute(name, tuple(norms))
        attached += 1
    return attached


def detach_input_recompute(model: nn.Module) -> None:
    """Undo :func:`attach_input_recompute`: the layers save their inputs again, the norms lose their hooks."""
    for module in model.modules():
        if "input_recompute" in vars(module):
            del module.input_recompute
        handle = _HOOKED.pop(module, None)
        if handle is not None:
            handle.remove()


def input_recompute_report(model: nn.Module) -> list[dict]:
    """Per adapted layer with recomputation attached: how many training forwards rebuilt its input in
    backward and how many saved it (since the model was built). A layer whose sibling group computed its
    output (sits_lora.layers.siblings: q/k/v, gate/up in one op) reports the group's first layer, which ran the op
    (``"via"``)."""
    rows = []
    for module in model.modules():
        recompute = vars(module).get("input_recompute")
        if recompute is None:
            continue
        source, via = recompute, None
        group = getattr(module, "sibling_group", None)
        if recompute.calls == 0 and group is not None:
            ran = [vars(m).get("input_recompute") for m in group.layers]
            ran = [r for r in ran if r is not None and r.calls]
            if ran:
                source, via = ran[0], ran[0].name
        rows.append({"layer": recompute.name, "forwards": source.calls, "rebuilt": source.rebuilt_calls,
                     "saved": source.calls - source.rebuilt_calls, "via": via})
    return rows
