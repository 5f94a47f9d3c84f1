"""The fp8 frozen base across a sits_lora model: check and quantize at injection, plan, merge, report.

``quantize_base_layers`` (called by SitsLoraModel after each injection) swaps the ``nn.Linear``
base of the adapted SitsLoraLinear layers that fp8 suits for an :class:`Fp8BaseLinear`, builds one
:class:`Fp8ScalingState` for all of them and sets each layer's ``frozen_base`` to an :class:`Fp8Base`
(sits_lora.bases.fp8), whose fused path the layer's forward then runs. A bitsandbytes 4-bit base (QLoRA) is
not swapped: its bytes stay the storage and the layer's ``frozen_base`` becomes a ``Bnb4Fp8Base``
(sits_lora.bases.bnb4), which forms W in e4m3 for each fp8 GEMM: 4-bit memory, fp8 speed.
``restore_bf16_base_layers`` undoes both before a merge or an unload.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch
from torch import nn

from ..layers.base_checks import adapter_targets, check_adapters_agree, check_linear_targets, injected_layers
from ..bases import BF16_BASE
from ..bases.fp8 import Fp8Base, Fp8BaseLinear, check_fp8_hardware
from ..ops import fp8 as fp8_ops
from ..utils.model_structure import stored_bytes
from . import selection
from ..config.fp8 import FP8_DEFAULTS, SHARED_FIELDS
from .scaling import Fp8ScalingState

logger = logging.getLogger(__name__)

STATE_ATTRIBUTE = "sits_fp8"   # the state's name on SitsLoraModel: model.base_model.sits_fp8


def _is_bnb4(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit linear layer (a model that holds one has imported bitsandbytes)."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def _bnb4_layer_class():
    """SitsLoraLinear4bit where bitsandbytes is loaded, else None (importing it imports bitsandbytes)."""
    if "bitsandbytes" not in sys.modules:
        return None
    from ..layers.linear_4bit import SitsLoraLinear4bit

    return SitsLoraLinear4bit


def _on_bnb4_fp8(layer: nn.Module) -> bool:
    """A SitsLoraLinear4bit whose frozen base runs its GEMMs in fp8 (a Bnb4Fp8Base, told apart by its fields)."""
    return hasattr(layer.frozen_base, "w_inv") and hasattr(layer.frozen_base, "state")


def _check_targets(config, adapter_name: str, targets: list) -> None:
    """targets: (name, base module) pairs; each must be an nn.Linear (or a bitsandbytes 4-bit one) with dims that
    are multiples of 16."""
    check_linear_targets(f"fp8={config.fp8!r}", adapter_name, [(k, m) for k, m in targets if not _is_bnb4(m)],
                         Fp8BaseLinear)
    odd = [f"{key} ({m.in_features} x {m.out_features})" for key, m in targets
           if m.in_features % 16 or m.out_features % 16]
    if odd:
        raise ValueError(
            f"SitsLoraConfig.fp8={config.fp8!r} needs in_features and out_features that are multiples of 16 "
            f"(torch._scaled_mm), but adapter {adapter_name!r} targets {', '.join(odd[:6])}"
            f"{' ...' if len(odd) > 6 else ''}. Add these to exclude_modules, or set fp8='off'."
        )


def check_before_injection(tuner, model: nn.Module, adapter_name: str) -> None:
    """Refuse an fp8 setting that cannot work before PEFT touches the model (nothing lost on bad input)."""
    config = tuner.peft_config[adapter_name]
    check_adapters_agree(tuner, adapter_name, SHARED_FIELDS, "fp8 base", "Give both the same fp8 settings")
    if config.fp8 == "off":
        return
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    check_fp8_hardware(device, config.fp8_emulate)
    _check_targets(config, adapter_name, adapter_targets(config, model))


def quantize_base_layers(tuner, adapter_name: str, layer_cls) -> int:
    """After injecting ``adapter_name``: quantize the bases its fp8 config asks for; return how many.

    ``tuner`` is the SitsLoraModel, ``layer_cls`` SitsLoraLinear. All adapters of one model share
    the fp8 base (:func:`check_before_injection` made sure their fp8 settings agree).
    """
    config = tuner.peft_config[adapter_name]
    if config.fp8 == "off":
        return 0
    bnb4_cls = _bnb4_layer_class()
    layers = injected_layers(tuner, adapter_name, (layer_cls, bnb4_cls) if bnb4_cls else layer_cls,
                             f"fp8={config.fp8!r}", "fp8")
    _check_targets(config, adapter_name, [(key, m.base_layer) for key, m in layers])
    grad_dtype = fp8_ops.E5M2 if config.fp8 == "hybrid" else fp8_ops.E4M3
    choose_by_speed = config.fp8_layers == "auto" and not config.fp8_emulate
    quantized = 0
    for _, layer in layers:
        base = layer.base_layer
        bnb4 = _is_bnb4(base)
        if (type(base) is not nn.Linear and not bnb4) or (bnb4 and _on_bnb4_fp8(layer)):
            continue  # already on an fp8 base
        if choose_by_speed:
            use_fp8, layer._fp8_choice = selection.choose(base.weight.device, base.in_features, base.out_features)
            if not use_fp8:
                continue  # stays on the bf16 fused path: fp8 would be slower at this shape
        else:
            layer._fp8_choice = ("fp8_emulate: every layer" if config.fp8_emulate else "fp8_layers='all'")
        if bnb4:
            from ..bases.bnb4 import Bnb4Fp8Base, fp8_weight_scales

            layer.frozen_base = Bnb4Fp8Base(None, -1, *fp8_weight_scales(base.weight, config.fp8_weight_scale))
        else:
            layer.base_layer = Fp8BaseLinear.from_linear(
                base, config.fp8_weight_scale, config.fp8_keep_bf16_weight, grad_dtype, config.fp8_margin,
                config.fp8_emulate)
        quantized += 1
    _bind(tuner, layer_cls, config)
    if choose_by_speed:
        plan = fp8_layer_plan(tuner.model)
        kept = [name for name, entry in plan.items() if entry["base"] == "bf16"]
        logger.info("fp8_layers='auto': %d of %d adapted layers on the fp8 base, %d stay bf16 (%s)%s",
                    quantized, len(plan), len(kept), ", ".join(kept[:4]), " ..." if len(kept) > 4 else "")
    return quantized


def fp8_layer_plan(model: nn.Module) -> dict:
    """{layer name: {"base": "fp8" | "bf16", "in_features", "out_features", "why"}} for every adapted
    layer of a model built with fp8 on: which base each layer runs, and the reason (a measurement, the
    size rule, or fp8_layers='all')."""
    plan = {}
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if not hasattr(module, "lora_A") or not isinstance(base, nn.Linear):
            continue
        kind = "fp8" if isinstance(base, Fp8BaseLinear) or _on_bnb4_fp8(module) else "bf16"
        if _is_bnb4(base):
            kind = "4-bit storage, " + ("fp8 compute" if kind == "fp8" else "bf16 compute")
        plan[name] = {"base": kind,
                      "in_features": base.in_features, "out_features": base.out_features,
                      "why": getattr(module, "_fp8_choice", None)}
    return plan


def _bind(tuner, layer_cls, config) -> None:
    """One Fp8ScalingState for every fp8 layer of the model (rebuilt, keeping known layers' rows)."""
    bnb4_cls = _bnb4_layer_class()
    layers = [(key, m) for key, m in tuner.model.named_modules()
              if (isinstance(m, layer_cls) and isinstance(m.base_layer, Fp8BaseLinear))
              or (bnb4_cls is not None and isinstance(m, bnb4_cls) and _on_bnb4_fp8(m))]
    old = getattr(tuner, STATE_ATTRIBUTE, None)
    if not layers:
        for _, m in tuner.model.named_modules():
            if isinstance(m, layer_cls):
                m.frozen_base = BF16_BASE
        if old is not None:
            delattr(tuner, STATE_ATTRIBUTE)
        return
    device = layers[0][1].get_base_layer().weight.device
    state = Fp8ScalingState([key for key, _ in layers], config.fp8, config.fp8_amax_history_len,
                            config.fp8_amax_compute_algo, config.fp8_margin, config.fp8_emulate, device)
    if old is not None:
        state.copy_rows_from(old)
    setattr(tuner, STATE_ATTRIBUTE, state)
    for index, (_, layer) in enumerate(layers):
        if isinstance(layer.base_layer, Fp8BaseLinear):
            layer.frozen_base = Fp8Base(state, index)
        else:  # a 4-bit base on fp8: same scales, new row
            layer.frozen_base = dataclasses.replace(layer.frozen_base, state=state, index=index)


def restore_bf16_base_layers(tuner, layer_cls) -> int:
    """Give every fp8 base back as a bf16 ``nn.Linear`` (before merge / unload); return how many.

    With fp8_keep_bf16_weight=True the original weight comes back exactly; otherwise the weight
    is the dequantized e4m3 one (codes times scale: about 3 significant bits per value).
    """
    restored = 0
    for _, layer in tuner.model.named_modules():
        if isinstance(layer, layer_cls) and isinstance(layer.base_layer, Fp8BaseLinear):
            layer.base_layer = layer.base_layer.to_linear()
            layer.frozen_base = BF16_BASE
            restored += 1
        elif hasattr(layer, "frozen_base") and _on_bnb4_fp8(layer):
            del layer.frozen_base  # back to its class's: the 4-bit base's bf16 path (the bytes never changed)
            restored += 1
    if restored:
        config = next(iter(tuner.peft_config.values()))
        _bind(tuner, layer_cls, config)
    return restored


def without_fp8(config):
    """A copy of a SitsLoraConfig with fp8 off and the fp8 fields at their defaults.

    An fp8-trained adapter is an ordinary LoRA adapter (bf16 / fp32 A and B): pass
    ``config=without_fp8(SitsLoraConfig.from_pretrained(path))`` to ``PeftModel.from_pretrained`` to
    load it onto a bf16 base (on any machine), or export it with ``sits_lora.export_peft_lora``.
    """
    return dataclasses.replace(config, fp8="off", **FP8_DEFAULTS)


def frozen_weight_memory(model: nn.Module) -> dict:
    """Bytes of the frozen base weights of adapted layers, as stored now and as bf16 would store them.

    Counts each adapted layer's base weight (fp8: codes, scale and any kept bf16 copy; bitsandbytes 4-bit: the
    packed codes and their quantization state; otherwise the weight as stored), not biases, embeddings or
    unadapted layers. ``ratio`` = stored / bf16. ``fp8_layers`` counts the layers whose base GEMMs run in fp8.
    """
    stored = bf16 = layers = fp8_layers = 0
    seen: set[int] = set()
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not hasattr(module, "lora_A") or not isinstance(base, nn.Linear) or id(base) in seen:
            continue
        seen.add(id(base))
        layers += 1
        numel = base.in_features * base.out_features   # the values W stands for (a 4-bit weight packs two a byte)
        bf16 += 2 * numel
        if _is_bnb4(base):
            fp8_layers += _on_bnb4_fp8(module)
            stored += stored_bytes(base.weight)
        elif isinstance(base, Fp8BaseLinear):
            fp8_layers += 1
            stored += numel * base.weight.element_size() + base.weight_scale_inv.numel() * 4
            if base.weight_bf16 is not None:
                stored += base.weight_bf16.numel() * base.weight_bf16.element_size()
        else:
            stored += numel * base.weight.element_size()
    return {"layers": layers, "fp8_layers": fp8_layers, "stored_bytes": stored, "bf16_bytes": bf16,
            "ratio": stored / bf16 if bf16 else None}
