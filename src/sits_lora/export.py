"""Export a sits_lora adapter as a plain PEFT LoRA checkpoint (``peft_type: LORA``).

Serving engines and stock PEFT know only LORA checkpoints. A sits_lora adapter keeps PEFT LoRA's
parameter names and tensor layout, so the export is the same tensors under a LoraConfig without
the sits_lora fields; stock PEFT loads it, without sits_lora imported, and gives the same outputs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from peft import LoraConfig, PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from .config import SitsLoraConfig
from .dynamic_rank.truncate import check_truncation_rank, static_config, truncated_lora_state_dict

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def _sits_only_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(SitsLoraConfig)} - {f.name for f in dataclasses.fields(LoraConfig)}


def to_plain_lora_config(config: SitsLoraConfig) -> LoraConfig:
    """The LoraConfig that describes the same adapter for stock PEFT."""
    if not isinstance(config, SitsLoraConfig):
        raise TypeError(f"expected a SitsLoraConfig, got {type(config).__name__}")
    kwargs = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(LoraConfig)
        if f.init and f.name not in ("peft_type", "runtime_config")
    }
    return LoraConfig(**kwargs)


def export_peft_lora(model: PeftModel, path: str | os.PathLike, adapter_name: str = "default",
                     rank: Optional[int] = None) -> str:
    """Write ``adapter_name`` of ``model`` to ``path`` as a plain PEFT LoRA checkpoint; return the path.

    The folder gets adapter_config.json (``peft_type: LORA``) and adapter_model.safetensors, and
    loads with ``PeftModel.from_pretrained(base, path)`` in stock PEFT.

    ``rank=k`` (a dynamic-rank adapter, whose rank dimensions are nested) exports its static rank-k
    truncation: the first k dimensions at the same scaling, without routers or probes; the model
    itself is not changed. A routed adapter has no static equivalent at full rank, so it needs ``rank``.
    """
    if not isinstance(model, PeftModel):
        raise TypeError(
            f"export_peft_lora expects the PeftModel returned by get_peft_model / PeftModel.from_pretrained, "
            f"got {type(model).__name__}."
        )
    if adapter_name not in model.peft_config:
        raise ValueError(
            f"export_peft_lora: adapter_name={adapter_name!r} does not exist; the model has "
            f"{sorted(model.peft_config)}."
        )
    config = model.peft_config[adapter_name]
    if rank is None and getattr(config, "use_dynamic_rank", False) and config.rank_scheduler != "static":
        raise ValueError(
            f"export_peft_lora: adapter {adapter_name!r} routes each token to its own rank (rank_scheduler="
            f"{config.rank_scheduler!r}); a plain LoRA checkpoint has one rank. Pass rank=k to export its static "
            f"rank-k truncation, e.g. rank={int(config.target_mean_rank or config.r)}."
        )
    state_dict = get_peft_model_state_dict(model, adapter_name=adapter_name)
    if rank is not None or getattr(config, "use_dynamic_rank", False):
        k = config.r if rank is None else rank
        check_truncation_rank(k, config, adapter_name, "export_peft_lora")
        state_dict = truncated_lora_state_dict(state_dict, k)
        config = static_config(config, k)
    plain = to_plain_lora_config(config)
    plain.inference_mode = True
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()},
              os.path.join(path, ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    plain.save_pretrained(str(path))
    return str(path)


# the pipeline whose LoRA file each diffusers model's adapter is saved as, and the keyword it takes the layers by
# (keys in PEFT's naming, lora_A / lora_B, which diffusers' loaders read for every model; its older lora.down / up
# naming, which convert_state_dict_to_diffusers writes, is left out: diffusers reads a file mixing the two, as that
# conversion makes of a U-Net with Conv2d targets, by its first key and drops the rest)
_DIFFUSERS_PIPELINES = {
    "UNet2DConditionModel": ("StableDiffusionPipeline", "unet"),
    "SD3Transformer2DModel": ("StableDiffusion3Pipeline", "transformer"),
    "FluxTransformer2DModel": ("FluxPipeline", "transformer"),
}


def export_diffusers_lora(model, path: str | os.PathLike, adapter_name: str = "default") -> str:
    """Write ``adapter_name`` of a diffusers model (a ``UNet2DConditionModel``, ``SD3Transformer2DModel`` or
    ``FluxTransformer2DModel`` given a SitsLoraConfig through ``add_adapter``) in the diffusers LoRA format: the
    file that ``pipe.load_lora_weights(path)`` reads, with a plain LoraConfig as its metadata (rank and alpha
    survive the trip). Returns the path. The model is not changed.
    """
    kind = type(model).__name__
    if kind not in _DIFFUSERS_PIPELINES:
        raise TypeError(f"export_diffusers_lora: a {kind} is not a model this export knows; it takes "
                        f"{', '.join(sorted(_DIFFUSERS_PIPELINES))} (a PEFT model: export_peft_lora)")
    configs = getattr(model, "peft_config", {})
    if adapter_name not in configs:
        raise ValueError(f"export_diffusers_lora: adapter_name={adapter_name!r} does not exist; the model has "
                         f"{sorted(configs)} (add one with model.add_adapter(SitsLoraConfig(...)))")
    config = configs[adapter_name]
    if getattr(config, "use_dynamic_rank", False):
        raise ValueError(f"export_diffusers_lora: adapter {adapter_name!r} has a dynamic rank; the diffusers "
                         f"format holds one rank")
    try:
        import diffusers
    except ImportError as error:
        raise ImportError("export_diffusers_lora needs diffusers: pip install 'sits-lora[diffusion]'") from error

    pipeline_name, component = _DIFFUSERS_PIPELINES[kind]
    layers = get_peft_model_state_dict(model, adapter_name=adapter_name)
    plain = to_plain_lora_config(config) if isinstance(config, SitsLoraConfig) else config
    getattr(diffusers, pipeline_name).save_lora_weights(
        str(path), **{f"{component}_lora_layers": layers, f"{component}_lora_adapter_metadata": plain.to_dict()})
    return str(path)

