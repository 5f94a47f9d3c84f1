"""Per-token dynamic rank (issue 5): nested rank dimensions, a router per adapted layer, a budget.

Turned on by ``SitsLoraConfig(use_dynamic_rank=True, ...)``; SitsLoraModel then builds
:class:`DynamicRankLinear` layers. ``reference.py`` is the plain PyTorch path (mask multiply),
the oracle of a bucketed kernel; ``sampler.py`` computes the base model's token entropies and fits
the entropy probes; ``budget.py`` holds the mean active rank at its target; ``callback.py`` runs
the budget inside a transformers Trainer. The evaluation of the method (arms, seeds, plots) is
benchmark code: bench/dynamic_rank_harness.py, behind bench/dynamic_rank_eval.py and
notebooks/dynamic_rank.ipynb. The config checks live in ``sits_lora/_dynamic_rank_checks.py``, so
that config.py does not import this package.
"""

from __future__ import annotations

from .budget import RankBudget, valid_tokens
from .layer import DynamicRankLinear, ProbeNotFittedError, RoutingMergeError
from .reference import (
    BucketGroups,
    dynamic_rank_lora_linear,
    dynamic_rank_lora_linear_grouped,
    dynamic_rank_lora_linear_reference,
    group_tokens_by_bucket,
)
from .truncate import rank_parameter_counts, truncate_rank

# transformers' Trainer machinery and the sampler's datasets / tqdm load on first use, not on `import sits_lora`
_LAZY = {"DynamicRankCallback": ".callback", "TokenEntropySampler": ".sampler"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BucketGroups",
    "DynamicRankCallback",
    "DynamicRankLinear",
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
