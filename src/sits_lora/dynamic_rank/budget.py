"""The rank budget: the mean active rank over non-padding tokens, held at target by dual ascent.

Lagrangian: task loss + λ·(mean active rank / r). The mean active rank is measured on the routers'
decisions (their argmax: what inference does) since the previous step; in training the layers
compute with buckets sampled around those decisions. After each optimizer step the multiplier follows
    λ ← λ + η·(mean active rank − target_mean_rank) / r            (rank_budget_mode="price", "target")
    λ ← max(0, λ + η·(mean active rank − target_mean_rank) / r)    (rank_budget_mode="ceiling")
A fixed penalty drifts as the task gradient changes during training; the multiplier rises until the
constraint holds and falls back when it is slack. One λ for the whole model (the budget is a global
mean, so rank can move between layers).

How λ reaches the routers:
- "target" / "ceiling": through their gradient (``router.add_budget_gradient``); each layer's term is
  its own mean, so λ does not scale with the number of layers. With gradient accumulation, Trainer
  divides the task loss by the number of micro-batches but not the λ term: λ settles at a
  proportionally smaller value, same constraint. "target" holds the mean from both sides (a negative
  λ rewards rank); "ceiling" only caps it: routers that want less rank than the target settle below it
  with λ at 0. Through the gradient λ acts with a lag: in a short run "target" can leave the routers
  well off the target, on either side, while λ is still moving (docs/dynamic-rank.md).
- "price" (the default): into the decision itself (Lagrangian relaxation of the routing: each token picks
  argmax_k of logit_k − λ·b_k/r, the idea of DeepSeek-V3's bias-based load balancing). After each
  step every router's bucket bias c_k moves by −Δλ·b_k/r; no budget term in the gradient. The next
  forward's decisions respond at once, and the price lives in the biases, which save with the
  adapter: inference routes with the price training ended at. It holds the mean closer to the target
  than "target" does. With a small η it holds steady but late (above the target), because the routers'
  demand for rank keeps growing while they learn, and an integral rule lags a growing demand by
  drift·r/(sensitivity·η); hence η 6 by default (docs/dynamic-rank.md).

Padding: a forward pre-hook on the model reads ``attention_mask`` and the layers skip tokens where
it is 0, in the statistics and in the λ term. Tokens with label -100 count (they are not padding).

What counts: each training forward of the model once (autograd on, inside the model's forward).
Evaluation and no_grad forwards do not count (``RankBudget.measuring()`` turns them on), nor layers called on
their own (the memory plan's probes), nor gradient-checkpoint recomputation in backward, which
would count the tokens twice (see ``DynamicRankVariant._token_accounting``).

Data parallel: every rank routes its own tokens, so :meth:`RankBudget.read_stats` sums the counts of
all ranks (one all_reduce) before λ moves, and λ stays the same on every rank. Every rank must call
``step`` / ``read_stats`` together, as DynamicRankCallback does.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn

from ..config.dynamic_rank import ROUTED_SCHEDULERS
from .scope import enter_scope, leave_scope, set_measuring
from .variant import dynamic_rank_adapters


def _all_reduce_counts(counts: Tensor) -> Tensor:
    """Sum of ``counts`` over the ranks of the default process group (unchanged without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return counts
    if "nccl" not in str(dist.get_backend()):  # NCCL reduces device tensors; gloo wants host tensors
        counts = counts.cpu()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def dynamic_rank_layers(model: nn.Module, adapter_name: Optional[str] = None) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every layer holding a dynamic-rank adapter (``adapter_name`` if given)."""
    found = []
    for name, module in model.named_modules():
        adapters = dynamic_rank_adapters(module)
        if adapters and (adapter_name is None or adapter_name in adapters):
            found.append((name, module))
    return found


def _single_dynamic_adapter(model: nn.Module, adapter_name: Optional[str]) -> str:
    names = set()
    for _, layer in dynamic_rank_layers(model):
        names.update(dynamic_rank_adapters(layer))
    if adapter_name is not None:
        if adapter_name not in names:
            raise ValueError(f"adapter_name={adapter_name!r} is not a dynamic-rank adapter of this model; "
                             f"dynamic-rank adapters: {sorted(names)}")
        return adapter_name
    if not names:
        raise ValueError("the model has no dynamic-rank adapter: build it with SitsLoraConfig(use_dynamic_rank=True, ...)")
    if len(names) > 1:
        raise ValueError(f"the model has several dynamic-rank adapters {sorted(names)}; pass adapter_name")
    return names.pop()


class RankBudget:
    """Holds the mean active rank of one dynamic-rank adapter at its target; reads the rank statistics.

    ``RankBudget(model)`` attaches to every dynamic-rank layer; call :meth:`step` after each
    optimizer step (``DynamicRankCallback`` does it for a Trainer). Without a budget, a routed
    adapter trains with λ = 0 and warns that nothing holds its mean rank.
    """

    def __init__(self, model: nn.Module, adapter_name: Optional[str] = None, step_size: Optional[float] = None,
                 target_mean_rank: Optional[float] = None):
        self.adapter_name = _single_dynamic_adapter(model, adapter_name)
        self.layers = dynamic_rank_layers(model, self.adapter_name)
        spec = self.layers[0][1].rank_spec[self.adapter_name]
        self.scheduler = spec.scheduler
        self.buckets = list(spec.buckets)
        self.r = spec.buckets[-1]
        self.target = float(target_mean_rank if target_mean_rank is not None else (spec.target_mean_rank or self.r))
        self.step_size = float(step_size if step_size is not None else spec.budget_step_size)
        self.mode = spec.budget_mode
        self.lam = 0.0
        self.steps = 0
        for _, layer in self.layers:
            layer.rank_lambda[self.adapter_name] = 0.0
            layer.rank_budget_attached = True
            layer.rank_counts(self.adapter_name, reset=True)  # forwards before the budget existed are not its steps
        self._hooks = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._exit, always_call=True),
        ]
        self._tokens: list = []

    @property
    def routed(self) -> bool:
        return self.scheduler in ROUTED_SCHEDULERS

    def _enter(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, Tensor) or mask.dim() != 2):
            mask = None  # a 4-D additive mask or a custom object: cannot tell padding apart, count every token
        self._tokens.append(enter_scope(mask))

    def _exit(self, module, args, output):
        if self._tokens:
            leave_scope(self._tokens.pop())

    @contextlib.contextmanager
    def measuring(self):
        """Within the block, evaluation and no_grad forwards count in the statistics too, so that
        :meth:`read_stats` reports the ranks inference uses. Call ``read_stats(reset=True)`` before the
        block and read the statistics after it, before the next :meth:`step`, which would otherwise move λ
        with them."""
        previous = set_measuring(True)
        try:
            yield self
        finally:
            set_measuring(previous)

    def read_stats(self, reset: bool = True) -> dict:
        """Rank statistics over the valid tokens seen since the last reset, all layers together.

        ``mean_active_rank`` / ``histogram``: the routing rule inference applies (the router's
        argmax), which the budget holds at the target. ``mean_computed_rank``: what the layers computed
        with; in training, routers sample around their decision, so it can differ. Under
        torch.distributed the counts of every rank are summed, so every rank must call this together.
        """
        counts = [layer.rank_counts(self.adapter_name, reset=reset) for _, layer in self.layers]
        device = counts[0].device
        stacked = torch.stack([c.to(device) for c in counts])                      # (L, 2, K) int64, on the device
        per_layer = _all_reduce_counts(stacked).double().cpu()                     # one host read
        decided, used = per_layer[:, 0], per_layer[:, 1]                           # (L, K) each
        total = decided.sum(0)                                                     # (K,)
        n = float(total.sum())
        b = torch.tensor(self.buckets, dtype=torch.float64)
        nan = float("nan")
        layer_means = ((decided * b).sum(1) / decided.sum(1).clamp_min(1)).tolist()
        return {
            "mean_active_rank": float((total * b).sum() / n) if n > 0 else nan,
            "mean_computed_rank": float((used.sum(0) * b).sum() / n) if n > 0 else nan,
            "histogram": {int(bk): (float(c) / n if n > 0 else 0.0) for bk, c in zip(self.buckets, total)},
            "token_layer_pairs": int(n),
            "layer_mean_rank": {name: m for (name, _), m in zip(self.layers, layer_means)},
        }

    def step(self) -> dict:
        """Update λ from the statistics since the last step (routed schedulers); return them with λ."""
        stats = self.read_stats(reset=True)
        if self.routed and stats["token_layer_pairs"] > 0:
            change = self.step_size * (stats["mean_active_rank"] - self.target) / self.r
            if self.mode == "ceiling":
                change = max(-self.lam, change)
            self.lam += change
            if self.mode == "price":
                self._shift_router_biases(change)
            else:
                for _, layer in self.layers:
                    layer.rank_lambda[self.adapter_name] = self.lam
        self.steps += 1
        stats.update({"lambda": self.lam, "target_mean_rank": self.target, "step": self.steps})
        return stats

    @torch.no_grad()
    def _shift_router_biases(self, change: float) -> None:
        """c_k -= change·b_k/r in every routed layer: one fused launch for the whole model."""
        biases = [layer.lora_router[self.adapter_name].bias for _, layer in self.layers
                  if self.adapter_name in layer.lora_router]
        if not biases or change == 0.0:
            return
        cost = torch.tensor([change * float(b) / self.r for b in self.buckets], dtype=biases[0].dtype)
        per_device: dict = {}
        shifts = [per_device.setdefault(b.device, cost.to(b.device)) for b in biases]
        torch._foreach_sub_(biases, shifts)

    def state_dict(self) -> dict:
        """λ and the step count (what a resumed run needs), with the settings they were reached under."""
        return {"lam": self.lam, "steps": self.steps, "adapter_name": self.adapter_name,
                "target_mean_rank": self.target, "step_size": self.step_size, "mode": self.mode}

    def load_state_dict(self, state: dict) -> None:
        """Restore λ and the step count; the target and step size stay those this budget was built with.
        ("price": the price itself is in the router biases, restored with the weights.)"""
        self.lam, self.steps = float(state["lam"]), int(state["steps"])
        for _, layer in self.layers:
            layer.rank_lambda[self.adapter_name] = 0.0 if self.mode == "price" else self.lam

    def close(self) -> None:
        """Detach from the model (the layers keep their last λ)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for _, layer in self.layers:
            layer.rank_budget_attached = False
