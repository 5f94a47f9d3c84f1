"""sits_lora: hardware-native LoRA for Hugging Face PEFT.

``import sits_lora`` registers the SITS_LORA adapter type with PEFT, so that
``get_peft_model(model, SitsLoraConfig(...))``, ``PeftModel.from_pretrained`` and
``AutoPeftModelForCausalLM.from_pretrained`` work with sits_lora adapters.
"""

from __future__ import annotations

from ._registry import SITS_LORA_PEFT_TYPE, register_with_peft
from .compliance import BenchmarkRunner
from .config import SitsLoraConfig
from .dynamic_rank import DynamicRankLinear, RankBudget, truncate_rank
from .export import export_peft_lora
from .layer import SitsLoraLinear
from .model import SitsLoraModel

__version__ = "0.1.0"

register_with_peft()

# transformers' Trainer machinery and the sampler's dependencies load on first use
_LAZY = {"DynamicRankCallback", "TokenEntropySampler"}
# the training guard rails (sits_lora.training) import transformers' Trainer on first use
_LAZY_TRAINING = {"NativeLoraTrainer", "SitsHardwareCallback", "plan_memory"}


def __getattr__(name: str):
    if name in _LAZY:
        from . import dynamic_rank

        return getattr(dynamic_rank, name)
    if name in _LAZY_TRAINING:
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "BenchmarkRunner",
    "DynamicRankCallback",
    "DynamicRankLinear",
    "NativeLoraTrainer",
    "RankBudget",
    "SITS_LORA_PEFT_TYPE",
    "SitsHardwareCallback",
    "SitsLoraConfig",
    "SitsLoraLinear",
    "SitsLoraModel",
    "TokenEntropySampler",
    "apply_native_lora",
    "export_peft_lora",
    "plan_memory",
    "truncate_rank",
    "__version__",
]
