"""Turn a nested dynamic-rank adapter into a static rank-k adapter; count the routing parameters.

The first k rank dimensions of a nested adapter form a working rank-k adapter at the same scaling
(one scale for all tokens, see variant.py). PEFT computes the scaling from r and lora_alpha, so a
rank-k adapter keeps it by carrying lora_alpha' = s·k (or s·√k with use_rslora).
"""

from __future__ import annotations

import copy
from typing import Optional

from torch import nn

from ..config import SitsLoraConfig
from .variant import holds_dynamic_rank, scale_preserving_alpha


def _peft_model_and_config(model, adapter_name: Optional[str], caller: str):
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    # a PeftModel, or its tuner (model.base_model), so that a SitsLoraModel method can delegate here
    if not isinstance(model, (PeftModel, BaseTuner)):
        raise TypeError(f"{caller} expects the PeftModel returned by get_peft_model / PeftModel.from_pretrained, "
                        f"got {type(model).__name__}.")
    if adapter_name is None:
        adapter_name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    if adapter_name not in model.peft_config:
        raise ValueError(f"{caller}: adapter_name={adapter_name!r} does not exist; the model has {sorted(model.peft_config)}.")
    config = model.peft_config[adapter_name]
    if not isinstance(config, SitsLoraConfig):
        raise TypeError(f"{caller}: adapter {adapter_name!r} is a {type(config).__name__}, not a SitsLoraConfig adapter.")
    return adapter_name, config


def check_truncation_rank(k, config, adapter_name: str, caller: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= config.r:
        raise ValueError(f"{caller}: rank={k!r} is invalid: it must be an integer between 1 and the adapter's rank "
                         f"r={config.r}" + (f", ideally a bucket of {list(config.rank_buckets)}" if config.use_dynamic_rank else ""))
    if k != config.r and not config.use_dynamic_rank:
        raise ValueError(f"{caller}: rank={k} needs an adapter trained with nested rank dimensions "
                         f"(SitsLoraConfig(use_dynamic_rank=True, ...)); the dimensions of adapter {adapter_name!r} "
                         f"(r={config.r}) are not ordered, so its first {k} are not a rank-{k} adapter.")


def static_config(config, k: int):
    """A copy of a SitsLoraConfig describing the static rank-k truncation of its adapter."""
    scaling = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
    new = copy.deepcopy(config)
    new.r = k
    new.lora_alpha = scale_preserving_alpha(scaling, k, config.use_rslora)
    new.use_dynamic_rank = False
    new.rank_scheduler = "entropy-gated"
    new.rank_buckets = None
    new.target_mean_rank = None
    new.rank_histogram = None
    return new


def truncate_rank(model, k: int, adapter_name: Optional[str] = None):
    """Truncate a dynamic-rank adapter in place to a static adapter of rank k; return the model.

    Keeps the first k rank dimensions of lora_A / lora_B and the scaling, drops the routers and
    probes, and updates the adapter's config (r=k, the scale-preserving lora_alpha,
    use_dynamic_rank=False), so the model then merges, saves, loads and exports like any static
    sits_lora adapter. Its outputs equal the nested adapter's with every token at rank k.
    """
    adapter_name, config = _peft_model_and_config(model, adapter_name, "truncate_rank")
    if not config.use_dynamic_rank:
        raise ValueError(f"truncate_rank: adapter {adapter_name!r} was not trained with nested rank dimensions "
                         f"(use_dynamic_rank=False), so its first k dimensions are not a rank-k adapter; train it with "
                         f"SitsLoraConfig(use_dynamic_rank=True, ...) to truncate it.")
    check_truncation_rank(k, config, adapter_name, "truncate_rank")
    layers = [m for m in model.modules() if holds_dynamic_rank(m) and adapter_name in m.lora_A]
    if any(m.merged for m in layers):
        raise ValueError("truncate_rank: the model is merged; call model.unmerge_adapter() first.")
    for layer in layers:
        layer.truncate_adapter(adapter_name, k)
    model.peft_config[adapter_name] = static_config(config, k)
    return model


def truncated_lora_state_dict(state_dict: dict, k: int) -> dict:
    """A PEFT adapter state dict (adapter names removed) cut to rank k, without routers and probes."""
    out = {}
    for key, value in state_dict.items():
        if ".lora_router." in key or ".lora_entropy_probe." in key:
            continue
        if key.endswith("lora_A.weight"):
            value = value[:k]
        elif key.endswith("lora_B.weight"):
            value = value[:, :k]
        out[key] = value
    return out


def rank_parameter_counts(model: nn.Module) -> dict:
    """Parameter counts of the dynamic-rank parts: routers (trainable), entropy probes (fitted, frozen), LoRA A/B."""
    counts = {"router": 0, "entropy_probe": 0, "lora": 0, "layers": 0}
    for module in model.modules():
        if holds_dynamic_rank(module):
            counts["layers"] += 1
            counts["router"] += sum(p.numel() for p in module.lora_router.parameters())
            counts["entropy_probe"] += sum(p.numel() for p in module.lora_entropy_probe.parameters())
            counts["lora"] += sum(p.numel() for d in (module.lora_A, module.lora_B) for p in d.parameters())
    return counts
