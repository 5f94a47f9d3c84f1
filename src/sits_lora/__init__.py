"""sits_lora: hardware-native LoRA for Hugging Face PEFT.

``import sits_lora`` registers the SITS_LORA adapter type with PEFT, so that
``get_peft_model(model, SitsLoraConfig(...))``, ``PeftModel.from_pretrained`` and
``AutoPeftModelForCausalLM.from_pretrained`` work with sits_lora adapters.
"""

from __future__ import annotations

from ._registry import SITS_LORA_PEFT_TYPE, register_with_peft
from .config import SitsLoraConfig
from .export import export_peft_lora
from .layer import SitsLoraLinear
from .model import SitsLoraModel

__version__ = "0.1.0"

register_with_peft()


def apply_native_lora(model, config: SitsLoraConfig, adapter_name: str = "default", **kwargs):
    """Wrap ``model`` with a sits_lora adapter: the same as ``peft.get_peft_model(model, config)``."""
    from peft import get_peft_model

    if not isinstance(config, SitsLoraConfig):
        raise TypeError(
            f"apply_native_lora expects a SitsLoraConfig, got {type(config).__name__}; "
            f"build one with sits_lora.SitsLoraConfig(r=16, target_modules=[...])."
        )
    return get_peft_model(model, config, adapter_name=adapter_name, **kwargs)


__all__ = [
    "SITS_LORA_PEFT_TYPE",
    "SitsLoraConfig",
    "SitsLoraLinear",
    "SitsLoraModel",
    "apply_native_lora",
    "export_peft_lora",
    "__version__",
]
