"""Sibling fusion: adapted layers of one parent that read the same input run as one operation.

q_proj / k_proj / v_proj read the same hidden states, and so do gate_proj / up_proj. The layers
stay separate modules (PEFT's state dict, merge and save are untouched); they share a
``SiblingGroup``. When the first of them is called with x, the group computes every sibling's
output in one ``LoraSiblingsFunction`` (one shrink pass over x, one saved x, one backward pass over
x for all dA, one dx) and hands the others their output when they are called with the same x.
This is done from the layers, not by patching the parent module, so it works for any model whose
parent calls its siblings on one tensor; when a sibling is called with another tensor (cross
attention, say), the group notices and the layers run one by one from then on. A diffusers cross-attention
module (``is_cross_attention``) groups only to_k / to_v, which read the text encoder's states.

Eager mode only: under torch.compile each layer is one custom op and Inductor schedules them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import ops
from .bases import autocast_inputs

SIBLING_NAME_SETS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
    ("to_q", "to_k", "to_v"),
    ("add_q_proj", "add_k_proj", "add_v_proj"),   # diffusers' joint attention (SD3, Flux): the text stream
    ("w1", "w3"),
)
# diffusers' cross-attention (Attention.is_cross_attention): to_q reads the image tokens, to_k / to_v the text
CROSS_ATTENTION_NAMES = ("to_k", "to_v")


class SiblingGroup:
    """Layers of one parent module that read the same input."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.out_features = sum(layer.out_features for layer in layers)  # the fused op's output width
        self.enabled = True
        self._pending_x: Optional[torch.Tensor] = None
        self._pending_version = -1
        self._pending: dict[int, torch.Tensor] = {}

    def _clear(self) -> None:
        self._pending_x, self._pending = None, {}

    def holds_output(self, layer, x: torch.Tensor) -> bool:
        """Whether the group already computed ``layer``'s output for ``x`` (a sibling ran first): the layer's
        call then only hands it over, and saves nothing for backward."""
        return x is self._pending_x and id(layer) in self._pending

    def forward(self, layer, x: torch.Tensor) -> Optional[torch.Tensor]:
        """layer's output through the group, or None when the layer must run on its own."""
        if not self.enabled or torch.compiler.is_compiling():
            return None
        key = id(layer)
        if self._pending:
            if x is self._pending_x and x._version == self._pending_version and key in self._pending:
                out = self._pending.pop(key)
                if not self._pending:
                    self._clear()
                return out
            if x is not self._pending_x:
                # a sibling read another tensor: this parent does not feed its siblings one input
                self.enabled = False
                self._clear()
                return None
        plan = self._plan(x)
        if plan is None:
            return None
        weights, biases, As, Bs, scalings = plan
        casts = [autocast_inputs(x, w, b) for w, b in zip(weights, biases)]
        x_in, autocast_off = casts[0][0], casts[0][3]
        with autocast_off:
            outputs = ops.lora_siblings_triton(x_in, [c[1] for c in casts], [c[2] for c in casts], As, Bs, scalings)
        self._pending_x, self._pending_version = x, x._version
        self._pending = {id(other): y for other, y in zip(self.layers, outputs) if other is not layer}
        return outputs[self.layers.index(layer)]

    def _plan(self, x: torch.Tensor):
        """(weights, biases, As, Bs, scalings) when every sibling can take the fused path now."""
        weights, biases, As, Bs, scalings = [], [], [], [], []
        for layer in self.layers:
            if not layer.frozen_base.fuses_siblings:
                return None  # a quantized base (sits_lora.bases.fp8) runs its own fused path
            # None also for a dynamic-rank adapter that routes (a per-token rank is not the static product here)
            adapter = layer._fused_adapter((), {})
            if adapter is None or ops.resolve_kernel(layer.sits_kernel[adapter], x, self.out_features) != "triton":
                return None
            base = layer.base_layer
            dropout = layer.lora_dropout[adapter]
            if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
                return None
            if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
                return None  # each sibling would need its own dropout mask of x
            weights.append(base.weight)
            biases.append(base.bias)
            As.append(layer.lora_A[adapter].weight)
            Bs.append(layer.lora_B[adapter].weight)
            scalings.append(layer.scaling[adapter])
        return weights, biases, As, Bs, scalings


def assign_sibling_groups(model: nn.Module, layer_cls, enabled: bool = True) -> int:
    """Give sibling layers of ``layer_cls`` a shared SiblingGroup; return the number of groups."""
    groups = 0
    for parent in model.modules():
        children = dict(parent.named_children())
        cross = getattr(parent, "is_cross_attention", False) is True
        for names in SIBLING_NAME_SETS:
            if cross and names == ("to_q", "to_k", "to_v"):
                names = CROSS_ATTENTION_NAMES
            layers = [children[n] for n in names if isinstance(children.get(n), layer_cls)]
            for layer in layers:
                layer._sibling_group = None
            if not enabled or len(layers) < 2 or len({layer.in_features for layer in layers}) != 1:
                continue
            group = SiblingGroup(layers)
            for layer in layers:
                layer._sibling_group = group
            groups += 1
    return groups
