"""DynamicRankVariant: per-token dynamic rank as a LoRA variant of SitsLoraLinear (PEFT's ``LoraVariant``).

A config with ``use_dynamic_rank=True`` (a field tagged ``is_lora_variant``) resolves, through
``SitsLoraLinear.lora_variants`` (SitsLoraModel registers the variant there when an adapter first asks
for it), to this variant for its adapter, as ``use_dora`` resolves to PEFT's DoRA variant: there is one
layer class, and the variant holds everything dynamic rank adds to it.
``init`` puts its per-adapter state on the layer: a :class:`RankSpec` (``rank_spec``), the budget's λ
(``rank_lambda``), the rank statistics, a router (``lora_router``, trainable, for 'entropy-gated' /
'learned') and an entropy probe (``lora_entropy_probe``, frozen, fitted by TokenEntropySampler, for
'entropy-gated'). Router and probe are children of the layer, so PEFT saves and loads them with
lora_A / lora_B.

Routing is on while an adapter routes ('entropy-gated', 'learned', 'random') or trains nested
('static' in training mode). Then the layer hands the call to :meth:`DynamicRankVariant.forward_routed`,
which computes base + s·((x_lora Aᵀ) ⊙ mask) Bᵀ with the per-token mask of ``ops/reference.py`` in one
op (``sits_lora.ops.dynamic_rank``). Otherwise the adapter is plain LoRA: the layer's fused path runs
it, and PEFT's own forward, mixed batches and merges call this variant's ``forward`` / ``merge_*``,
which compute what vanilla LoRA computes. One scale for all tokens (PEFT's alpha / r or alpha / √r with
use_rslora, at the full rank r): with alpha / r_t per token the leading dimensions would be re-weighted
whenever the rank changed, which breaks nesting.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .. import ops
from ..bases import autocast_inputs
from ..layers.linear import SitsLoraLinear, SitsLoraVariant
from ..ops.dynamic_rank import dynamic_rank_lora_linear
from ..ops.reference import device_constant
from ..config.dynamic_rank import (
    DEFAULT_BUDGET_STEP_SIZE,
    ROUTED_SCHEDULERS,
    histogram_mean,
    max_entropy_histogram,
)
from .nested import forward_bucket_ids, layer_draw_seed
from .router import EntropyProbe, TokenRouter, add_budget_gradient, inverse_rms, route
from .scope import current_valid_tokens, in_token_scope, measuring_active


class RoutingMergeError(ValueError):
    """A routed adapter cannot be merged: a merged weight cannot vary per token."""


class ProbeNotFittedError(RuntimeError):
    """rank_scheduler='entropy-gated' needs its entropy probes fitted by TokenEntropySampler."""


@dataclass(frozen=True)
class RankSpec:
    """The dynamic-rank settings of one adapter, read from its SitsLoraConfig."""

    scheduler: str
    buckets: tuple
    target_mean_rank: Optional[float]
    histogram: tuple
    temperature: float
    budget_step_size: float
    budget_mode: str = "price"

    @classmethod
    def from_config(cls, config, r: int) -> "RankSpec":
        buckets = tuple(int(b) for b in config.rank_buckets)
        if buckets[-1] != r:
            raise ValueError(f"SitsLoraConfig.rank_buckets={list(buckets)} is invalid: the last bucket must equal "
                             f"the layer's rank r={r}.")
        target = config.target_mean_rank
        histogram = config.rank_histogram
        if config.rank_scheduler == "random" and histogram is None:
            histogram = max_entropy_histogram(buckets, target)
        if histogram is not None and target is None:
            target = histogram_mean(histogram, buckets)
        total = sum(histogram) if histogram is not None else 1.0
        return cls(
            scheduler=config.rank_scheduler,
            buckets=buckets,
            target_mean_rank=None if target is None else float(target),
            histogram=tuple(float(p) / total for p in histogram) if histogram is not None else (),
            temperature=float(config.router_temperature),
            budget_step_size=float(step if (step := config.rank_budget_step_size) is not None
                                   else DEFAULT_BUDGET_STEP_SIZE[config.rank_budget_mode]),
            budget_mode=config.rank_budget_mode,
        )

    @property
    def routed(self) -> bool:
        return self.scheduler in ROUTED_SCHEDULERS

    @property
    def routes_at_inference(self) -> bool:
        return self.scheduler != "static"


def holds_dynamic_rank(layer: nn.Module) -> bool:
    """Whether ``layer`` is a SitsLoraLinear given a dynamic-rank adapter (it keeps the state, rank_spec None,
    once truncate_rank has made the adapter static)."""
    return isinstance(layer, SitsLoraLinear) and isinstance(getattr(layer, "rank_spec", None), dict)


def dynamic_rank_adapters(layer: nn.Module) -> list[str]:
    """The adapters of ``layer`` that have a per-token rank now (not truncated); [] for any other module."""
    if not holds_dynamic_rank(layer):
        return []
    return [a for a, spec in layer.rank_spec.items() if spec is not None]


def _recomputing() -> bool:
    """True inside backward, where a layer's forward runs again only as a gradient-checkpoint recompute.

    Never under torch.compile: a compiled graph's recompute replays the traced graph, not this Python, and
    the graph-task query is a builtin that breaks the graph (one break per dynamic-rank layer on torch 2.11
    and 2.13)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def scale_preserving_alpha(scaling: float, k: int, use_rslora: bool) -> float:
    """The lora_alpha that gives a rank-k adapter the scaling ``scaling`` (PEFT: alpha/k or alpha/√k)."""
    return scaling * (math.sqrt(k) if use_rslora else k)


