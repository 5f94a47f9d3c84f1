"""SitsLoraModel: the PEFT tuner that injects SitsLoraLinear layers."""

from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch
from peft.tuners.lora import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .activations import attach_input_recompute, detach_input_recompute
from .config.peft_type import sits_lora_peft_type
from .layers.linear import FusedAdapterChoice, SitsLoraLinear
from .layers.siblings import assign_sibling_groups

logger = logging.getLogger("sits_lora")


def _module_names_matching(model: nn.Module, target: str) -> list[str]:
    # PEFT's rule for a list of target names: the module key equals the name or ends with ".name".
    return [key for key, _ in model.named_modules() if key == target or key.endswith("." + target)]


def _linear_leaf_names(model: nn.Module) -> list[str]:
    """Last names of the model's own linear / embedding / convolution modules (not the parts of LoRA layers)."""
    names: dict[str, None] = {}
    inside_tuner_layers: list[str] = []
    for key, module in model.named_modules():
        if any(key.startswith(prefix) for prefix in inside_tuner_layers):
            continue  # base_layer, lora_A.default, ...: a LoRA layer's parts, not names to target
        if isinstance(module, BaseTunerLayer):
            inside_tuner_layers.append(key + ".")
            module = module.get_base_layer()
        if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)) and key:
            names.setdefault(key.rsplit(".", 1)[-1], None)
    return list(names)


def _names_hint(model: nn.Module) -> str:
    existing = _linear_leaf_names(model)
    shown = ", ".join(repr(n) for n in existing[:12]) + (", ..." if len(existing) > 12 else "")
    return (f"Module names that exist in {type(model).__name__}: {shown}. Use some of these, or "
            f"target_modules='all-linear'.")


def unmatched_target_modules(model: nn.Module, config) -> list[str]:
    """The entries of a list-valued target_modules that match no module of the model (a regex or 'all-linear':
    none, PEFT resolves those)."""
    targets = config.target_modules
    if targets is None or isinstance(targets, str):
        return []
    return [t for t in sorted(targets) if not _module_names_matching(model, t)]


# the messages of PEFT's errors for an adapter that targets nothing (NoMatchingPeftModuleError, a ValueError)
_NOTHING_TARGETED = ("not found in the base model", "No modules were targeted", "All modules were excluded",
                     "No `target_modules` passed")


def _fp8_layer(tuner):
    """sits_lora.fp8.model when an adapter of this model uses fp8, else None (it loads Triton: first use only)."""
    if all(getattr(c, "fp8", "off") == "off" for c in tuner.peft_config.values()):
        return None
    from .fp8 import model as fp8_model

    return fp8_model


def _int4_layer(tuner):
    """sits_lora.int4.model when an adapter of this model has an INT4 base, else None (first use only)."""
    if all(getattr(c, "base_quant", "off") == "off" for c in tuner.peft_config.values()):
        return None
    from .int4 import model as int4_model

    return int4_model


def _is_bnb_linear4bit(module: nn.Module) -> bool:
    """A bitsandbytes ``Linear4bit`` (found by name: importing bitsandbytes to ask costs seconds)."""
    cls = type(module)
    return cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")


def _register_dynamic_rank(config) -> None:
    """Make SitsLoraLinear resolve use_dynamic_rank to its variant (it loads the routers: first use only)."""
    if getattr(config, "use_dynamic_rank", False) and ("use_dynamic_rank",) not in SitsLoraLinear.feature_variants:
        from .dynamic_rank.variant import DynamicRankVariant

        SitsLoraLinear.register_variant("use_dynamic_rank", DynamicRankVariant)


def _allow_hotswap() -> None:
    """Hotswapping (``peft.utils.hotswap``, diffusers' ``load_lora_weights(..., hotswap=True)``) copies a new
    adapter's weights into a loaded one of the same peft type, after checking the config fields it lists for that
    type. A SITS_LORA adapter is a LoRA adapter: LoRA's fields, and whether it routes ranks per token. Added when
    the first sits_lora adapter is made, not on import: PEFT stays as it was for programs that never use one."""
    from peft.utils import hotswap
    from peft.utils.peft_types import PeftType

    checked = getattr(hotswap, "CONFIG_KEYS_TO_CHECK", None)
    if isinstance(checked, dict) and PeftType.LORA in checked:
        checked.setdefault(sits_lora_peft_type(), [*checked[PeftType.LORA], "use_dynamic_rank"])


