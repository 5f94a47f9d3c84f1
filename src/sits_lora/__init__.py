"""sits_lora: hardware-native LoRA for Hugging Face PEFT.

``import sits_lora`` registers the SITS_LORA adapter type with PEFT, so that
``get_peft_model(model, SitsLoraConfig(...))``, ``PeftModel.from_pretrained`` and
``AutoPeftModelForCausalLM.from_pretrained`` work with sits_lora adapters. The import itself is light:
the registration happens as soon as peft is imported (at once if it already is), and the public names
below load their modules on first use (sits_lora.registry says how).
"""

from __future__ import annotations

from .registry import register_when_peft_loads
from .utils.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "SITS_LORA_PEFT_TYPE": ".config.peft_type",
    "register_with_peft": ".registry",
    "SitsLoraConfig": ".config",
    "DynamicRankLinear": ".dynamic_rank",  # deprecated name: SitsLoraLinear serves dynamic-rank adapters
    "RankBudget": ".dynamic_rank",
    "truncate_rank": ".dynamic_rank",
    "DynamicRankCallback": ".dynamic_rank",
    "TokenEntropySampler": ".dynamic_rank",
    "export_peft_lora": ".export",
    "export_diffusers_lora": ".export",
    "SitsLoraLinear": ".layers.linear",
    "SitsLoraModel": ".model",
    "NativeLoraTrainer": ".training",
    "NativeStepMixin": ".training",
    "native_step": ".training",
    "SitsHardwareCallback": ".training",
    "plan_memory": ".training",
    "graph_train_step": ".training",
    "AdapterPool": ".serving",
    "graph_decode": ".serving",
    "serving_plan": ".serving",
}

register_when_peft_loads()


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def apply_native_lora(model, config, adapter_name: str = "default", **kwargs):
    """Wrap ``model`` with a sits_lora adapter: the same as ``peft.get_peft_model(model, config)``."""
    from peft import get_peft_model

    from .config import SitsLoraConfig

    if not isinstance(config, SitsLoraConfig):
        raise TypeError(
            f"apply_native_lora expects a SitsLoraConfig, got {type(config).__name__}; "
            f"build one with sits_lora.SitsLoraConfig(r=16, target_modules=[...])."
        )
    return get_peft_model(model, config, adapter_name=adapter_name, **kwargs)


__all__ = [
    "AdapterPool",
    "DynamicRankCallback",
    "NativeLoraTrainer",
    "NativeStepMixin",
    "RankBudget",
    "SITS_LORA_PEFT_TYPE",
    "SitsHardwareCallback",
    "SitsLoraConfig",
    "SitsLoraLinear",
    "SitsLoraModel",
    "TokenEntropySampler",
    "apply_native_lora",
    "export_diffusers_lora",
    "export_peft_lora",
    "graph_decode",
    "graph_train_step",
    "native_step",
    "plan_memory",
    "serving_plan",
    "truncate_rank",
    "__version__",
]
