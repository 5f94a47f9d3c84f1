"""Validation of the fp8 fields of SitsLoraConfig.

``adapter.py`` lists the per-field checks below (``FIELD_CHECKS``) in its table and calls
:func:`check_fp8_config` from ``__post_init__``; ``sits_lora.fp8`` reads the defaults and the recipes. This module
imports nothing from sits_lora but sits_lora.utils.validation, and no torch (the recipe checks its options with it
before torch loads).
"""

from __future__ import annotations

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
