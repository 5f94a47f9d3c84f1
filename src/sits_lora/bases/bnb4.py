"""The bitsandbytes 4-bit frozen base (QLoRA: NF4 / FP4, with or without double quantization): its fused path.

A model loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` keeps each adapted weight as a bitsandbytes
``Linear4bit``. :class:`Bnb4bitBase` runs such a layer's base products through a dense W that bitsandbytes'
own ``dequantize_4bit`` writes into the shared buffer of ``sits_lora.ops.dequant_linear`` (once in forward,
once in backward: the model holds only the packed bytes), then cuBLAS, with the LoRA branch on the fused
kernels. Under ``SitsLoraConfig(fp8=...)`` a layer's base runs :class:`Bnb4Fp8Base` instead: the 4-bit bytes
stay the storage, W is formed in e4m3 for fp8 GEMMs (``sits_lora.fp8`` decides which layers and owns the
scales). Importing this module imports bitsandbytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import bitsandbytes as bnb
import torch
from torch import nn

from ..ops import fp8 as fp8_ops
from ..ops.bnb4_dequant import Bnb4Layout, bnb4_dequantize, bnb4_dequantize_scaled
from ..ops.dequant_linear import DenseProducts, dequant_lora_linear, dequant_lora_linear_reference, shared_buffer
from .fp8 import check_fp8_call
from .bf16 import autocast_dtype
from .int4 import compute_inputs


DEQUANTIZERS = ("bitsandbytes", "triton")


def dequantizer() -> str:
    """Which kernel forms W on a GPU: ``SITS_LORA_BNB4_DEQUANT`` = "triton" (the default:
    ``sits_lora.ops.bnb4_dequant``, which gets closer to the copy bandwidth than bitsandbytes' own; see
    docs/quantization.md) or "bitsandbytes" (its ``dequantize_4bit``)."""
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
    kernels = ("triton", "torch")   # the implementations a plan may name (sits_lora.layers.forward_plan)
    decodes = staticmethod(lambda layer, x, dtype: False)
    trains_weight = staticmethod(lambda layer: False)

    @staticmethod
    def kernel_dtype(layer, x: torch.Tensor) -> torch.dtype:
        """bitsandbytes computes in its compute_dtype (bnb_4bit_compute_dtype), W dequantized to it; autocast's
        when it is on."""
        base = layer.base_layer
        return autocast_dtype(x) or base.compute_dtype or base.weight.quant_state.dtype

    def fused_forward(self, layer, plan, x: torch.Tensor) -> torch.Tensor:
        adapter, kernel = plan.adapter, plan.kernel
        base = layer.base_layer
        weight = base.weight
        # bitsandbytes computes in its compute_dtype (bnb_4bit_compute_dtype), W dequantized to it
        x_in, bias, autocast_off = compute_inputs(x, base.bias, base.compute_dtype or weight.quant_state.dtype)
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


class Bnb4Fp8Weight:
    """W of one bitsandbytes 4-bit weight, formed in e4m3 for each fp8 GEMM (the ``source`` of
    ``sits_lora.ops.fp8.fp8_dequant_lora_linear``): W8 = e4m3(W · w_scale), into the shared buffer on a GPU (one
    pass over the packed bytes, transposed for dX), a tensor of its own elsewhere (emulation)."""

    def __init__(self, weight, w_scale: torch.Tensor):
        self.weight, self.w_scale = weight, w_scale

    def fp8_weight(self, transposed: bool) -> torch.Tensor:
        state = self.weight.quant_state
        rows, cols = state.shape
        if self.weight.device.type == "cpu":
            w = dequantized_copy(self.weight).float() * self.w_scale.view(-1, 1)
            w8 = w.clamp(-fp8_ops.FP8_MAX[fp8_ops.E4M3], fp8_ops.FP8_MAX[fp8_ops.E4M3]).to(fp8_ops.E4M3)
            return w8.t().contiguous() if transposed else w8
        out = shared_buffer(self.weight.device, fp8_ops.E4M3, (cols, rows) if transposed else (rows, cols))
        return bnb4_dequantize_scaled(self.weight.data, layout_of(state), (rows, cols), self.w_scale, out, transposed)


def fp8_weight_scales(weight, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_scale, w_inv) of a bitsandbytes 4-bit weight for its fp8 GEMMs: from the exact amax of the values its
    codes stand for (per tensor, or per output row), once: the weight is frozen."""
    scale = fp8_ops.weight_scale(dequantized_copy(weight), granularity)
    return scale, scale.reciprocal()


@dataclass(eq=False)
class Bnb4Fp8Base:
    """The fused path of a SitsLoraLinear4bit under fp8: NF4 / FP4 storage, fp8 compute.

    Both base GEMMs run in fp8 (``torch._scaled_mm``) with the layer's row ``index`` of the model's
    ``Fp8ScalingState`` for x and dy, as :class:`sits_lora.bases.fp8.Fp8Base` does; W8 comes from the 4-bit bytes
    per GEMM with the fixed scale ``w_scale`` (``w_inv`` = 1 / w_scale), so the model keeps the 4-bit memory. Computes
    in the input's dtype (the fp8 GEMM writes it; bitsandbytes' compute_dtype only names the dense path's)."""

    state: Any
    index: int
    w_scale: torch.Tensor
    w_inv: torch.Tensor

    module_type = bnb.nn.Linear4bit
    fuses_siblings = False
    kernels = ()   # one implementation: the fp8 GEMMs

    def fused_forward(self, layer, plan, x: torch.Tensor) -> torch.Tensor:
        adapter = plan.adapter
        base = layer.base_layer
        check_fp8_call(x, layer.out_features, self.state.emulate, self.w_inv.numel() > 1)
        if self.w_scale.device != base.weight.device:  # the model moved: the scales follow its weight
            self.w_scale, self.w_inv = self.w_scale.to(base.weight.device), self.w_inv.to(base.weight.device)
        dropout = layer.lora_dropout[adapter]
        x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else None
        scales = self.state.scales_for(self.index, layer.training)
        bias = base.bias if base.bias is None or base.bias.dtype == x.dtype else base.bias.to(x.dtype)
        return fp8_ops.fp8_dequant_lora_linear(x, x_lora, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                                               Bnb4Fp8Weight(base.weight, self.w_scale), self.w_inv, bias,
                                               layer.scaling[adapter], scales)

    def __repr__(self) -> str:
        return f"Bnb4Fp8Base(index={self.index})"
