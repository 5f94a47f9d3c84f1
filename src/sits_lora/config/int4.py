"""The 4-bit base fields of SitsLoraConfig (``Int4Fields``: ``base_quant``, ``int4_group_size``) and their checks.

As ``config/fp8.py``: ``adapter.py`` lists the per-field checks (``FIELD_CHECKS``) in its table and calls
:func:`check_base_quant_config` from ``__post_init__``. Imports nothing from sits_lora but
sits_lora.utils.validation, and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Any, Literal, Optional

from ..utils import validation

BASE_QUANTS = ("off", "int4")
INT4_DEFAULTS = {"int4_group_size": 128}
# The fields every adapter of one model must agree on: they describe the one frozen base.
SHARED_FIELDS = ("base_quant",) + tuple(INT4_DEFAULTS)


def require_group_size(value: Any) -> Optional[str]:
    if not validation.is_int(value) or value < 32 or value & (value - 1):
        return ("it must be a power of two of at least 32 (input features per scale / min pair), e.g. "
                "int4_group_size=128")
    return None


# The 4-bit base fields' checks, for SitsLoraConfig's table (sits_lora.utils.validation).
FIELD_CHECKS: dict[str, validation.Check] = {
    "base_quant": validation.choice(BASE_QUANTS),
    "int4_group_size": require_group_size,
}


def check_base_quant_config(config) -> None:
    """Combinations of fields that cannot work together; raise a ValueError naming the fix."""
    if config.base_quant == "off":
        changed = [f"{name}={getattr(config, name)!r}" for name, default in INT4_DEFAULTS.items()
                   if getattr(config, name) != default]
        if changed:
            raise ValueError(f"SitsLoraConfig: {', '.join(changed)} only applies with base_quant='int4', but "
                             f"base_quant='off'. Set base_quant='int4', or leave it at its default.")
        return
    prefix = f"SitsLoraConfig.base_quant={config.base_quant!r}"
    if getattr(config, "fp8", "off") != "off":
        raise ValueError(f"{prefix} cannot be combined with fp8={config.fp8!r}: a layer has one frozen base. Use one "
                         f"of the two.")
    if getattr(config, "use_dynamic_rank", False):
        raise ValueError(f"{prefix} cannot be combined with use_dynamic_rank=True: the dynamic-rank layers read a "
                         f"dense base weight. Use one of the two.")
    if getattr(config, "use_dora", False):
        raise ValueError(f"{prefix} cannot be combined with use_dora=True: DoRA reads the base weight's column "
                         f"norms at every step. Set use_dora=False.")


@dataclass
class Int4Fields:
    """SitsLoraConfig's 4-bit base fields, with their help (saved flat in adapter_config.json with the others)."""

    base_quant: Literal["off", "int4"] = field(
        default="off",
        metadata={
            "help": (
                "4-bit frozen base without bitsandbytes (sits_lora.int4). 'int4': the base weight of each adapted "
                "layer is quantized once at injection (weight-only, asymmetric, one scale and min per "
                "int4_group_size input features, rows padded to 32-byte multiples: 0.27x the bf16 bytes at group "
                "size 128); forward and dX run from the packed codes, the LoRA branch stays in the model's dtype. "
                "Adapted layers must be torch.nn.Linear. For bitsandbytes NF4 / FP4, load the model with "
                "BitsAndBytesConfig(load_in_4bit=True) and leave this 'off'."
            )
        },
    )
    int4_group_size: int = field(
        default=128,
        metadata={"help": "Input features per INT4 scale / min pair: a power of two of at least 32 that divides "
                          "every adapted layer's in_features."},
    )
