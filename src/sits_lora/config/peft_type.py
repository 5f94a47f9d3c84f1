"""The SITS_LORA member of PEFT's ``PeftType`` enum.

PEFT keeps its method types in the ``PeftType`` enum and ``register_peft_method`` accepts only a
name that is already a member; there is no public way to add one, so the member is added here
through the enum's own maps (checked on CPython 3.11, 3.12 and 3.13). This is the only place in
sits_lora that touches PEFT internals of that kind. It imports nothing from sits_lora, so the config
(which stamps its peft type) and the registry (which registers the tuner) both build on it.
"""

from __future__ import annotations

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


def sits_lora_peft_type():
    """PeftType.SITS_LORA, added to peft's enum on first use (idempotent)."""
    from peft.utils.peft_types import PeftType

    return _add_enum_member(PeftType, SITS_LORA_NAME.upper(), SITS_LORA_NAME.upper())


def __getattr__(name: str):
    # SITS_LORA_PEFT_TYPE is made on first use: it needs peft's PeftType enum
    if name == "SITS_LORA_PEFT_TYPE":
        return sits_lora_peft_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
