"""INT4 frozen base (``SitsLoraConfig(base_quant="int4")``): weight-only 4-bit, no bitsandbytes needed.

Each adapted layer's weight is quantized once at injection (asymmetric, one scale and min per
``int4_group_size`` input features, rows padded to 32-byte multiples); forward and dX run from the packed
codes (``sits_lora.ops.int4_linear``), the LoRA branch on the fused kernels. The base module and its fused
path are in :mod:`sits_lora.bases.int4`; its config fields are checked in :mod:`sits_lora.config.int4`; here: the model-level steps
(``model``: check, quantize, restore before merge / unload, memory).
"""

from __future__ import annotations

from ..utils.lazy import lazy_exports

# Loaded on first use: the model-level steps import the Triton kernels.
_EXPORTS = {
    "Int4BaseLinear": "sits_lora.bases.int4",
    "int4_weight_memory": ".model",
    "largest_group_size": ".model",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
