"""The dynamic-rank fields of SitsLoraConfig (``DynamicRankFields``) and their checks.

``adapter.py`` calls :func:`check_dynamic_rank_config` from ``__post_init__`` and lists the per-field checks below
in its table of checks (``FIELD_CHECKS``, in sits_lora.utils.validation's style); ``sits_lora.dynamic_rank`` reads
the schedulers, modes and defaults from here. It imports nothing from sits_lora but that module, so the config
loads without the layers, ops and Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math
from typing import Any, Literal, Optional, Sequence

from ..utils import validation

RANK_SCHEDULERS = ("entropy-gated", "learned", "random", "static")
RANK_BUDGET_MODES = ("target", "ceiling", "price")
# rank_budget_step_size=None: the step size of each mode (price moves logits directly, target a gradient term).
# price 6.0: the price lags the routers' growing demand for rank by drift·r/(sensitivity·η), which leaves them
# steadily above the target at a small step; 6.0 cuts that lag threefold against 2.0 while the loop gain
# sensitivity·η/r stays below 1, so the mean settles without swinging (docs/dynamic-rank.md)
DEFAULT_BUDGET_STEP_SIZE = {"price": 6.0, "target": 0.5, "ceiling": 0.5}
ROUTED_SCHEDULERS = ("entropy-gated", "learned")

# A histogram given as fractions may be rounded when it is copied from a log; 1e-3 accepts three
# printed decimals per bucket and still catches a wrong list.
_HISTOGRAM_SUM_TOLERANCE = 1e-3
# rank_histogram and target_mean_rank both given: they must describe the same mean rank, within half
# a rank (a histogram printed to three decimals over buckets up to 64 is off by at most 0.13).
_MEAN_RANK_TOLERANCE = 0.5


def require_buckets(value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        return "it must be a non-empty list of ranks, e.g. rank_buckets=[16, 32, 48, 64]"
    for b in value:
        if not validation.is_int(b) or b < 0:
            return (f"every bucket must be a non-negative integer rank, found {b!r}; e.g. rank_buckets=[16, 32, 48, 64] "
                    f"(a first bucket of 0 lets a token skip the adapter)")
    return None


def require_histogram(value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(validation.is_number(p) and p >= 0 for p in value):
        return "it must be a list of non-negative fractions, one per bucket, e.g. rank_histogram=[0.4, 0.3, 0.2, 0.1]"
    if abs(sum(value) - 1.0) > _HISTOGRAM_SUM_TOLERANCE:
        return f"its fractions sum to {sum(value):.4f}; they must sum to 1"
    return None


# The dynamic-rank fields' checks, for SitsLoraConfig's table (sits_lora.utils.validation).
FIELD_CHECKS: dict[str, validation.Check] = {
    "use_dynamic_rank": validation.boolean,
    "rank_scheduler": validation.choice(RANK_SCHEDULERS),
    "rank_buckets": require_buckets,
    "target_mean_rank": validation.positive_number(" or None, e.g. target_mean_rank=24", allow_none=True),
    "rank_histogram": require_histogram,
    "router_temperature": validation.positive_number(", e.g. router_temperature=1.0"),
    "rank_budget_step_size": validation.positive_number(", e.g. rank_budget_step_size=0.5", allow_none=True),
    "rank_budget_mode": validation.choice(RANK_BUDGET_MODES),
}


def default_buckets(r: int) -> Optional[list[int]]:
    """Buckets in steps of 16 up to r (tensor-core tiles want multiples of 16), or None if r is not one."""
    if r % 16 != 0 or r < 32:
        return None
    return list(range(16, r + 1, 16))


def histogram_mean(histogram: Sequence[float], buckets: Sequence[int]) -> float:
    return float(sum(p * b for p, b in zip(histogram, buckets)) / sum(histogram))


def max_entropy_histogram(buckets: Sequence[int], target: float) -> list[float]:
    """The most spread-out bucket distribution whose mean rank is ``target``: p_k ∝ exp(β·b_k).

    Used as the router's starting histogram and as the random scheduler's default, so that both
    start at the budget. β is found by bisection (the mean is monotone in β).
    """
    b = [float(x) for x in buckets]
    if len(b) == 1 or target <= b[0]:
        return [1.0] + [0.0] * (len(b) - 1)
    if target >= b[-1]:
        return [0.0] * (len(b) - 1) + [1.0]
    scale = b[-1] - b[0]

    def mean(beta: float) -> tuple[float, list[float]]:
        logits = [beta * (x - b[-1]) / scale for x in b]
        top = max(logits)
        w = [math.exp(v - top) for v in logits]
        total = sum(w)
        p = [v / total for v in w]
        return sum(pk * bk for pk, bk in zip(p, b)), p

    lo, hi = -200.0, 200.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        m, _ = mean(mid)
        if m < target:
            lo = mid
        else:
            hi = mid
    return mean(0.5 * (lo + hi))[1]


def _err(field: str, value: Any, problem: str) -> ValueError:
    return ValueError(f"SitsLoraConfig.{field}={value!r} is invalid: {problem}.")


def check_dynamic_rank_config(config) -> None:
    """Cross-field checks; fills ``rank_buckets`` with its default when it is None. Raises ValueError."""
    defaults = {"rank_scheduler": "entropy-gated", "rank_buckets": None, "target_mean_rank": None,
                "rank_histogram": None}
    if not config.use_dynamic_rank:
        for name, default in defaults.items():
            value = getattr(config, name)
            if value != default:
                raise _err(name, value, "it has no effect without use_dynamic_rank=True; set use_dynamic_rank=True "
                                        "or remove it")
        return

    r = config.r
    if config.rank_pattern or config.alpha_pattern:
        name = "rank_pattern" if config.rank_pattern else "alpha_pattern"
        raise _err(name, getattr(config, name), "per-layer ranks and alphas are not supported with "
                   "use_dynamic_rank=True (the buckets are shared by all layers); remove it, or use a static adapter")
    if config.use_dora:
        raise _err("use_dora", True, "DoRA is not supported with use_dynamic_rank=True; set use_dora=False")
    if config.lora_bias:
        raise _err("lora_bias", True, "a bias on lora_B is not supported with use_dynamic_rank=True; set lora_bias=False")

    if config.rank_buckets is None:
        buckets = default_buckets(r)
        if buckets is None:
            raise _err("rank_buckets", None, f"with r={r} (not a multiple of 16 of at least 32) there is no default; "
                       f"give the buckets, e.g. rank_buckets=[{max(1, r // 4)}, {max(1, r // 2)}, {r}]")
        config.rank_buckets = buckets
    buckets = list(config.rank_buckets)
    if any(b2 <= b1 for b1, b2 in zip(buckets, buckets[1:])):
        raise _err("rank_buckets", buckets, "the buckets must be strictly increasing, e.g. [16, 32, 48, 64]; "
                   "sort them and remove duplicates")
    if buckets[-1] > r:
        raise _err("rank_buckets", buckets, f"bucket {buckets[-1]} is above r={r}: a token cannot use more rank "
                   f"dimensions than the adapter has; lower the bucket or raise r to {buckets[-1]}")
    if buckets[-1] != r:
        raise _err("rank_buckets", buckets, f"the last bucket ({buckets[-1]}) must equal r={r}, the adapter's full "
                   f"rank (dimensions above it would never be used); append {r} or lower r to {buckets[-1]}")

    scheduler = config.rank_scheduler
    target = config.target_mean_rank
    histogram = config.rank_histogram
    if target is not None and not buckets[0] <= target <= buckets[-1]:
        raise _err("target_mean_rank", target, f"it must lie within the buckets, between {buckets[0]} and "
                   f"{buckets[-1]} (rank_buckets={buckets})")
    if histogram is not None:
        if scheduler != "random":
            raise _err("rank_histogram", histogram, f"it applies only to rank_scheduler='random', not "
                       f"{scheduler!r}; remove it")
        if len(histogram) != len(buckets):
            raise _err("rank_histogram", histogram, f"it has {len(histogram)} entries but there are "
                       f"{len(buckets)} buckets ({buckets}); give one fraction per bucket")
    if scheduler in ROUTED_SCHEDULERS and target is None:
        raise _err("target_mean_rank", None, f"rank_scheduler={scheduler!r} routes tokens under a budget and needs "
                   f"a target mean rank, e.g. target_mean_rank={buckets[len(buckets) // 2 - 1] if len(buckets) > 1 else buckets[0]}")
    if scheduler == "static" and target is not None:
        raise _err("target_mean_rank", target, "rank_scheduler='static' does not route (every token uses the full "
                   "rank at inference); remove target_mean_rank, or truncate the trained adapter with "
                   "sits_lora.truncate_rank(model, k)")
    if scheduler == "random":
        if histogram is None and target is None:
            raise _err("target_mean_rank", None, "rank_scheduler='random' needs target_mean_rank or rank_histogram "
                       "(the fraction of tokens per bucket)")
        if histogram is not None and target is not None:
            mean = histogram_mean(histogram, buckets)
            if abs(mean - target) > _MEAN_RANK_TOLERANCE:
                raise _err("target_mean_rank", target, f"rank_histogram={list(histogram)} has mean rank {mean:.2f}, "
                           f"not {target}; remove one of the two or make them agree")


@dataclass
class DynamicRankFields:
    """SitsLoraConfig's dynamic-rank fields, with their help (saved flat in adapter_config.json with the others)."""

    use_dynamic_rank: bool = field(
        default=False,
        metadata={
            "help": (
                "Per-token dynamic rank (sits_lora.dynamic_rank): the rank dimensions are trained nested "
                "(the first k of them form a working adapter of rank k) and each token uses the first "
                "b dimensions, b from rank_buckets, chosen by rank_scheduler under the target_mean_rank "
                "budget. Adapted layers must be torch.nn.Linear; not with rank_pattern, alpha_pattern, "
                "use_dora or lora_bias. merge_and_unload needs a static adapter first "
                "(sits_lora.truncate_rank(model, k))."
            ),
            # PEFT resolves LoRA variants from fields tagged so: SitsLoraLinear.lora_variants maps this one to
            # sits_lora.dynamic_rank.variant.DynamicRankVariant
            "is_lora_variant": True,
        },
    )
    rank_scheduler: Literal["entropy-gated", "learned", "random", "static"] = field(
        default="entropy-gated",
        metadata={
            "help": (
                "How each token's bucket is chosen (with use_dynamic_rank=True). 'entropy-gated': a router "
                "per adapted layer reads the token's hidden state and the entropy predicted by a probe fitted "
                "with TokenEntropySampler. 'learned': the same router without the entropy feature. 'random': "
                "buckets drawn at random with rank_histogram (or the most spread-out histogram of mean "
                "target_mean_rank). 'static': no routing, every token uses the full rank r at inference; "
                "training draws one bucket per sequence, the same in every layer of the forward, so the "
                "adapter can be truncated to any bucket (sits_lora.dynamic_rank.nested)."
            )
        },
    )
    rank_buckets: Optional[list] = field(
        default=None,
        metadata={
            "help": (
                "The ranks a token may use, strictly increasing, the last equal to r, e.g. [16, 32, 48, 64]; "
                "a first bucket of 0 lets a token skip the adapter. Multiples of 16 suit tensor-core kernels. "
                "None: steps of 16 up to r (r a multiple of 16)."
            )
        },
    )
    target_mean_rank: Optional[float] = field(
        default=None,
        metadata={
            "help": (
                "The mean active rank over non-padding tokens that the budget holds ('entropy-gated', "
                "'learned': a Lagrange multiplier updated by dual ascent; 'random': the histogram's mean). "
                "Must lie between the smallest and the largest bucket."
            )
        },
    )
    rank_histogram: Optional[list] = field(
        default=None,
        metadata={
            "help": (
                "rank_scheduler='random' only: the fraction of tokens per bucket (one per bucket, summing to "
                "1), e.g. the histogram a learned router reached, to test routing against chance."
            )
        },
    )
    router_temperature: float = field(
        default=1.0,
        metadata={
            "help": (
                "Gumbel-softmax temperature of the router in training: the forward pass uses the hard "
                "bucket, the gradient flows through the softmax at this temperature (straight-through)."
            )
        },
    )
    rank_budget_step_size: Optional[float] = field(
        default=None,
        metadata={
            "help": (
                "Dual-ascent step size η of the rank budget: after each optimizer step "
                "λ ← λ + η·(mean active rank − target_mean_rank) / r (clamped at 0 with rank_budget_mode='ceiling')."
                " None: 6.0 with rank_budget_mode='price' (λ moves the routers' logits directly), 0.5 otherwise."
            )
        },
    )
    rank_budget_mode: Literal["target", "ceiling", "price"] = field(
        default="price",
        metadata={
            "help": (
                "'price' (default): λ is a price on rank in the routing decision itself: each step shifts every "
                "router's bucket biases by -Δλ·b_k/r (no budget term in the gradient), so the decisions follow "
                "at once; the biases save with the adapter, so inference routes with the final price. "
                "'target': λ reaches the routers through their gradient and holds the mean from both sides "
                "(λ may turn negative); it lags, so the mean swings around the target (docs/dynamic-rank.md). "
                "'ceiling': as 'target' with λ ≥ 0, so target_mean_rank is only an upper bound."
            )
        },
    )