class DynamicRankVariant(SitsLoraVariant):
    """Per-token dynamic rank for one adapter of a SitsLoraLinear ``module``; static methods, as PEFT's variants.

    PEFT's interface (``init``, ``merge_safe``, ``merge_unsafe``, ``unmerge``, ``forward``), what the layer
    asks of a SitsLoraVariant, and the dynamic-rank calls the layer passes on (``choose_buckets``,
    ``probe_entropy``, ``rank_counts``, ``truncate``).
    """

    # ------------------------------------------------------------------ PEFT's LoraVariant

    @staticmethod
    def init(module: nn.Module, adapter_name: str, config=None, **kwargs: Any) -> None:
        if "rank_spec" not in vars(module):  # the layer's first dynamic-rank adapter: its containers
            module.rank_spec = {}
            module.rank_lambda = {}
            module._rank_counts = {}
            # per adapter, the last training forward's (valid-token mask, counted at recompute): _token_accounting
            module._forward_tokens = {}
            # per adapter, a nested adapter's shared bucket draw of the last training forward (for its recompute)
            module.nested_ids = {}
            module.rank_budget_attached = False
            module.lora_router = nn.ModuleDict()
            module.lora_entropy_probe = nn.ModuleDict()
            # PEFT's set_adapter / delete_adapter walk these (per instance, as PEFT's DoRA variant extends them)
            module.adapter_layer_names = module.adapter_layer_names + ("lora_router",)
            module.other_param_names = module.other_param_names + ("rank_spec", "rank_lambda")
        spec = RankSpec.from_config(config, module.r[adapter_name])
        module.rank_spec[adapter_name] = spec
        module.rank_lambda[adapter_name] = 0.0
        module._forward_tokens.pop(adapter_name, None)
        module.nested_ids.pop(adapter_name, None)
        device = module.get_base_layer().weight.device
        # allocated here and zeroed in place by rank_counts(reset=True), never replaced in a forward: under
        # torch.compile an in-place add to an existing tensor is traced, a tensor stored from the graph was lost
        module._rank_counts[adapter_name] = torch.zeros(2, len(spec.buckets), dtype=torch.long, device=device)
        if not spec.routed:
            return
        # fp32 like PEFT's adapters under a half-precision base: the router's logits decide discrete choices
        # (created after PEFT moved the adapter to the base's device and dtype; PEFT's set_adapter, which runs
        # next, sets its requires_grad)
        module.lora_router[adapter_name] = TokenRouter(
            module.in_features, spec.buckets, spec.target_mean_rank, use_entropy=spec.scheduler == "entropy-gated"
        ).to(device)
        if spec.scheduler == "entropy-gated":
            module.lora_entropy_probe[adapter_name] = EntropyProbe(module.in_features).to(device)

    # A dynamic-rank adapter that does not route (nested 'static' at inference) is plain LoRA: PEFT's forward,
    # its mixed batches and its merges compute what they compute for a vanilla adapter. A routed one never gets
    # here: the layer hands it to forward_routed, and merge refuses it (check_merge).

    @staticmethod
    def merge_safe(module: nn.Module, active_adapter: str, orig_weight: Tensor) -> Tensor:
        return orig_weight + module.get_delta_weight(active_adapter).to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module: nn.Module, active_adapter: str, orig_weight: Tensor) -> None:
        orig_weight.data += module.get_delta_weight(active_adapter)

    @staticmethod
    def unmerge(module: nn.Module, active_adapter: str, orig_weight: Tensor) -> Tensor:
        return orig_weight.data - module.get_delta_weight(active_adapter).to(orig_weight.dtype)

    @staticmethod
    def forward(module: nn.Module, active_adapter: str, x: Tensor, result: Tensor, **kwargs: Any) -> Tensor:
        lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
        dropout = module.lora_dropout[active_adapter]
        return result + lora_b(lora_a(dropout(x))) * module.scaling[active_adapter]

    # ------------------------------------------------------------------ what the layer asks

    @staticmethod
    def routes(module: nn.Module, adapter_name: str) -> bool:
        """True while the layer's forward applies a per-token mask for this adapter (the layer's routing_on)."""
        spec = module.rank_spec.get(adapter_name)
        return spec is not None and (spec.routes_at_inference or module.training)

    @staticmethod
    def runs_plain(module: nn.Module, adapter_name: str) -> bool:
        """Plain LoRA while it does not route (nested 'static' at inference): the layer's fused path runs it."""
        return not DynamicRankVariant.routes(module, adapter_name)

    @staticmethod
    def routed_adapter(module: nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
        """The adapter this call routes, or None (then the layer's other paths run). A routed adapter runs
        alone: with other active adapters, in a mixed batch, or with arguments beyond the input, the call
        is refused."""
        if module.disable_adapters or module.merged:
            return None
        routing_on = module.routing_on  # the adapter's own variant says (False for an adapter without one)
        mixed = kwargs.get("adapter_names")
        if mixed is not None:
            routed = sorted({a for a in mixed if routing_on(a)})
            if routed:
                raise ValueError(f"adapter_names (a mixed batch) is not supported for the routed dynamic-rank "
                                 f"adapter(s) {routed}; run them in their own batch, or truncate them with truncate_rank "
                                 f"first.")
            return None
        active = [a for a in module.active_adapters if a in module.lora_A]
        routed = [a for a in active if routing_on(a)]
        if not routed:
            return None
        if len(active) > 1:
            raise ValueError(f"the dynamic-rank adapter {routed[0]!r} must be the only active adapter while it routes; "
                             f"active adapters: {active}. Use set_adapter({routed[0]!r}).")
        if args or any(v is not None for v in kwargs.values()):
            raise TypeError(f"a layer routing the dynamic-rank adapter {routed[0]!r} takes only the input tensor; got "
                            f"extra arguments {len(args)} positional, "
                            f"{sorted(k for k, v in kwargs.items() if v is not None)}")
        return routed[0]

    @staticmethod
    def forward_routed(module: nn.Module, adapter: str, x: Tensor) -> Tensor:
        """The layer's whole output for a routed adapter: base + routed LoRA, in one op."""
        spec = module.rank_spec[adapter]
        grad_enabled = torch.is_grad_enabled()
        if spec.routed and module.training and grad_enabled and not module.rank_budget_attached:
            warnings.warn(
                f"dynamic-rank adapter {adapter!r} ({spec.scheduler}) is training without a rank budget, so nothing "
                f"holds its mean active rank at target_mean_rank={spec.target_mean_rank}. Pass "
                f"sits_lora.DynamicRankCallback() to the Trainer, or create sits_lora.RankBudget(model) and call "
                f"its step() after each optimizer step.",
                stacklevel=3,
            )
        valid, counted = DynamicRankVariant._token_accounting(module, adapter, x.shape[:-1], grad_enabled)
        used, bucket_weights, decided = DynamicRankVariant.choose_buckets(module, adapter, x)
        if bucket_weights is not None and grad_enabled:
            bucket_weights = add_budget_gradient(bucket_weights, spec.buckets, module.rank_lambda.get(adapter, 0.0),
                                                 valid)
        if counted:
            DynamicRankVariant._record(module, adapter, decided, used, valid, len(spec.buckets))
        base = module.base_layer
        kernel = ops.resolve_kernel(getattr(module, "sits_kernel", {}).get(adapter, "auto"), x,
                                    module.out_features)
        if kernel == "triton" and (torch.compiler.is_compiling() or base.weight.requires_grad
                                   or (base.bias is not None and base.bias.requires_grad)):
            kernel = "torch"  # the fused Function is eager only and assumes a frozen base (no dW / db)
        x, weight, bias, autocast_off = autocast_inputs(x, base.weight, base.bias) if kernel == "triton" else (
            x, base.weight, base.bias, contextlib.nullcontext())
        dropout = module.lora_dropout[adapter]
        x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else x
        with autocast_off:
            return dynamic_rank_lora_linear(
                x, x_lora, weight, bias, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                module.scaling[adapter], used, spec.buckets, bucket_weights, kernel=kernel,
            )

    @staticmethod
    def check_merge(module: nn.Module, adapter_name: str) -> None:
        """RoutingMergeError while the adapter routes at inference: a merged weight cannot vary per token."""
        spec = module.rank_spec.get(adapter_name)
        if spec is not None and spec.routes_at_inference:
            raise RoutingMergeError(
                f"cannot merge adapter {adapter_name!r}: it gives each token its own rank (rank_scheduler="
                f"{spec.scheduler!r}, rank_buckets={list(spec.buckets)}), and a merged weight cannot vary per "
                f"token. Truncate it to a static rank first, e.g. sits_lora.truncate_rank(model, "
                f"{int(spec.target_mean_rank or spec.buckets[0])}), then merge_and_unload()."
            )

    @staticmethod
    def forget(module: nn.Module, adapter_name: str) -> None:
        """Drop what PEFT's delete_adapter does not (the probe, the statistics, the kept draw)."""
        if adapter_name in module.lora_entropy_probe:
            del module.lora_entropy_probe[adapter_name]
        module._rank_counts.pop(adapter_name, None)
        module._forward_tokens.pop(adapter_name, None)
        module.nested_ids.pop(adapter_name, None)

    @staticmethod
    def follow_layer(module: nn.Module, adapter_name: str) -> None:
        """After the layer's ``_apply``: the rank counts are plain tensors (not buffers: not state to save);
        they follow the layer's device with their values, stay int64 whatever dtype the layer is cast to, and
        start from zero where they were never real (a layer built on the meta device, then to_empty())."""
        counts = vars(module).get("_rank_counts", {}).get(adapter_name)
        if counts is not None:
            device = module.lora_A[adapter_name].weight.device
            module._rank_counts[adapter_name] = (torch.zeros_like(counts, device=device) if counts.is_meta
                                                 else counts.to(device))

    # ------------------------------------------------------------------ routing

    @staticmethod
    def probe_entropy(module: nn.Module, adapter_name: str, x: Tensor, inv_rms: Tensor) -> Tensor:
        """The probe's standardized entropy prediction (T,) for the raw input x (T, d_in), 1/rms(x) (T,)."""
        probe = module.lora_entropy_probe[adapter_name]
        # reading the flag waits for the GPU: once it has been seen set, it is not read again
        if not getattr(probe, "fitted_seen", False) and not bool(probe.fitted):
            raise ProbeNotFittedError(
                f"rank_scheduler='entropy-gated' routes with an entropy probe per layer, and the probe of adapter "
                f"{adapter_name!r} is not fitted. Fit it before training or inference with "
                f"sits_lora.TokenEntropySampler(model, tokenizer).annotate(train_dataset) (one pass of the base model, "
                f"cached on disk), or use rank_scheduler='learned'."
            )
        probe.fitted_seen = True
        with torch.no_grad():
            return probe.from_raw(x, inv_rms)

    @staticmethod
    def choose_buckets(module: nn.Module, adapter_name: str, x: Tensor) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """(used (T,), bucket_weights (T, K) or None, decided (T,)) bucket ids for the tokens of x (..., d_in).

        ``decided`` is the routing rule inference applies (the router's argmax); ``used`` is what this
        forward computes with: the same, except in training, where routed adapters sample around the
        decision (Gumbel-max) so that every bucket's dimensions keep training.
        """
        spec = module.rank_spec[adapter_name]
        tokens = x.numel() // x.shape[-1]
        k = len(spec.buckets)
        if spec.scheduler == "static":
            # nested training: bucket k trains the first b_k dimensions, one bucket per sequence drawn once
            # per forward of the model and shared by its layers (nested.py says why)
            ids = DynamicRankVariant._nested_bucket_ids(module, adapter_name, tuple(x.shape[:-1]), k, x.device)
            return ids, None, ids
        if spec.scheduler == "random":
            probs = device_constant(("histogram", spec.histogram), x.device, lambda: torch.tensor(spec.histogram))
            ids = torch.multinomial(probs, tokens, replacement=True)
            return ids, None, ids
        # the router reads the hidden state but does not train the layers below it through x
        x_flat = x.detach().reshape(tokens, x.shape[-1])                                # (T, d_in)
        inv_rms = inverse_rms(x_flat)                                                   # (T,)
        entropy = (DynamicRankVariant.probe_entropy(module, adapter_name, x_flat, inv_rms)
                   if spec.scheduler == "entropy-gated" else None)
        router = module.lora_router[adapter_name]
        raw = router.raw(x_flat)                                                        # (T, K) fp32
        uniform = torch.rand_like(raw) if module.training else None                     # Gumbel noise source
        _, decided, used, weights = route(raw, inv_rms, router.bias, entropy, router.entropy_weight, uniform,
                                          spec.temperature)
        return used, weights, decided

    @staticmethod
    def _nested_bucket_ids(module: nn.Module, adapter_name: str, leading_shape: tuple, k: int,
                           device: torch.device) -> Tensor:
        if _recomputing():
            kept = module.nested_ids.get(adapter_name)
            if kept is not None and kept.numel() == math.prod(leading_shape):
                return kept  # the shared draw of its forward (a layer's own draw replays from the restored RNG)
        ids, shared = forward_bucket_ids(leading_shape, k, device, layer_draw_seed(module))
        if shared and module.training:
            module.nested_ids[adapter_name] = ids
        else:
            module.nested_ids.pop(adapter_name, None)
        return ids

    @staticmethod
    def _token_accounting(module: nn.Module, adapter_name: str, leading_shape: torch.Size,
                          grad_enabled: bool) -> tuple[Optional[Tensor], bool]:
        """(valid, counted): this forward's valid-token mask (T,) (None: every token is valid), and whether
        the forward counts in the rank statistics.

        A forward counts when the layer trains with autograd on, inside the forward of a model with a
        RankBudget (or ``valid_tokens``), outside backward; inside ``RankBudget.measuring()`` any forward
        in such a scope counts. So evaluation, no_grad passes and layers called on their own (the memory
        plan's probes) leave the statistics alone. Gradient checkpointing runs the forward again inside
        backward, where the model's valid-token scope is gone: the recompute takes the mask its forward
        stored (for the λ term) and does not count again. With ``use_reentrant=True`` the first forward
        runs under no_grad and is not counted; its recompute is, once.
        """
        if _recomputing():
            valid, pending = module._forward_tokens.get(adapter_name, (None, False))
            if valid is not None and valid.numel() != math.prod(leading_shape):
                valid = None
            if pending and module.training and grad_enabled:
                module._forward_tokens[adapter_name] = (valid, False)
                return valid, True
            return valid, False
        in_scope = in_token_scope()
        valid = current_valid_tokens(leading_shape) if in_scope else None
        counted = in_scope and (measuring_active() or (module.training and grad_enabled))
        if module.training:
            module._forward_tokens[adapter_name] = (valid, in_scope and not counted)
        return valid, counted

    @staticmethod
    def _record(module: nn.Module, adapter_name: str, decided: Tensor, used: Tensor, valid: Optional[Tensor],
                k: int) -> None:
        # index_add_ with fixed sizes: boolean indexing and bincount would each wait for the GPU
        with torch.no_grad():
            counts = module._rank_counts.get(adapter_name)
            if counts is None or counts.device != decided.device:  # eager only: _apply keeps them on the layer's device
                counts = module._rank_counts[adapter_name] = torch.zeros(2, k, dtype=torch.long, device=decided.device)
            weight = valid.long() if valid is not None else torch.ones_like(decided)
            counts[0].index_add_(0, decided, weight)
            counts[1].index_add_(0, used, weight)

    @staticmethod
    def rank_counts(module: nn.Module, adapter_name: str, reset: bool = True) -> Tensor:
        """(2, K) int64 on the layer's device: per bucket, how many valid tokens the routing rule sent there
        (row 0, what inference does) and how many this layer computed with (row 1; differs in training,
        where routers sample), since the last reset."""
        k = len(module.rank_spec[adapter_name].buckets)
        counts = module._rank_counts.get(adapter_name)
        if counts is None:
            return torch.zeros(2, k, dtype=torch.long, device=module.lora_A[adapter_name].weight.device)
        out = counts.clone()
        if reset:
            counts.zero_()
        return out

    # ------------------------------------------------------------------ truncation

    @staticmethod
    def truncate(module: nn.Module, adapter_name: str, k: int) -> None:
        """Keep the first k rank dimensions as a static rank-k adapter with the same scaling: plain LoRA from
        then on (no variant, rank_spec None)."""
        if module.merged:
            raise ValueError("truncate the adapter before merging it (the layer is merged)")
        r = module.r[adapter_name]
        if not 1 <= k <= r:
            raise ValueError(f"rank k={k} must lie between 1 and the adapter's rank r={r}")
        old_a, old_b = module.lora_A[adapter_name], module.lora_B[adapter_name]
        new_a = nn.Linear(module.in_features, k, bias=False, device=old_a.weight.device, dtype=old_a.weight.dtype)
        new_b = nn.Linear(k, module.out_features, bias=False, device=old_b.weight.device, dtype=old_b.weight.dtype)
        with torch.no_grad():
            new_a.weight.copy_(old_a.weight[:k])
            new_b.weight.copy_(old_b.weight[:, :k])
        new_a.weight.requires_grad_(old_a.weight.requires_grad)
        new_b.weight.requires_grad_(old_b.weight.requires_grad)
        module.lora_A[adapter_name], module.lora_B[adapter_name] = new_a, new_b
        module.r[adapter_name] = k
        module.lora_alpha[adapter_name] = scale_preserving_alpha(module.scaling[adapter_name], k,
                                                                  module.use_rslora.get(adapter_name, False))
        if adapter_name in module.lora_router:
            del module.lora_router[adapter_name]
        module.rank_spec[adapter_name] = None
        DynamicRankVariant.forget(module, adapter_name)  # the probe, the statistics
        del module.lora_variant[adapter_name]


class _HoldsDynamicRank(type):
    def __instancecheck__(cls, obj) -> bool:
        return holds_dynamic_rank(obj)

    def __call__(cls, *args, **kwargs):
        warnings.warn("sits_lora.DynamicRankLinear is deprecated: SitsLoraLinear serves dynamic-rank adapters "
                      "through DynamicRankVariant", DeprecationWarning, stacklevel=2)
        return SitsLoraLinear(*args, **kwargs)


class DynamicRankLinear(metaclass=_HoldsDynamicRank):
    """Deprecated name: dynamic rank is a variant of :class:`~sits_lora.layers.linear.SitsLoraLinear`.
    ``isinstance(m, DynamicRankLinear)`` is :func:`holds_dynamic_rank`; calling it builds a SitsLoraLinear."""
