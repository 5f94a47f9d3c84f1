"""SitsLoraConfig: a PEFT ``LoraConfig`` with its own peft type and the sits_lora fields.

Every field PEFT's LoraConfig has keeps its meaning. The sits_lora fields below carry help text
in their metadata and are checked in ``__post_init__`` by one table of validators, so a new field
(dynamic rank, fp8, ...) adds one entry there and nothing else. Checks that need the model (a rank
larger than a layer, a target module that matches nothing) run when the adapter is injected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from peft import LoraConfig

from ._registry import SITS_LORA_PEFT_TYPE

KERNEL_CHOICES = ("auto", "triton", "torch")


def _require_choice(allowed: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value not in allowed:
            return f"allowed values are {', '.join(repr(a) for a in allowed)}"
        return None

    return check


def _require_bool(value: Any) -> str | None:
    if not isinstance(value, bool):
        return "it must be True or False"
    return None


def _require_positive_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return "it must be a positive integer (the LoRA rank), e.g. r=16"
    return None


def _require_number(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "it must be a number, e.g. lora_alpha=32"
    return None


def _require_probability(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        return "it must be a probability in [0, 1), e.g. lora_dropout=0.05"
    return None


def _require_pattern_of_positive_ints(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "it must be a dict mapping a module name or regex to a rank, e.g. {'down_proj': 8}"
    for key, rank in value.items():
        if _require_positive_int(rank) is not None:
            return f"the rank for {key!r} is {rank!r}; every rank must be a positive integer"
    return None


# Field name -> check returning None when the value is valid, else what is allowed.
# LoraConfig's own fields are listed where PEFT does not already reject a bad value with a clear message.
_VALIDATORS: dict[str, Callable[[Any], str | None]] = {
    "r": _require_positive_int,
    "lora_alpha": _require_number,
    "lora_dropout": _require_probability,
    "rank_pattern": _require_pattern_of_positive_ints,
    "kernel": _require_choice(KERNEL_CHOICES),
    "fuse_siblings": _require_bool,
    "bias": _require_choice(("none", "all", "lora_only")),
}


@dataclass
class SitsLoraConfig(LoraConfig):
    """Configuration of a sits_lora adapter.

    Accepts every argument of :class:`peft.LoraConfig` plus the fields below. Saved with
    ``peft_type: SITS_LORA``; ``import sits_lora`` registers the type so that
    ``PeftModel.from_pretrained`` can load it again.
    """

    kernel: str = field(
        default="auto",
        metadata={
            "help": (
                "Which implementation runs the LoRA linear layers. 'torch': the plain PyTorch reference "
                "(sits_lora.ops.reference), on any device. 'triton': the fused Triton kernels (a CUDA GPU, "
                "or the CPU under TRITON_INTERPRET=1 for testing). 'auto': the fastest one available on the "
                "layer's device."
            )
        },
    )
    fuse_siblings: bool = field(
        default=True,
        metadata={
            "help": (
                "Run adapted layers of one parent that read the same input (q/k/v, gate/up) as one "
                "operation on the Triton path: one pass over the input for all of them in forward and "
                "backward, and one saved copy of it. Eager mode only; no effect on outputs."
            )
        },
    )

    def __post_init__(self) -> None:
        for name, check in _VALIDATORS.items():
            problem = check(getattr(self, name))
            if problem is not None:
                raise ValueError(f"SitsLoraConfig.{name}={getattr(self, name)!r} is invalid: {problem}.")
        super().__post_init__()
        self.peft_type = SITS_LORA_PEFT_TYPE
