"""Make PEFT know the SITS_LORA peft type.

PEFT keeps its method types in the ``PeftType`` enum and ``register_peft_method`` accepts only a
name that is already a member; there is no public way to add one, so the member is added here
through the enum's own maps (checked on CPython 3.11, 3.12 and 3.13). This is the only place in
sits_lora that touches PEFT internals of that kind.
"""

from __future__ import annotations

from peft.utils.peft_types import PeftType

SITS_LORA_NAME = "sits_lora"


def _add_enum_member(enum_cls, name: str, value: str):
    if name in enum_cls.__members__:
        return enum_cls[name]
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    if hasattr(enum_cls._member_map_[enum_cls._member_names_[0]], "_sort_order_"):
        member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


SITS_LORA_PEFT_TYPE = _add_enum_member(PeftType, SITS_LORA_NAME.upper(), SITS_LORA_NAME.upper())


def register_with_peft() -> None:
    """Register SitsLoraConfig / SitsLoraModel under SITS_LORA (idempotent)."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils.peft_types import register_peft_method

    from .config import SitsLoraConfig
    from .model import SitsLoraModel

    if PEFT_TYPE_TO_TUNER_MAPPING.get(SITS_LORA_PEFT_TYPE) is SitsLoraModel:
        return
    # prefix "lora_": the parameters keep PEFT LoRA's names (lora_A, lora_B), which is what makes
    # merge, save and the export to a plain LoRA checkpoint work unchanged.
    register_peft_method(name=SITS_LORA_NAME, config_cls=SitsLoraConfig, model_cls=SitsLoraModel, prefix="lora_")
