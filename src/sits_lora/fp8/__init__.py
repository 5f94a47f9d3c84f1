"""FP8 frozen base with delayed scaling (``SitsLoraConfig(fp8="hybrid")``).

The base weight of each adapted layer is quantized once to e4m3 with its scale; activations (x in
forward, dy in backward) are cast with delayed scaling by one fused pass that also records their
amax; both base GEMMs run in fp8 through ``torch._scaled_mm``; the LoRA branch stays bf16 on the
fused kernels. :class:`Fp8ScalingState` holds every layer's amax history and scales, advanced once
per optimizer step by ``SitsHardwareCallback`` (or :func:`update_scaling` in a hand-written loop).
The kernels and the autograd Function are in :mod:`sits_lora.ops.fp8`.
"""

from __future__ import annotations

# Loaded on first use: the layer code imports the Triton kernels, and config.py imports this
# package (for its field checks) whenever sits_lora is imported.
_EXPORTS = {
    "Fp8BaseLinear": "weight",
    "Fp8ScalingState": "scaling",
    "Fp8UnsupportedError": "layer",
    "fp8_layer_plan": "layer",
    "fp8_scaling_state": "layer",
    "frozen_weight_memory": "layer",
    "update_scaling": "layer",
    "without_fp8": "layer",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