# PeftMixedModel builds PEFT's own LoRA layers from any LoraConfig: the fields that need sits_lora's layers, with the
# value each must keep there
_PLAIN_LORA_VALUES = {"use_dynamic_rank": (False,), "fp8": ("off",), "base_quant": ("off",),
                      "kernel": ("auto", "torch")}


def _mixed_model_problems(config) -> list[str]:
    """Why a SitsLoraConfig cannot go into a PeftMixedModel: the fields set to what only sits_lora's layers run."""
    return [f"{name}={getattr(config, name)!r} (needs {' or '.join(repr(v) for v in allowed)})"
            for name, allowed in _PLAIN_LORA_VALUES.items() if getattr(config, name, allowed[0]) not in allowed]


def allow_mixed_models() -> None:
    """PeftMixedModel (``get_peft_model(..., mixed=True)``, ``PeftMixedModel.from_pretrained``) mixes adapter types
    (LoRA with LoHa, LoKr, ...) for inference. It makes PEFT's own layer for each config (for a SitsLoraConfig, a
    LoraConfig subclass: PEFT's LoRA layer, no fused path) after checking the peft type against a fixed list. Let
    SITS_LORA through that check when the adapter is plain LoRA, and refuse, naming the fields, one whose features
    PEFT's layer would silently drop. Other types go to PEFT's check unchanged; a PEFT without this check (it is
    private) keeps refusing SITS_LORA with its own message."""
    from peft import mixed_model

    original = getattr(mixed_model, "_check_config_compatible", None)
    if original is None or getattr(original, "sits_lora_wrapped", False):
        return

    def _check_config_compatible(peft_config) -> None:
        if getattr(peft_config, "peft_type", None) != sits_lora_peft_type():
            return original(peft_config)
        problems = _mixed_model_problems(peft_config)
        if problems:
            raise ValueError(
                f"PeftMixedModel (get_peft_model(..., mixed=True)) runs PEFT's own LoRA layers, which do not have "
                f"sits_lora's features; this SitsLoraConfig sets {', '.join(problems)}. Leave those fields at their "
                f"defaults to mix it with other adapter types, or use get_peft_model(model, config) without "
                f"mixed=True (several sits_lora adapters, add_weighted_adapter, adapter_names per row).")
        return None

    _check_config_compatible.sits_lora_wrapped = True
    mixed_model._check_config_compatible = _check_config_compatible


