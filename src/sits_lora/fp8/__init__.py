"""FP8 frozen base with delayed scaling (``SitsLoraConfig(fp8="hybrid")``).

The base weight of each adapted layer is quantized once to e4m3 with its scale; activations (x in
forward, dy in backward) are cast with delayed scaling by one fused pass that also records their
amax; both base GEMMs run in fp8 through ``torch._scaled_mm``; the LoRA branch stays bf16 on the
fused kernels. :class:`Fp8ScalingState` holds every layer's amax history and scales, advanced once
per optimizer step by ``SitsHardwareCallback`` (or :func:`update_scaling` in a hand-written loop).
The base module and its fused path are in :mod:`sits_lora.bases.fp8`, the kernels and the autograd
Function in :mod:`sits_lora.ops.fp8`; its config fields are checked in :mod:`sits_lora.config.fp8`; here: the scaling state
(``scaling``), which layers get fp8 (``selection``) and the model-level steps (``model``).
"""

from __future__ import annotations

from ..utils.lazy import lazy_exports

# Loaded on first use: the layer code imports the Triton kernels.
_EXPORTS = {
    "Fp8BaseLinear": "sits_lora.bases.fp8",
    "Fp8UnsupportedError": "sits_lora.bases.fp8",
    "Fp8ScalingState": ".scaling",
    "fp8_scaling_state": ".scaling",
    "update_scaling": ".scaling",
    "fp8_layer_plan": ".model",
    "frozen_weight_memory": ".model",
    "without_fp8": ".model",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
