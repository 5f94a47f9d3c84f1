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


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast casts a linear layer's input on x's device to, or None when it is off there."""
    device_type = "cuda" if x.is_cuda else x.device.type
    return torch.get_autocast_dtype(device_type) if _autocast_on(device_type) else None


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
    # the implementations of its fused op that a plan may name (sits_lora.layers.forward_plan)
    kernels = ("decode", "triton", "aten", "torch")

    @staticmethod
    def kernel_dtype(layer, x: torch.Tensor) -> Optional[torch.dtype]:
        """The dtype the kernel setting is resolved against: autocast's when it is on (the fused op then computes in
        it, so fp32 activations of an fp32 model under bf16 autocast take the kernels), else None: x's own. Builtins
        only: this runs in every adapted layer's every call."""
        device_type = "cuda" if x.is_cuda else x.device.type
        if _AUTOCAST_AVAILABLE.get(device_type) and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None

    @staticmethod
    def decodes(layer, x: torch.Tensor, dtype: Optional[torch.dtype]) -> bool:
        """Whether the decode kernel can read W as it is, for a call computed in ``dtype`` (``kernel_dtype``'s answer):
        under autocast (which casts x and W alike), or W in the activations' dtype."""
        return dtype is not None or layer.base_layer.weight.dtype == x.dtype

    @staticmethod
    def trains_weight(layer) -> bool:
        base = layer.base_layer
        return base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)

    def fused_forward(self, layer, plan, x: torch.Tensor) -> torch.Tensor:
        """The base GEMM and the LoRA branch of ``plan.adapter`` on ``plan.kernel`` (sits_lora.layers.forward_plan),
        through the layer's sibling group when the plan asks it first and it answers."""
        adapter, kernel = plan.adapter, plan.kernel
        if plan.siblings:
            group = layer.sibling_group
            out = group.decode_forward(layer, x) if kernel == "decode" else group.forward(layer, x)
            if out is not None:
                return out
        if kernel == "decode":
            x, projection, autocast_off = self.decode_operands(layer, adapter, x)
            with autocast_off:
                return ops.lora_linear_decode(x, *projection)
        base = layer.base_layer
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

    @staticmethod
    def decode_operands(layer, adapter: str, x: torch.Tensor) -> tuple:
        """(x, (W, b, A, B, s), autocast context) for the decode kernel, for a call planned on it (kernel
        "decode": the Triton kernel setting, no active dropout, W in the activations' dtype)."""
        base = layer.base_layer
        x, weight, bias, autocast_off = autocast_inputs(x, base.weight, base.bias)
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
