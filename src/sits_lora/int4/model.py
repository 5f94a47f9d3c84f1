"""The INT4 frozen base across a sits_lora model: check and quantize at injection, restore, memory.

``quantize_base_layers`` (called by SitsLoraModel after each injection) swaps the ``nn.Linear`` base of the
adapted SitsLoraLinear layers for an :class:`Int4BaseLinear` and sets each layer's ``frozen_base`` to
:data:`INT4_BASE`. ``restore_dense_base_layers`` undoes the swap before a merge or an unload (the merged
weights are dense: W dequantized plus the LoRA update).
"""

from __future__ import annotations

from torch import nn

from ..layers.base_checks import adapter_targets, check_adapters_agree, check_linear_targets, injected_layers
from ..bases import BF16_BASE
from ..bases.int4 import INT4_BASE, Int4BaseLinear
from ..ops.dequant_linear import release_shared_buffers
from ..ops.int4_linear import check_group_size
from ..utils.model_structure import stored_bytes
from ..config.int4 import SHARED_FIELDS


def _check_targets(config, adapter_name: str, targets: list) -> None:
    """targets: (name, base module) pairs; each must be an nn.Linear whose in_features the group size divides."""
    check_linear_targets(f"base_quant={config.base_quant!r}", adapter_name, targets, Int4BaseLinear)
    odd = [f"{key} (in_features={m.in_features})" for key, m in targets
           if check_group_size(m.in_features, config.int4_group_size) is not None]
    if odd:
        raise ValueError(
            f"SitsLoraConfig.int4_group_size={config.int4_group_size} does not divide the input features of "
            f"{', '.join(odd[:6])}{' ...' if len(odd) > 6 else ''} (adapter {adapter_name!r}). Use a group size "
            f"that divides them (a power of two of at least 32, e.g. int4_group_size=32), or add these layers to "
            f"exclude_modules.")


def check_before_injection(tuner, model: nn.Module, adapter_name: str) -> None:
    """Refuse a 4-bit setting that cannot work before PEFT touches the model (nothing lost on bad input)."""
    config = tuner.peft_config[adapter_name]
    check_adapters_agree(tuner, adapter_name, SHARED_FIELDS, "4-bit base",
                         "Give both the same base_quant and int4_group_size")
    if config.base_quant == "off":
        return
    _check_targets(config, adapter_name, adapter_targets(config, model))


def quantize_base_layers(tuner, adapter_name: str, layer_cls) -> int:
    """After injecting ``adapter_name``: quantize the bases of its adapted layers to INT4; return how many."""
    config = tuner.peft_config[adapter_name]
    if config.base_quant == "off":
        return 0
    layers = injected_layers(tuner, adapter_name, layer_cls, f"base_quant={config.base_quant!r}", "the INT4 base")
    quantized = 0
    for _, layer in layers:
        if type(layer.base_layer) is nn.Linear:
            layer.base_layer = Int4BaseLinear.from_linear(layer.base_layer, config.int4_group_size)
            quantized += 1
        layer.frozen_base = INT4_BASE
    return quantized


def restore_dense_base_layers(tuner, layer_cls) -> int:
    """Give every INT4 base back as a dense ``nn.Linear`` holding the dequantized weight; return how many."""
    restored = 0
    for _, layer in tuner.model.named_modules():
        if isinstance(layer, layer_cls) and isinstance(layer.base_layer, Int4BaseLinear):
            layer.base_layer = layer.base_layer.to_linear()
            layer.frozen_base = BF16_BASE
            restored += 1
    if restored and not any(isinstance(m, Int4BaseLinear) for m in tuner.model.modules()):
        release_shared_buffers()  # the dequantization buffer of the largest layer: nothing reads it any more
    return restored


def int4_weight_memory(model: nn.Module) -> dict:
    """Bytes of the adapted layers' frozen weights as stored now and as bf16 would store them.

    ``stored_bytes`` counts an INT4 base's codes, scales and mins, a bitsandbytes 4-bit base's codes and its
    quantization state (absmax, nested absmax and code tables), any other base's weight as stored; ``ratio`` =
    stored / bf16 (0.27 at group size 128 with bf16 scales, 0.26 for NF4 with double quantization)."""
    stored = bf16 = layers = int4_layers = 0
    seen: set[int] = set()
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not hasattr(module, "lora_A") or not isinstance(base, nn.Linear) or id(base) in seen:
            continue
        seen.add(id(base))
        layers += 1
        bf16 += 2 * base.in_features * base.out_features
        if isinstance(base, Int4BaseLinear):
            int4_layers += 1
            stored += base.packed_bytes()
        else:
            stored += stored_bytes(base.weight)
    return {"layers": layers, "int4_layers": int4_layers, "stored_bytes": stored, "bf16_bytes": bf16,
            "ratio": stored / bf16 if bf16 else None}


def largest_group_size(model: nn.Module, target_modules, choices=(128, 64, 32)) -> int:
    """The largest group size of ``choices`` that divides the in_features of every nn.Linear that
    ``target_modules`` (a list of names, PEFT's rule: the module name or its last parts) matches in ``model``."""
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    widths = sorted({m.in_features for key, m in model.named_modules() if isinstance(m, nn.Linear) and key and any(
        key == t or key.endswith("." + t) for t in targets)})
    if not widths:
        raise ValueError(f"target_modules={targets} match no torch.nn.Linear of {type(model).__name__}: nothing to "
                         f"quantize to INT4")
    for group in choices:
        if all(w % group == 0 for w in widths):
            return group
    odd = sorted({key.rsplit(".", 1)[-1] for key, m in model.named_modules() if isinstance(m, nn.Linear) and key
                  and any(key == t or key.endswith("." + t) for t in targets) and m.in_features % choices[-1]})
    raise ValueError(f"no INT4 group size of {', '.join(map(str, choices))} divides every adapted layer's in_features "
                     f"({', '.join(map(str, widths))}; {', '.join(odd)} do not fit {choices[-1]}); leave those out of "
                     f"target_modules, or base_quant off")
