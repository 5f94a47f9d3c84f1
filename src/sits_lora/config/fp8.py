"""The fp8 fields of SitsLoraConfig (``Fp8Fields``) and their checks.

``adapter.py`` lists the per-field checks below (``FIELD_CHECKS``) in its table and calls
:func:`check_fp8_config` from ``__post_init__``; ``sits_lora.fp8`` reads the defaults and the recipes. This module
imports nothing from sits_lora but sits_lora.utils.validation, and no torch (the recipe checks its options with it
before torch loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..utils import validation

FP8_RECIPES = ("off", "hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
WEIGHT_SCALES = ("tensor", "row")
FP8_LAYER_CHOICES = ("auto", "all")

# The defaults of the fp8_* fields (Transformer Engine's DelayedScaling: history 1024, "max", margin 0).
FP8_DEFAULTS = {
    "fp8_amax_history_len": 1024,
    "fp8_amax_compute_algo": "max",
    "fp8_margin": 0,
    "fp8_weight_scale": "tensor",
    "fp8_keep_bf16_weight": False,
    "fp8_emulate": False,
    "fp8_layers": "auto",
}
# The fields that must agree between every adapter of one model: they describe the one fp8 base.
SHARED_FIELDS = ("fp8",) + tuple(FP8_DEFAULTS)


# The fp8 fields' checks, for SitsLoraConfig's table (sits_lora.utils.validation).
FIELD_CHECKS: dict[str, validation.Check] = {
    "fp8": validation.choice(FP8_RECIPES),
    "fp8_amax_history_len": validation.positive_int(", e.g. fp8_amax_history_len=1024"),
    "fp8_amax_compute_algo": validation.choice(AMAX_COMPUTE_ALGOS),
    "fp8_margin": validation.non_negative_int(": the scale is divided by 2**fp8_margin, e.g. fp8_margin=0 "
                                              "(Transformer Engine's default)"),
    "fp8_weight_scale": validation.choice(WEIGHT_SCALES),
    "fp8_keep_bf16_weight": validation.boolean,
    "fp8_emulate": validation.boolean,
    "fp8_layers": validation.choice(FP8_LAYER_CHOICES),
}


def check_fp8_config(config) -> None:
    """Combinations of fields that cannot work together; raise a ValueError naming the fix."""
    if config.fp8 == "off":
        changed = [f"{name}={getattr(config, name)!r}" for name, default in FP8_DEFAULTS.items()
                   if getattr(config, name) != default]
        if changed:
            raise ValueError(
                f"SitsLoraConfig: {', '.join(changed)} only apply with fp8 on, but fp8='off'. Set fp8='hybrid' "
                f"(e4m3 forward, e5m2 gradients) or fp8='e4m3', or leave these fields at their defaults."
            )
        return
    prefix = f"SitsLoraConfig.fp8={config.fp8!r}"
    if getattr(config, "use_dynamic_rank", False):
        raise ValueError(f"{prefix} cannot be combined with use_dynamic_rank=True: the dynamic-rank layers run "
                         f"their own bf16 path. Use one of the two.")
    if getattr(config, "use_dora", False):
        raise ValueError(f"{prefix} cannot be combined with use_dora=True: DoRA reads the base weight's column "
                         f"norms at every step and the fp8 base keeps no bf16 weight. Set use_dora=False.")
    kernel = getattr(config, "kernel", "auto")
    if config.fp8_emulate and kernel == "triton":
        raise ValueError(f"{prefix} with fp8_emulate=True runs plain PyTorch, but kernel='triton' asks for the "
                         f"Triton kernels. Use kernel='auto' (or 'torch'), or fp8_emulate=False on a GPU.")
    if not config.fp8_emulate and kernel == "torch":
        raise ValueError(f"{prefix} runs torch._scaled_mm and Triton casts, but kernel='torch' asks for the plain "
                         f"PyTorch reference. Use kernel='auto', or fp8_emulate=True for the same numerics in "
                         f"plain PyTorch.")


@dataclass
class Fp8Fields:
    """SitsLoraConfig's fp8 fields, with their help (saved flat in adapter_config.json with the others)."""

    fp8: Literal["off", "hybrid", "e4m3"] = field(
        default="off",
        metadata={
            "help": (
                "FP8 frozen base (sits_lora.fp8). 'hybrid': the base weight of each adapted layer is quantized "
                "once to e4m3, activations are cast to e4m3 in forward and gradients to e5m2 in backward, with "
                "delayed scaling, and both base GEMMs run in fp8 (torch._scaled_mm); the LoRA branch stays in "
                "bf16. 'e4m3': the same with e4m3 gradients. Needs a GPU of compute capability 8.9 or newer, "
                "or fp8_emulate=True. Adapted layers must be torch.nn.Linear with in and out features "
                "multiples of 16, or bitsandbytes 4-bit layers (QLoRA), which keep their 4-bit storage and run "
                "their GEMMs in fp8 (docs/quantization.md). 'off': the bf16 path."
            )
        },
    )
    fp8_amax_history_len: int = field(
        default=1024,
        metadata={
            "help": (
                "Delayed scaling (Transformer Engine's DelayedScaling): how many optimizer steps of each "
                "activation's and gradient's absolute maximum (amax) each layer keeps."
            )
        },
    )
    fp8_amax_compute_algo: Literal["max", "most_recent"] = field(
        default="max",
        metadata={
            "help": (
                "The amax a scale is computed from: 'max' over the history (safe against spikes), or "
                "'most_recent' (the last step's, follows the data fastest)."
            )
        },
    )
    fp8_margin: int = field(
        default=0,
        metadata={"help": "Headroom in powers of two: scale = (fp8_max / amax) / 2**fp8_margin."},
    )
    fp8_weight_scale: Literal["tensor", "row"] = field(
        default="tensor",
        metadata={
            "help": (
                "Granularity of the frozen weight's fp8 scale: 'tensor' (one scale, cuBLAS fp8 GEMM) or 'row' "
                "(one scale per output row: more accurate with outlier rows; row-wise torch._scaled_mm, "
                "bf16 activations only)."
            )
        },
    )
    fp8_keep_bf16_weight: bool = field(
        default=False,
        metadata={
            "help": (
                "Keep the original bf16 base weight beside the fp8 one (2x the frozen-weight memory): merges "
                "and unload then give back the exact bf16 base. False frees it (fp8 weight + scale: about "
                "0.5x the bf16 bytes) and merges start from the dequantized fp8 weight."
            )
        },
    )
    fp8_emulate: bool = field(
        default=False,
        metadata={
            "help": (
                "Run the fp8 numerics by quantize-dequantize in plain PyTorch on any device (CPU, older GPUs): "
                "the same casts, scales and amax records, fp32 matrix products. For tests; slow."
            )
        },
    )
    fp8_layers: Literal["auto", "all"] = field(
        default="auto",
        metadata={
            "help": (
                "Which adapted layers get the fp8 base. 'auto': only those whose shape makes fp8 faster than "
                "the bf16 fused path on this GPU (a measured crossover from `sits-lora compile --fp8` "
                "stored with the tuned kernel configs; without a measurement for a shape, fp8 where "
                "in_features x out_features >= 32 Mi); the others keep the bf16 path. "
                "sits_lora.fp8.fp8_layer_plan(model) says which layer got which, and why. With fp8_emulate "
                "every layer is quantized (emulation has no speed to win). 'all': every adapted layer."
            )
        },
    )
