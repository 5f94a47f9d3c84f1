"""SitsLoraLinear: PEFT's LoRA ``Linear`` whose common path runs through sits_lora.ops.

Parameter names, merge / unmerge, ``get_delta_weight``, mixed-batch ``adapter_names``, several
adapters, DoRA and the other LoRA variants are PEFT's, inherited unchanged. A call is planned first
(``sits_lora.layers.forward_plan.plan_forward``: which path, which kernel) and then executed: the plain
training and inference path (one active vanilla adapter over the frozen base's module) is one call to
the frozen base's fused path (``sits_lora.bases``), which computes the base GEMM and the LoRA branch
together; every case the plan does not claim falls through to PEFT's own forward, so behaviour stays PEFT's.

A feature that changes what an adapter computes is a LoRA variant of this layer (PEFT's ``LoraVariant``,
as DoRA is): a :class:`SitsLoraVariant`, registered for the config field that turns it on. Per-token
dynamic rank is one (``sits_lora.dynamic_rank.variant``): while its adapter routes, the variant computes
the layer's whole output (base + routed LoRA) through its op; otherwise the adapter is plain LoRA and
takes the paths above. A layer without such an adapter pays nothing for it: its fused path checks one
dict, as before.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraVariant
from torch import nn

from ..bases import BF16_BASE
from ..serving.mixed_batch import mixed_batch_forward
from ..utils.cast_copies import drop_cast_copies
from .forward_plan import ForwardPlan, plan_forward

logger = logging.getLogger("sits_lora")


class SitsLoraVariant(LoraVariant):
    """A LoRA variant that a sits_lora feature adds to SitsLoraLinear (static methods, as PEFT's variants).

    Besides PEFT's ``init`` / ``merge_safe`` / ``merge_unsafe`` / ``unmerge`` / ``forward`` (which PEFT's
    own forward, mixed batches and merges call), it answers the layer: whether its adapter is plain LoRA
    now (the fused path may run it), which adapter a call routes (the variant then computes the whole
    output), whether a merge is allowed, and what to drop or move with the layer. The defaults: never
    plain, never routes, merges.
    """

    @staticmethod
    def runs_plain(module: nn.Module, adapter_name: str) -> bool:
        return False

    @staticmethod
    def routes(module: nn.Module, adapter_name: str) -> bool:
        return False

    @staticmethod
    def routed_adapter(module: nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
        """The adapter of ``module`` whose variant computes this call's whole output, or None (the layer's
        other paths run); raise for a call the variant cannot run."""
        return None

    @staticmethod
    def forward_routed(module: nn.Module, adapter_name: str, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def check_merge(module: nn.Module, adapter_name: str) -> None:
        """Raise if the adapter cannot be merged now (before anything of the call merges)."""

    @staticmethod
    def forget(module: nn.Module, adapter_name: str) -> None:
        """After PEFT's delete_adapter: drop the adapter's state PEFT does not know."""

    @staticmethod
    def follow_layer(module: nn.Module, adapter_name: str) -> None:
        """After the layer's ``_apply`` (``.to()``, ``.half()``, ``to_empty()``): move state that is not a
        parameter or buffer."""


class FusedAdapterChoice:
    """Which adapter a sits_lora layer's frozen base runs on its fused path: what SitsLoraLinear (a dense or
    quantized-by-sits_lora base) and SitsLoraLinear4bit (a bitsandbytes 4-bit base) share. The layer sets
    ``frozen_base`` (sits_lora.bases) and ``sits_kernel`` (the adapters' SitsLoraConfig.kernel)."""

    frozen_base = BF16_BASE
    # Set by sits_lora.activations where the frozen model keeps what this layer's input is made from: the
    # ops then save a rebuild of the input instead of the input (SitsLoraConfig.recompute_lora_inputs).
    input_recompute = None
    # Set by SitsLoraModel for layers that read the same input as others (sits_lora.layers.siblings).
    sibling_group = None

    def _sits_variant(self, adapter_name: str) -> Optional[SitsLoraVariant]:
        variant = self.lora_variant.get(adapter_name)
        return variant if isinstance(variant, SitsLoraVariant) else None

    def _runs_plain(self, adapter_name: str) -> bool:
        variant = self._sits_variant(adapter_name)
        return variant is not None and variant.runs_plain(self, adapter_name)

    def routed_adapter(self, args: tuple, kwargs: dict) -> Optional[str]:
        """The adapter whose variant computes this call's whole output (per-token dynamic rank), or None; raises for
        a call the variant cannot run. The layer's rule is its feature variant's (one kind per layer); PEFT's
        variants do not route."""
        for variant in self.lora_variant.values():
            if isinstance(variant, SitsLoraVariant):
                return variant.routed_adapter(self, args, kwargs)
        return None

    def fused_adapter(self, args: tuple, kwargs: dict) -> str | None:
        """The single active adapter the frozen base's fused path can run, or None to use another path."""
        if self.disable_adapters or self.merged or args:
            return None
        if kwargs and any(v is not None for v in kwargs.values()):  # adapter_names and the like
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1:
            return None
        adapter = active[0]
        base = self.base_layer
        if (
            # a variant's adapter, unless it is plain LoRA now (a dynamic-rank adapter that does not route)
            (adapter in self.lora_variant and not self._runs_plain(adapter))
            or self.lora_bias[adapter]
            or self.fan_in_fan_out
            or type(base) is not self.frozen_base.module_type
            or base._forward_hooks
            or base._forward_pre_hooks
        ):
            return None
        return adapter


class SitsLoraLinear(FusedAdapterChoice, LoraLinear):
    # Per-adapter state that PEFT's delete_adapter / set_adapter must carry along (a variant adds its own to
    # the instance, as PEFT's DoRA does).
    other_param_names = LoraLinear.other_param_names + ("sits_kernel",)
    # The frozen base's fused path (sits_lora.bases): plain nn.Linear unless a feature quantizes the base
    # (sits_lora.fp8 sets an Fp8Base, sits_lora.int4 the INT4 base). A plain object, not a submodule: it holds no
    # parameters.
    frozen_base = BF16_BASE
    # The features' LoRA variants, keyed as PEFT's lora_variants (a tuple of config fields tagged
    # is_lora_variant); SitsLoraModel registers one when an adapter first asks for it.
    feature_variants: dict[tuple, type] = {}

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        self.sits_kernel: dict[str, str] = {}
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)

    @classmethod
    def register_variant(cls, config_field: str, variant: type) -> None:
        """Resolve ``variant`` for adapters whose config sets ``config_field``, as PEFT resolves use_dora."""
        cls.feature_variants[(config_field,)] = variant

    @property
    def lora_variants(self):
        return {**super().lora_variants, **self.feature_variants}

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        smaller = min(self.in_features, self.out_features)
        if r > smaller:
            # PEFT accepts such adapters (a 2-way classifier head at r=8; add_weighted_adapter's "cat" sums
            # ranks), so a drop-in must too: it works, it only holds more parameters than the update can use.
            # A log line, not a warning: a drop-in for LoraConfig raises the warnings PEFT raises and no others
            # (test suites check the last warning, or turn warnings into errors)
            target_name = kwargs.get("target_name") or "<this layer>"
            logger.warning(
                "sits_lora: adapter %r: r=%d is larger than the smaller dimension (%d) of layer '%s' "
                "(in_features=%d, out_features=%d); the update has rank at most %d there. It trains as in PEFT; "
                "rank_pattern={'%s': %d} would hold the same update in fewer parameters.",
                adapter_name, r, smaller, target_name, self.in_features, self.out_features, smaller,
                target_name.rsplit(".", 1)[-1], smaller,
            )
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        self.sits_kernel[adapter_name] = getattr(config, "kernel", "auto")

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plan = plan_forward(self, x, args, kwargs)
        # the saved-tensor hooks that save a rebuild of x instead of x, or None (nothing upstream to rebuild from)
        hooks = self.input_recompute.saving(x) if plan.rebuild_input else None
        if hooks is None:
            return self._run(plan, x, args, kwargs)
        with hooks:
            return self._run(plan, x, args, kwargs)

    def _run(self, plan: ForwardPlan, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """Execute the plan (sits_lora.layers.forward_plan); every choice was made there."""
        if plan.path == "fused":
            return self.frozen_base.fused_forward(self, plan, x)
        if plan.path == "routed":
            # the variant computes base + routed LoRA itself (layer → variant → ops)
            return self.lora_variant[plan.adapter].forward_routed(self, plan.adapter, x)
        if plan.path == "mixed_batch":
            self._check_forward_args(x, **kwargs)   # PEFT's refusals (a merged adapter, a wrong count of names)
            out = mixed_batch_forward(self, x, kwargs["adapter_names"])
            if out is not None:   # every named adapter plain LoRA on the kernels: one segmented pass for the batch
                return out
        # PEFT's own forward (an fp8 base module then runs its fp8 GEMM with current scaling)
        return super().forward(x, *args, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        for name in adapter_names if adapter_names is not None else self.active_adapters:
            if (variant := self._sits_variant(name)) is not None:
                variant.check_merge(self, name)  # e.g. a routed adapter: RoutingMergeError
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def delete_adapter(self, adapter_name: str) -> None:
        variant = self._sits_variant(adapter_name)
        super().delete_adapter(adapter_name)
        drop_cast_copies(self, adapter_name)
        if variant is not None:
            variant.forget(self, adapter_name)

    def _apply(self, fn, recurse: bool = True):
        result = super()._apply(fn, recurse)
        drop_cast_copies(self)   # the decode path's copies of moved or cast adapters are made again when next asked
        for name, variant in self.lora_variant.items():
            if isinstance(variant, SitsLoraVariant):
                variant.follow_layer(self, name)
        return result

    # ------------------------------------------------------------------ dynamic rank's calls
    # A dynamic-rank adapter's variant (sits_lora.dynamic_rank.variant.DynamicRankVariant) answers them.

    def routing_on(self, adapter_name: str) -> bool:
        """True while forward applies a per-token rank mask for this adapter (it routes, or trains nested)."""
        variant = self._sits_variant(adapter_name)
        return variant is not None and variant.routes(self, adapter_name)

    def choose_buckets(self, adapter_name: str, x: torch.Tensor):
        """(used (T,), bucket_weights (T, K) or None, decided (T,)) bucket ids for the tokens of x (..., d_in)."""
        return self.lora_variant[adapter_name].choose_buckets(self, adapter_name, x)

    def probe_entropy(self, adapter_name: str, x: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        """The entropy probe's standardized prediction (T,) for the raw input x (T, d_in), 1/rms(x) (T,)."""
        return self.lora_variant[adapter_name].probe_entropy(self, adapter_name, x, inv_rms)

    def rank_counts(self, adapter_name: str, reset: bool = True) -> torch.Tensor:
        """(2, K) int64: per bucket, the valid tokens the routing rule sent there and those computed with."""
        return self.lora_variant[adapter_name].rank_counts(self, adapter_name, reset)

    def truncate_adapter(self, adapter_name: str, k: int) -> None:
        """Keep the first k rank dimensions as a static rank-k adapter with the same scaling (plain LoRA)."""
        self.lora_variant[adapter_name].truncate(self, adapter_name, k)

    def __repr__(self) -> str:
        routed = {a: s.scheduler for a, s in getattr(self, "rank_spec", {}).items() if s is not None}
        return "sits_lora." + super().__repr__().removeprefix("lora.") + (
            f"  # dynamic rank: {routed}" if routed else "")
