"""Frozen bases: the frozen weight a SitsLoraLinear adapts, and how the fused path runs over it.

A SitsLoraLinear holds one base object (``layer.frozen_base``) and asks it two things:

- ``module_type``: the class of ``layer.base_layer`` the base's fused path runs on. When the layer's
  base module is something else (the user swapped it, a hook is on it) PEFT's own forward runs.
- ``fused_forward(layer, adapter, x)``: the base GEMM and the LoRA branch of the one active adapter,
  in one fused op (``sits_lora.ops``).

``bf16.BF16_BASE`` (a plain ``nn.Linear`` in any float dtype) is every layer's base unless a feature
gives it another: ``fp8.Fp8Base`` for ``SitsLoraConfig(fp8=...)``, which swaps ``base_layer`` for an
``Fp8BaseLinear``. A new base (a 4-bit weight, say) is a module class plus an object with these two
members, set on the layer by the feature that quantizes the weight. ``fp8`` is not imported here: it
loads the Triton fp8 kernels.
"""

from __future__ import annotations

from .bf16 import BF16_BASE, Bf16Base, autocast_inputs

__all__ = ["BF16_BASE", "Bf16Base", "autocast_inputs"]
