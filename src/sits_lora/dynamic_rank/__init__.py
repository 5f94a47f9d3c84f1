"""Per-token dynamic rank: nested rank dimensions, a router per adapted layer, a budget.

Turned on by ``SitsLoraConfig(use_dynamic_rank=True, ...)``, a LoRA variant of SitsLoraLinear:
``variant.py`` (:class:`~sits_lora.dynamic_rank.variant.DynamicRankVariant`) holds the per-adapter state
and the routed forward. The op itself (the fused kernels, the PyTorch path and its oracle) is
in ``sits_lora.ops.dynamic_rank`` and ``sits_lora.ops.reference``; ``sampler.py`` computes the base model's token entropies and fits
the entropy probes; ``budget.py`` holds the mean active rank at its target; ``callback.py`` runs
the budget inside a transformers Trainer. The evaluation of the method (arms, seeds, plots) is
benchmark code: bench/dynamic_rank_harness.py, behind bench/dynamic_rank_eval.py and
notebooks/dynamic_rank.ipynb. Its config fields are checked in
:mod:`sits_lora.config.dynamic_rank`.
"""

from __future__ import annotations

from ..utils.lazy import lazy_exports

# Loaded on first use: the variant loads the routers and the ops; transformers' Trainer machinery (the callback) and the
# sampler's datasets / tqdm load only when asked for.
_EXPORTS = {
    "RankBudget": ".budget",
    "valid_tokens": ".scope",
    "DynamicRankLinear": ".variant",  # deprecated name: SitsLoraLinear serves dynamic-rank adapters
    "DynamicRankVariant": ".variant",
    "ProbeNotFittedError": ".variant",
    "RoutingMergeError": ".variant",
    "BucketGroups": "sits_lora.ops.dynamic_rank",
    "dynamic_rank_lora_linear": "sits_lora.ops.dynamic_rank",
    "dynamic_rank_lora_linear_grouped": "sits_lora.ops.dynamic_rank",
    "dynamic_rank_lora_linear_reference": "sits_lora.ops.reference",
    "group_tokens_by_bucket": "sits_lora.ops.dynamic_rank",
    "rank_parameter_counts": ".truncate",
    "truncate_rank": ".truncate",
    "DynamicRankCallback": ".callback",
    "TokenEntropySampler": ".sampler",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "BucketGroups",
    "DynamicRankCallback",
    "DynamicRankVariant",
    "ProbeNotFittedError",
    "RankBudget",
    "RoutingMergeError",
    "TokenEntropySampler",
    "dynamic_rank_lora_linear",
    "dynamic_rank_lora_linear_grouped",
    "dynamic_rank_lora_linear_reference",
    "group_tokens_by_bucket",
    "rank_parameter_counts",
    "truncate_rank",
    "valid_tokens",
]
