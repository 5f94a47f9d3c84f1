"""DynamicRankLinear: a SitsLoraLinear whose dynamic-rank adapters give each token its own rank.

Per adapter with ``use_dynamic_rank=True``, the layer holds a :class:`RankSpec`, a router
(``lora_router``, trainable, for 'entropy-gated' / 'learned') and an entropy probe
(``lora_entropy_probe``, frozen, fitted by TokenEntropySampler, for 'entropy-gated'). Both are
children of the layer, so PEFT saves and loads them with lora_A / lora_B.

Routing is on while an adapter routes ('entropy-gated', 'learned', 'random') or trains nested
('static' in training mode). Then forward computes base + s·((x_lora Aᵀ) ⊙ mask) Bᵀ with the
per-token mask of ``reference.py``; otherwise it defers to SitsLoraLinear.forward unchanged.
One scale for all tokens (PEFT's alpha / r or alpha / √r with use_rslora, at the full rank r):
with alpha / r_t per token the leading dimensions would be re-weighted whenever the rank changed,
which breaks nesting.
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
from ..layer import SitsLoraLinear
from ..ops.dynamic_rank import dynamic_rank_lora_linear
from ..ops.reference import device_constant
from .checks import (
    DEFAULT_BUDGET_STEP_SIZE,
    ROUTED_SCHEDULERS,
    histogram_mean,
    max_entropy_histogram,
)
from .scope import current_valid_tokens, in_token_scope, measuring_active
from .nested import forward_bucket_ids, layer_draw_seed
from .router import EntropyProbe, TokenRouter, add_budget_gradient, inverse_rms, route


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


class DynamicRankLinear(SitsLoraLinear):
    adapter_layer_names = SitsLoraLinear.adapter_layer_names + ("lora_router",)
    other_param_names = SitsLoraLinear.other_param_names + ("rank_spec", "rank_lambda")

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        self.rank_spec: dict[str, Optional[RankSpec]] = {}
        self.rank_lambda: dict[str, float] = {}
        self._rank_counts: dict[str, Tensor] = {}
        # per adapter, the last training forward's (valid-token mask, counted at recompute): see _token_accounting
        self._forward_tokens: dict[str, tuple[Optional[Tensor], bool]] = {}
        # per adapter, a nested adapter's shared bucket draw of the last training forward (for its recompute)
        self._nested_ids: dict[str, Tensor] = {}
        self.rank_budget_attached = False
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)

    # ------------------------------------------------------------------ construction

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        if "lora_router" not in self._modules:  # PEFT's set_adapter, run by update_layer, walks adapter_layer_names
            self.lora_router = nn.ModuleDict()
            self.lora_entropy_probe = nn.ModuleDict()
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        spec = RankSpec.from_config(config, r) if getattr(config, "use_dynamic_rank", False) else None
        self.rank_spec[adapter_name] = spec
        self.rank_lambda[adapter_name] = 0.0
        self._rank_counts.pop(adapter_name, None)
        self._forward_tokens.pop(adapter_name, None)
        self._nested_ids.pop(adapter_name, None)
        if spec is None:
            return
        device = self.get_base_layer().weight.device
        # allocated here and zeroed in place by rank_counts(reset=True), never replaced in a forward: under
        # torch.compile an in-place add to an existing tensor is traced, a tensor stored from the graph was lost
        self._rank_counts[adapter_name] = torch.zeros(2, len(spec.buckets), dtype=torch.long, device=device)
        if not spec.routed:
            return
        # fp32 like PEFT's adapters under a half-precision base: the router's logits decide discrete choices
        self.lora_router[adapter_name] = TokenRouter(
            self.in_features, spec.buckets, spec.target_mean_rank, use_entropy=spec.scheduler == "entropy-gated"
        ).to(device)
        if spec.scheduler == "entropy-gated":
            self.lora_entropy_probe[adapter_name] = EntropyProbe(self.in_features).to(device)
        # PEFT's set_adapter ran inside super().update_layer, before the router existed
        self.lora_router[adapter_name].requires_grad_(adapter_name in self.active_adapters)

    def delete_adapter(self, adapter_name: str) -> None:
        super().delete_adapter(adapter_name)
        if "lora_entropy_probe" in self._modules and adapter_name in self.lora_entropy_probe:
            del self.lora_entropy_probe[adapter_name]
        self._rank_counts.pop(adapter_name, None)
        self._forward_tokens.pop(adapter_name, None)
        self._nested_ids.pop(adapter_name, None)

    # ------------------------------------------------------------------ routing

    def routing_on(self, adapter_name: str) -> bool:
        """True while forward applies a per-token mask for this adapter."""
        spec = self.rank_spec.get(adapter_name)
        return spec is not None and (spec.routes_at_inference or self.training)

    def _routed_adapter(self, args: tuple, kwargs: dict) -> Optional[str]:
        if self.disable_adapters or self.merged:
            return None
        mixed = kwargs.get("adapter_names")
        if mixed is not None:
            routed = sorted({a for a in mixed if a in self.rank_spec and self.routing_on(a)})
            if routed:
                raise ValueError(f"adapter_names (a mixed batch) is not supported for the routed dynamic-rank adapter(s) "
                                 f"{routed}; run them in their own batch, or truncate them with truncate_rank first.")
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        routed = [a for a in active if self.routing_on(a)]
        if not routed:
            return None
        if len(active) > 1:
            raise ValueError(f"the dynamic-rank adapter {routed[0]!r} must be the only active adapter while it routes; "
                             f"active adapters: {active}. Use set_adapter({routed[0]!r}).")
        if args or any(v is not None for v in kwargs.values()):
            raise TypeError(f"DynamicRankLinear with a routed adapter takes only the input tensor; got extra arguments "
                            f"{len(args)} positional, {sorted(k for k, v in kwargs.items() if v is not None)}")
        return routed[0]

    def probe_entropy(self, adapter_name: str, x: Tensor, inv_rms: Tensor) -> Tensor:
        """The probe's standardized entropy prediction (T,) for the raw input x (T, d_in), 1/rms(x) (T,)."""
        probe = self.lora_entropy_probe[adapter_name]
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

    def choose_buckets(self, adapter_name: str, x: Tensor) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """(used (T,), bucket_weights (T, K) or None, decided (T,)) bucket ids for the tokens of x (..., d_in).

        ``decided`` is the routing rule inference applies (the router's argmax); ``used`` is what this
        forward computes with: the same, except in training, where routed adapters sample around the
        decision (Gumbel-max) so that every bucket's dimensions keep training.
        """
        spec = self.rank_spec[adapter_name]
        tokens = x.numel() // x.shape[-1]
        k = len(spec.buckets)
        if spec.scheduler == "static":
            # nested training: bucket k trains the first b_k dimensions, one bucket per sequence drawn once
            # per forward of the model and shared by its layers (nested.py says why)
            ids = self._nested_bucket_ids(adapter_name, tuple(x.shape[:-1]), k, x.device)
            return ids, None, ids
        if spec.scheduler == "random":
            probs = device_constant(("histogram", spec.histogram), x.device, lambda: torch.tensor(spec.histogram))
            ids = torch.multinomial(probs, tokens, replacement=True)
            return ids, None, ids
        # the router reads the hidden state but does not train the layers below it through x
        x_flat = x.detach().reshape(tokens, x.shape[-1])                                # (T, d_in)
        inv_rms = inverse_rms(x_flat)                                                   # (T,)
        entropy = self.probe_entropy(adapter_name, x_flat, inv_rms) if spec.scheduler == "entropy-gated" else None
        router = self.lora_router[adapter_name]
        raw = router.raw(x_flat)                                                        # (T, K) fp32
        uniform = torch.rand_like(raw) if self.training else None                       # Gumbel noise source
        _, decided, used, weights = route(raw, inv_rms, router.bias, entropy, router.entropy_weight, uniform,
                                          spec.temperature)
        return used, weights, decided

    def _nested_bucket_ids(self, adapter_name: str, leading_shape: tuple, k: int, device: torch.device) -> Tensor:
        if _recomputing():
            kept = self._nested_ids.get(adapter_name)
            if kept is not None and kept.numel() == math.prod(leading_shape):
                return kept  # the shared draw of its forward (a layer's own draw replays from the restored RNG)
        ids, shared = forward_bucket_ids(leading_shape, k, device, layer_draw_seed(self))
        if shared and self.training:
            self._nested_ids[adapter_name] = ids
        else:
            self._nested_ids.pop(adapter_name, None)
        return ids

    def _token_accounting(self, adapter_name: str, leading_shape: torch.Size,
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
            valid, pending = self._forward_tokens.get(adapter_name, (None, False))
            if valid is not None and valid.numel() != math.prod(leading_shape):
                valid = None
            if pending and self.training and grad_enabled:
                self._forward_tokens[adapter_name] = (valid, False)
                return valid, True
            return valid, False
        in_scope = in_token_scope()
        valid = current_valid_tokens(leading_shape) if in_scope else None
        counted = in_scope and (measuring_active() or (self.training and grad_enabled))
        if self.training:
            self._forward_tokens[adapter_name] = (valid, in_scope and not counted)
        return valid, counted

    def _record(self, adapter_name: str, decided: Tensor, used: Tensor, valid: Optional[Tensor], k: int) -> None:
        # index_add_ with fixed sizes: boolean indexing and bincount would each wait for the GPU
        with torch.no_grad():
            counts = self._rank_counts.get(adapter_name)
            if counts is None or counts.device != decided.device:  # eager only: _apply keeps them on the layer's device
                counts = self._rank_counts[adapter_name] = torch.zeros(2, k, dtype=torch.long, device=decided.device)
            weight = valid.long() if valid is not None else torch.ones_like(decided)
            counts[0].index_add_(0, decided, weight)
            counts[1].index_add_(0, used, weight)

    def rank_counts(self, adapter_name: str, reset: bool = True) -> Tensor:
        """(2, K) int64 on the layer's device: per bucket, how many valid tokens the routing rule sent there
        (row 0, what inference does) and how many this layer computed with (row 1; differs in training,
        where routers sample), since the last reset."""
        k = len(self.rank_spec[adapter_name].buckets)
        counts = self._rank_counts.get(adapter_name)
        if counts is None:
            return torch.zeros(2, k, dtype=torch.long, device=self.lora_A[adapter_name].weight.device)
        out = counts.clone()
        if reset:
            counts.zero_()
        return out

    def _apply(self, fn, recurse: bool = True):
        # The rank counts are plain tensors (not buffers: not state to save); they follow the layer's
        # device with their values, stay int64 whatever dtype the layer is cast to, and start from zero
        # where they were never real (a layer built on the meta device, then to_empty()).
        result = super()._apply(fn, recurse)
        for name, counts in self._rank_counts.items():
            device = self.lora_A[name].weight.device if name in self.lora_A else counts.device
            self._rank_counts[name] = (torch.zeros_like(counts, device=device) if counts.is_meta
                                       else counts.to(device))
        return result

    # ------------------------------------------------------------------ forward

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        adapter = self._routed_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        spec = self.rank_spec[adapter]
        grad_enabled = torch.is_grad_enabled()
        if spec.routed and self.training and grad_enabled and not self.rank_budget_attached:
            warnings.warn(
                f"dynamic-rank adapter {adapter!r} ({spec.scheduler}) is training without a rank budget, so nothing "
                f"holds its mean active rank at target_mean_rank={spec.target_mean_rank}. Pass "
                f"sits_lora.DynamicRankCallback() to the Trainer, or create sits_lora.RankBudget(model) and call "
                f"its step() after each optimizer step.",
                stacklevel=2,
            )
        valid, counted = self._token_accounting(adapter, x.shape[:-1], grad_enabled)
        used, bucket_weights, decided = self.choose_buckets(adapter, x)
        if bucket_weights is not None and grad_enabled:
            bucket_weights = add_budget_gradient(bucket_weights, spec.buckets, self.rank_lambda.get(adapter, 0.0), valid)
        if counted:
            self._record(adapter, decided, used, valid, len(spec.buckets))
        base = self.base_layer
        kernel = ops.resolve_kernel(getattr(self, "sits_kernel", {}).get(adapter, "auto"), x)
        if kernel == "triton" and (torch.compiler.is_compiling() or base.weight.requires_grad
                                   or (base.bias is not None and base.bias.requires_grad)):
            kernel = "torch"  # the fused Function is eager only and assumes a frozen base (no dW / db)
        x, weight, bias, autocast_off = autocast_inputs(x, base.weight, base.bias) if kernel == "triton" else (
            x, base.weight, base.bias, contextlib.nullcontext())
        dropout = self.lora_dropout[adapter]
        x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else x
        with autocast_off:
            return dynamic_rank_lora_linear(
                x, x_lora, weight, bias, self.lora_A[adapter].weight, self.lora_B[adapter].weight,
                self.scaling[adapter], used, spec.buckets, bucket_weights, kernel=kernel,
            )

    # ------------------------------------------------------------------ merge / truncate

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        names = adapter_names if adapter_names is not None else self.active_adapters
        for name in names:
            spec = self.rank_spec.get(name)
            if spec is not None and spec.routes_at_inference:
                raise RoutingMergeError(
                    f"cannot merge adapter {name!r}: it gives each token its own rank (rank_scheduler="
                    f"{spec.scheduler!r}, rank_buckets={list(spec.buckets)}), and a merged weight cannot vary per "
                    f"token. Truncate it to a static rank first, e.g. sits_lora.truncate_rank(model, "
                    f"{int(spec.target_mean_rank or spec.buckets[0])}), then merge_and_unload()."
                )
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)

    def truncate_adapter(self, adapter_name: str, k: int) -> None:
        """Keep the first k rank dimensions as a static rank-k adapter with the same scaling."""
        if self.merged:
            raise ValueError("truncate the adapter before merging it (the layer is merged)")
        r = self.r[adapter_name]
        if not 1 <= k <= r:
            raise ValueError(f"rank k={k} must lie between 1 and the adapter's rank r={r}")
        old_a, old_b = self.lora_A[adapter_name], self.lora_B[adapter_name]
        new_a = nn.Linear(self.in_features, k, bias=False, device=old_a.weight.device, dtype=old_a.weight.dtype)
        new_b = nn.Linear(k, self.out_features, bias=False, device=old_b.weight.device, dtype=old_b.weight.dtype)
        with torch.no_grad():
            new_a.weight.copy_(old_a.weight[:k])
            new_b.weight.copy_(old_b.weight[:, :k])
        new_a.weight.requires_grad_(old_a.weight.requires_grad)
        new_b.weight.requires_grad_(old_b.weight.requires_grad)
        self.lora_A[adapter_name], self.lora_B[adapter_name] = new_a, new_b
        self.r[adapter_name] = k
        self.lora_alpha[adapter_name] = scale_preserving_alpha(self.scaling[adapter_name], k,
                                                                self.use_rslora.get(adapter_name, False))
        for container in ("lora_router", "lora_entropy_probe"):
            if adapter_name in getattr(self, container):
                del getattr(self, container)[adapter_name]
        self.rank_spec[adapter_name] = None
        self._rank_counts.pop(adapter_name, None)
        self._forward_tokens.pop(adapter_name, None)

    def __repr__(self) -> str:
        routed = {a: s.scheduler for a, s in self.rank_spec.items() if s is not None}
        return super().__repr__() + (f"  # dynamic rank: {routed}" if routed else "")


def create_dynamic_rank_module(lora_config, adapter_name: str, target: nn.Module, **kwargs) -> DynamicRankLinear:
    """The layer SitsLoraModel builds for a config with use_dynamic_rank=True (torch.nn.Linear targets only)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if type(base) is not nn.Linear or kwargs.get("parameter_name") is not None:
        name = kwargs.get("target_name") or type(base).__name__
        raise ValueError(
            f"SitsLoraConfig.use_dynamic_rank=True supports torch.nn.Linear layers only; target {name!r} is a "
            f"{type(base).__module__}.{type(base).__qualname__}. Remove it from target_modules, or adapt it with a "
            f"second, static adapter."
        )
    if lora_config.fan_in_fan_out:
        warnings.warn("fan_in_fan_out=True does not apply to torch.nn.Linear; setting it to False.")
        lora_config.fan_in_fan_out = False
    return DynamicRankLinear(target, adapter_name, config=lora_config, **kwargs)