class SitsLoraModel(LoraModel):
    """LoRA tuner whose linear layers are SitsLoraLinear.

    Dispatch, first match wins: a bitsandbytes 4-bit ``Linear4bit`` of a model loaded in 4-bit becomes a
    SitsLoraLinear4bit (PEFT's QLoRA layer with the fused path); a plain ``torch.nn.Linear`` becomes a
    SitsLoraLinear; every other layer type (8-bit bitsandbytes, GPTQ, ... linears, Conv1D, embeddings,
    convolutions) gets PEFT's own LoRA layer for it, so a model with such layers still trains, saves and loads.
    """

    prefix: str = "lora_"

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """Read by DistributedDataParallel on the module it wraps (a PeftModel hands the lookup on to its tuner):
        the frozen fp8 weight codes, and the buffers of modules that keep them per rank (``rank_local_buffers``:
        the fp8 scaling state, whose running amax DDP would otherwise overwrite with rank 0's before every
        forward, losing this rank's earlier micro-batches). DDP broadcasts every parameter from rank 0 when it
        starts: every rank built the same frozen codes (no adapter is among them), and the gloo backend cannot
        send a float8 tensor. Names under both roots, the PeftModel's ("base_model." ...) and this tuner's."""
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        names = [n for n, t in (*self.named_parameters(), *self.named_buffers()) if t is not None and t.dtype in fp8]
        for prefix, module in self.named_modules():
            dot = f"{prefix}." if prefix else ""
            if getattr(module, "rank_local_buffers", False):
                names += [dot + n for n, _ in module.named_buffers()]
            if hasattr(module, "fp8_orig_dtype") and isinstance(module, nn.Linear):   # an Fp8BaseLinear: its codes
                names.append(dot + "weight")
        names = list(dict.fromkeys(names))   # float8 codes are found twice: by their dtype and by their module
        return [f"base_model.{n}" for n in names] + names

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        to_return = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        # PEFT checks the saved LoRA factors' shapes (a ZeRO-3 / FSDP shard saved without gathering is 1-D) for its
        # LORA and ADALORA types only; a SITS_LORA adapter saves the same factors (PEFT's warning, where it has it)
        from peft.utils import save_and_load

        validate = getattr(save_and_load, "_validate_lora_adapter_state_dict", None)
        if validate is not None:
            validate(to_return, adapter_name=adapter_name)
        return to_return

    def inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        # what matches nothing is PEFT's to judge (an error only when nothing at all is targeted; a list naming
        # the projections of several model families is common): its error gets the names to choose from, a
        # partial miss a log line
        _allow_hotswap()
        unmatched = unmatched_target_modules(model, self.peft_config[adapter_name])
        try:
            self._inject_adapter(model, adapter_name, *args, **kwargs)
        except ValueError as error:
            if not any(phrase in str(error) for phrase in _NOTHING_TARGETED):
                raise
            raise type(error)(f"{error} {_names_hint(model)}") from None
        if unmatched:
            logger.warning("sits_lora: adapter %r: target_modules entries %s match no module; the others were "
                           "adapted, as PEFT does. %s", adapter_name, ", ".join(repr(t) for t in unmatched),
                           _names_hint(model))

    def _inject_adapter(self, model: nn.Module, adapter_name: str, *args, **kwargs) -> None:
        _register_dynamic_rank(self.peft_config[adapter_name])  # before the layers resolve their variants
        fp8, int4 = _fp8_layer(self), _int4_layer(self)
        if fp8 is not None:
            fp8.check_before_injection(self, model, adapter_name)
        if int4 is not None:
            int4.check_before_injection(self, model, adapter_name)
        super().inject_adapter(model, adapter_name, *args, **kwargs)
        _note_peft_layers(model, adapter_name)
        self._attach_layer_strategies(model, adapter_name, fp8, int4)

    def _attach_layer_strategies(self, model: nn.Module, adapter_name: str, fp8, int4) -> None:
        """The one pass, after PEFT built the layers, that sets what each layer's forward plan reads
        (sits_lora.layers.forward_plan): its frozen base (fp8 / INT4 quantize the base modules and set
        ``layer.frozen_base``), its sibling group (``layer.sibling_group``), its input rebuild
        (``layer.input_recompute``), and a nested dynamic-rank adapter's shared bucket draw."""
        if fp8 is not None:
            fp8.quantize_base_layers(self, adapter_name, SitsLoraLinear)
        if int4 is not None:
            int4.quantize_base_layers(self, adapter_name, SitsLoraLinear)
        fuse = all(getattr(c, "fuse_siblings", True) for c in self.peft_config.values())
        assign_sibling_groups(model, SitsLoraLinear, enabled=fuse)
        if all(getattr(c, "recompute_lora_inputs", True) for c in self.peft_config.values()):
            attach_input_recompute(model, FusedAdapterChoice)  # SitsLoraLinear and the QLoRA SitsLoraLinear4bit
        else:
            detach_input_recompute(model)
        config = self.peft_config[adapter_name]
        if getattr(config, "use_dynamic_rank", False) and config.rank_scheduler == "static":
            from .dynamic_rank.nested import attach_forward_draw

            attach_forward_draw(model)  # a nested adapter's layers share one bucket draw per token and forward

    def truncate_rank(self, k: int, adapter_name: Optional[str] = None) -> None:
        """Truncate the dynamic-rank adapter in place to a static rank-k adapter (sits_lora.truncate_rank)."""
        from .dynamic_rank.truncate import truncate_rank

        truncate_rank(self, k, adapter_name)

    # A quantized base (fp8, INT4) goes back to a dense nn.Linear before a merge or an unload: merged weights
    # are dense (see sits_lora.fp8.model.restore_bf16_base_layers for their precision).
    def _restore_dense_bases(self) -> None:
        if (fp8 := _fp8_layer(self)) is not None:
            fp8.restore_bf16_base_layers(self, SitsLoraLinear)
        if (int4 := _int4_layer(self)) is not None:
            int4.restore_dense_base_layers(self, SitsLoraLinear)

    def merge_adapter(self, *args, **kwargs) -> None:
        if _int4_layer(self) is not None:
            logger.warning("sits_lora: merge_adapter on an INT4 base gives the adapted layers back dense "
                           "(dequantized weights, about 4x the bytes) for good; unmerge_adapter does not quantize "
                           "them again. merge_and_unload exports a merged model; to generate, keep the adapter "
                           "unmerged.")
        self._restore_dense_bases()
        super().merge_adapter(*args, **kwargs)

    def _unload_and_optionally_merge(self, *args, **kwargs):
        detach_input_recompute(self.model)
        self._restore_dense_bases()
        return super()._unload_and_optionally_merge(*args, **kwargs)

    def _create_and_replace(self, lora_config, adapter_name, target, target_name, parent, current_key=None,
                            **kwargs):
        # dynamic rank is a variant of SitsLoraLinear (sits_lora.dynamic_rank.variant), which adapts nn.Linear:
        # refused for any other target, new or already adapted
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if getattr(lora_config, "use_dynamic_rank", False) and (
                type(base) is not nn.Linear or kwargs.get("parameter_name") is not None):
            raise ValueError(
                f"SitsLoraConfig.use_dynamic_rank=True supports torch.nn.Linear layers only; target "
                f"{current_key or type(base).__name__!r} is a {type(base).__module__}.{type(base).__qualname__}. "
                f"Remove it from target_modules, or adapt it with a second, static adapter."
            )
        super()._create_and_replace(lora_config, adapter_name, target, target_name, parent, current_key, **kwargs)

    @staticmethod
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        custom_layers = getattr(lora_config, "_custom_modules", None) or {}
        if any(isinstance(base, layer_type) for layer_type in custom_layers):
            # a layer class the user registered for this type (LoraConfig._register_custom_module) wins, as in PEFT
            return LoraModel._create_new_module(lora_config, adapter_name, target, **kwargs)
        if kwargs.get("loaded_in_4bit") and _is_bnb_linear4bit(base) and kwargs.get("parameter_name") is None:
            from .layers.linear_4bit import SitsLoraLinear4bit  # imports bitsandbytes: only for a model loaded in 4-bit

            return SitsLoraLinear4bit(target, adapter_name, config=lora_config, **kwargs)
        if type(base) is nn.Linear and kwargs.get("parameter_name") is None:
            if lora_config.fan_in_fan_out:
                # PEFT's own words: a drop-in raises the warnings LoraConfig raises
                warnings.warn("fan_in_fan_out is set to True but the target module is `torch.nn.Linear`. Setting "
                              "fan_in_fan_out to False.")
                lora_config.fan_in_fan_out = False
            return SitsLoraLinear(target, adapter_name, config=lora_config, **kwargs)
        return LoraModel._create_new_module(lora_config, adapter_name, target, **kwargs)


def _note_peft_layers(model: nn.Module, adapter_name: str) -> None:
    """One line per base layer type whose targets got PEFT's own LoRA layer (no fused path): Conv2d, Embedding,
    Conv1D, 8-bit layers, ..., naming one target of each."""
    first: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedAdapterChoice) or not isinstance(module, BaseTunerLayer):
            continue
        if adapter_name in getattr(module, "lora_A", {}) or adapter_name in getattr(module, "lora_embedding_A", {}):
            first.setdefault(type(module.get_base_layer()).__name__, name)
    for kind, name in first.items():
        logger.warning("sits_lora: adapter %r: %s targets (such as %r) use PEFT's own LoRA layer, without the fused "
                       "path", adapter_name, kind, name)

