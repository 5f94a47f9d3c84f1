"""The plain frozen base: an ``nn.Linear`` in bf16, fp16 or fp32, run through ``sits_lora.ops.lora_linear`` (ops/linear.py)."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Optional

import torch
from torch import nn

from .. import ops
from ..utils.cast_copies import cast_copies

# Whether each device type has an autocast mode ("meta", used by plans and shape checks, has none).
# torch.amp.is_autocast_available is a builtin that torch.compile cannot trace on torch 2.11: asked in
# every layer it broke the graph in each of them. A dict read is traced; the common types are asked here,
# once, and any other on its first eager call.
_AUTOCAST_AVAILABLE: dict[str, bool] = {t: torch.amp.is_autocast_available(t) for t in ("cpu", "cuda", "meta")}


def _autocast_on(device_type: str) -> bool:
    available = _AUTOCAST_AVAILABLE.get(device_type)
    if available is None:
        available = _AUTOCAST_AVAILABLE.setdefault(device_type, torch.amp.is_autocast_available(device_type))
    return available and torch.is_autocast_enabled(device_type)


def autocast_inputs(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]):
    """(x, weight, bias, context) as autocast would hand them to a linear layer (weight None: a quantized base,
    which forms W in x's dtype itself).

    The fused path is an autograd Function, which autocast does not cast for: under autocast the
    input and the frozen weight are cast here to the autocast dtype (as autocast does for
    nn.Linear), and the Function then runs with autocast off so that its backward sees the same
    dtypes as its forward. Without autocast nothing changes.
    """
    device_type = "cuda" if x.is_cuda else x.device.type
    if not _autocast_on(device_type):
        return x, weight, bias, nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    return (x.to(dtype), None if weight is None else weight.to(dtype), None if bias is None else bias.to(dtype),
            torch.autocast(device_type, enabled=False))


def _adapter_weights(layer, adapter: str) -> tuple:
    return layer.lora_A[adapter].weight, layer.lora_B[adapter].weight


class Bf16Base:
    """The base of every SitsLoraLinear whose frozen weight is a plain ``nn.Linear`` (stateless: one
    instance, :data:`BF16_BASE`, serves every layer)."""

    module_type = nn.Linear
    # layers on this base can share one fused op with their siblings (sits_lora.layers.siblings)
    fuses_siblings = True

    def fused_forward(self, layer, adapter: str, x: torch.Tensor) -> torch.Tensor:
        out = self._decode_forward(layer, adapter, x)
        if out is not None:
            return out
        if layer.sibling_group is not None:
            out = layer.sibling_group.forward(layer, x)
            if out is not None:
                return out
        base = layer.base_layer
        requested = layer.sits_kernel[adapter]
        kernel = ops.resolve_kernel(requested, x, layer.out_features)
        if kernel == "triton" and (base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)):
            kernel = "torch"  # the fused kernels assume a frozen base (no dW / db); the reference computes them
        elif kernel == "triton" and ops.small_call(requested, x, layer.in_features, layer.out_features):
            kernel = "aten"   # too small for the kernels' launches to pay (ops.aten)
        x, weight, bias, autocast_off = autocast_inputs(x, base.weight, base.bias)
        dropout = layer.lora_dropout[adapter]
        x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else x
        recompute = layer.input_recompute
        product = recompute.product_of(x) if recompute is not None and x_lora is x and kernel == "triton" else None
        with autocast_off:
            return ops.lora_linear(
                x, x_lora, weight, bias, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                layer.scaling[adapter], kernel, product,
            )

    def _decode_forward(self, layer, adapter: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A decode step's call (a few rows, nothing to differentiate) as one kernel (ops.decode), or None. The
        layer's siblings (q / k / v, gate / up) share that kernel when each can take this path
        (``SiblingGroup.decode_forward``): one launch for the group where the merged model issues one a projection.
        Not so in a group that keeps its outputs across calls (a cross-attention to_k / to_v pair: answering from
        what it kept costs nothing): the group's own path runs."""
        if not ops.decode_call(x, layer.in_features):
            return None
        group = layer.sibling_group
        if group is not None:
            if group.reuse_across_calls:
                return None
            out = group.decode_forward(layer, x)
            if out is not None:
                return out
        operands = self.decode_operands(layer, adapter, x)
        if operands is None:
            return None
        x, projection, autocast_off = operands
        with autocast_off:
            return ops.lora_linear_decode(x, *projection)

    @staticmethod
    def decode_operands(layer, adapter: str, x: torch.Tensor) -> Optional[tuple]:
        """(x, (W, b, A, B, s), autocast context) for the decode kernel when ``layer``'s call with ``adapter`` can
        take it (the Triton kernel setting, no active dropout, W in the activations' dtype), else None."""
        dropout = layer.lora_dropout[adapter]
        if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
            return None
        if ops.resolve_kernel(layer.sits_kernel[adapter], x, layer.out_features) != "triton":
            return None
        base = layer.base_layer
        x, weight, bias, autocast_off = autocast_inputs(x, base.weight, base.bias)
        if weight.dtype != x.dtype:
            return None
        A, B = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        if (A.dtype != x.dtype or B.dtype != x.dtype) and not torch.compiler.is_compiling():
            # every program of the kernel reads all of A: a copy in the activations' dtype, which the kernel casts
            # each tile to anyway, gives the same outputs from half the bytes of PEFT's fp32 adapters (not under
            # torch.compile: the copies' bookkeeping reads version counters, which a traced call must not guard on)
            A, B = cast_copies(layer, adapter, partial(_adapter_weights, layer, adapter), x.dtype)
        return x, (weight, bias, A, B, layer.scaling[adapter]), autocast_off

    def __repr__(self) -> str:
        return "BF16_BASE"


BF16_BASE = Bf16Base()
