"""Checks that a quantized frozen base (fp8, INT4) makes around injection: which modules an adapter targets, that
every adapter of the model agrees on the one base, that the targets are ``nn.Linear``, and that the injected layers
are sits_lora's own."""

from __future__ import annotations

import copy
from typing import Sequence

from peft.tuners.tuners_utils import BaseTunerLayer, _maybe_include_all_linear_layers, check_target_module_exists
from torch import nn


def adapter_targets(config, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, base module) of every module ``config`` targets in ``model`` ("all-linear" resolved as PEFT does)."""
    resolved = _maybe_include_all_linear_layers(copy.copy(config), model)
    return [(key, module.get_base_layer() if isinstance(module, BaseTunerLayer) else module)
            for key, module in model.named_modules() if key and check_target_module_exists(resolved, key)]


def check_adapters_agree(tuner, adapter_name: str, fields: Sequence[str], base: str, fix: str) -> None:
    """Raise when another adapter of the model sets ``fields`` (which describe the one ``base``) differently."""
    config = tuner.peft_config[adapter_name]
    settings = {name: getattr(config, name, None) for name in fields}
    for name, other_config in tuner.peft_config.items():
        other = {field: getattr(other_config, field, None) for field in fields}
        if name != adapter_name and other != settings:
            differ = ", ".join(f"{k}: {other[k]!r} vs {settings[k]!r}" for k in fields if other[k] != settings[k])
            raise ValueError(
                f"SitsLoraConfig of adapter {adapter_name!r} and of adapter {name!r} disagree on the {base} ({differ}); "
                f"the adapters of one model share one base, quantized or not. {fix}, or load the model again for the "
                f"other setting.")


def check_linear_targets(setting: str, adapter_name: str, targets: list, own_type: type) -> None:
    """Every target must be an ``nn.Linear`` (or already the base's ``own_type``); ``setting`` is the field as
    the user wrote it (``fp8='hybrid'``), whose 'off' value is the way out."""
    wrong = [f"{key} ({type(m).__name__})" for key, m in targets if type(m) not in (nn.Linear, own_type)]
    if wrong:
        field = setting.split("=", 1)[0]
        raise ValueError(
            f"SitsLoraConfig.{setting} quantizes torch.nn.Linear base layers only; adapter {adapter_name!r} targets "
            f"{', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}. Leave these out of target_modules (or add "
            f"them to exclude_modules), or set {field}='off'.")


def injected_layers(tuner, adapter_name: str, layer_cls, setting: str, base: str) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every layer that holds ``adapter_name`` after injection; raise when one is not ``layer_cls``
    (a class, or a tuple of them)
    (a PEFT layer sits_lora does not run: the quantized ``base`` cannot go under it). ``setting`` is the field as
    the user wrote it (``fp8='hybrid'``)."""
    layers = [(key, m) for key, m in tuner.model.named_modules() if hasattr(m, "lora_A") and adapter_name in m.lora_A]
    classes = layer_cls if isinstance(layer_cls, tuple) else (layer_cls,)
    not_ours = [f"{key} ({type(m).__name__})" for key, m in layers if type(m) not in classes]
    if not_ours:
        raise ValueError(
            f"SitsLoraConfig.{setting}: adapter {adapter_name!r} put PEFT layers that sits_lora does not run on "
            f"{', '.join(not_ours[:6])}; {base} needs torch.nn.Linear targets. Leave these out of target_modules.")
    return layers
