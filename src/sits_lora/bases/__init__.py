"""Frozen bases: the frozen weight a SitsLoraLinear adapts, and how the fused path runs over it.

A SitsLoraLinear holds one base object (``layer.frozen_base``). The layer's forward plan
(``sits_lora.layers.forward_plan``) reads what the base declares; the base then executes the plan:

- ``module_type``: the class of ``layer.base_layer`` the base's fused path runs on. When the layer's
  base module is something else (the user swapped it, a hook is on it) PEFT's own forward runs.
- ``fuses_siblings``: whether layers on it can share one op with their siblings (q / k / v, gate / up).
- ``kernels``: the implementations of its fused op a plan may name ("decode", "triton", "aten", "torch"; none for
  a base with one), with ``kernel_dtype(layer, x)`` (the dtype the kernel setting is resolved against:
  autocast's when it is on; None: x's own), ``decodes(layer, x, dtype)`` and ``trains_weight(layer)`` (a trainable base
  runs the reference).
- ``fused_forward(layer, plan, x)``: the base GEMM and the LoRA branch of ``plan.adapter`` in one fused op
  (``sits_lora.ops``) on ``plan.kernel``.

``bf16.BF16_BASE`` (a plain ``nn.Linear`` in any float dtype) is every layer's base unless a feature
gives it another: ``fp8.Fp8Base`` for ``SitsLoraConfig(fp8=...)``, which swaps ``base_layer`` for an
``Fp8BaseLinear``; ``int4.INT4_BASE`` for ``SitsLoraConfig(base_quant="int4")``; ``bnb4.BNB4_BASE`` for a bitsandbytes
4-bit model. A new base is a module class plus an object with these members, set on the layer by the feature
that quantizes the weight. ``fp8`` is not imported here: it loads the Triton fp8 kernels.
"""
from __future__ import annotations

from .bf16 import BF16_BASE, Bf16Base, autocast_dtype, autocast_inputs

__all__ = ["BF16_BASE", "Bf16Base", "autocast_dtype", "autocast_inputs"]
