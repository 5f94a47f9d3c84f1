"""The bitsandbytes 4-bit frozen base (QLoRA: NF4 / FP4, with or without double quantization): its fused path.

A model loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` keeps each adapted weight as a bitsandbytes
``Linear4bit``. :class:`Bnb4bitBase` runs such a layer's base products through a dense W that bitsandbytes'
own ``dequantize_4bit`` writes into the shared buffer of ``sits_lora.ops.dequant_linear`` (once in forward,
once in backward: the model holds only the packed bytes), then cuBLAS, with the LoRA branch on the fused
kernels. Importing this module imports bitsandbytes.
"""

from __future__ import annotations

import os

import bitsandbytes as bnb
import torch
from torch import nn

from .. import ops
from ..ops.bnb4_dequant import Bnb4Layout, bnb4_dequantize
from ..ops.dequant_linear import DenseProducts, dequant_lora_linear, dequant_lora_linear_reference, shared_buffer
from .int4 import compute_inputs


DEQUANTIZERS = ("bitsandbytes", "triton")


def dequantizer() -> str:
    """Which kernel forms W on a GPU: ``SITS_LORA_BNB4_DEQUANT`` = "triton" (the default:
    ``sits_lora.ops.bnb4_dequant``, 68-70 % of the H200's copy bandwidth on the 8B shapes against 44-51 % for
    bitsandbytes' own, bench/bench_int4.py) or "bitsandbytes" (its ``dequantize_4bit``)."""
    choice = os.environ.get("SITS_LORA_BNB4_DEQUANT", "triton")
    if choice not in DEQUANTIZERS:
        raise ValueError(f"SITS_LORA_BNB4_DEQUANT={choice!r} is invalid: allowed values are "
                         f"{', '.join(map(repr, DEQUANTIZERS))}")
    return choice


def layout_of(state) -> Bnb4Layout:
    """The tensors of a bitsandbytes ``QuantState`` that ``ops.bnb4_dequant`` reads."""
    if state.nested:
        offset = state.offset   # a one-value tensor; a plain number in a QuantState built by hand
        if not isinstance(offset, torch.Tensor):
            offset = torch.tensor(float(offset), device=state.absmax.device)
        return Bnb4Layout(state.absmax, state.code, state.blocksize, state.state2.absmax, state.state2.code,
                          offset, state.state2.blocksize)
    return Bnb4Layout(state.absmax, state.code, state.blocksize, None, None, None)


def dequantized(weight, dtype: torch.dtype) -> torch.Tensor:
    """W (out_features, in_features) of a bitsandbytes ``Params4bit`` in the shared buffer, in ``dtype``."""
    state = weight.quant_state
    if weight.device.type == "cpu":  # bitsandbytes' CPU backend has no dequantize_4bit.out: a tensor of its own
        out = bnb.functional.dequantize_4bit(weight.data, state)
    else:
        out = shared_buffer(weight.device, state.dtype, tuple(state.shape))
        if dequantizer() == "triton":
            bnb4_dequantize(weight.data, layout_of(state), out)
        else:
            bnb.functional.dequantize_4bit(weight.data, state, out=out)
    return out if state.dtype == dtype else out.to(dtype)


def dequantized_copy(weight) -> torch.Tensor:
    """W in its original dtype, a tensor of its own (for the reference and for checks)."""
    return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)


class Bnb4bitBase:
    """The fused path of a SitsLoraLinear4bit (stateless: one instance, :data:`BNB4_BASE`, serves every layer).

    Computes in the layer's ``compute_dtype`` (autocast's when it is on) and hands the result back in the
    input's dtype, as bitsandbytes' own layer does."""

    module_type = bnb.nn.Linear4bit
    fuses_siblings = False

    def fused_forward(self, layer, adapter: str, x: torch.Tensor) -> torch.Tensor:
        base = layer.base_layer
        weight = base.weight
        # bitsandbytes computes in its compute_dtype (bnb_4bit_compute_dtype), W dequantized to it
        x_in, bias, autocast_off = compute_inputs(x, base.bias, base.compute_dtype or weight.quant_state.dtype)
        kernel = ops.resolve_kernel(layer.sits_kernel[adapter], x_in, layer.out_features)
        dropout = layer.lora_dropout[adapter]
        x_lora = dropout(x_in) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else x_in
        lora_A, lora_B = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        with autocast_off:
            if kernel == "torch":
                products = DenseProducts(lambda dt: dequantized_copy(weight).to(dt))
                y = dequant_lora_linear_reference(x_in, x_lora, lora_A, lora_B, bias, products, layer.out_features,
                                                  layer.scaling[adapter])
            else:
                products = DenseProducts(lambda dt: dequantized(weight, dt))
                y = dequant_lora_linear(x_in, x_lora, lora_A, lora_B, bias, products, layer.out_features,
                                        layer.scaling[adapter])
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def __repr__(self) -> str:
        return "BNB4_BASE"


BNB4_BASE = Bnb4bitBase()
