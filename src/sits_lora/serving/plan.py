"""Merge or dispatch: which way a request's adapters should run, from costs measured on this model and device.

A merged adapter decodes at the base model's speed, but merging (and unmerging for the next request) costs a pass
over every adapted weight, and a merged model serves one adapter. An unmerged adapter costs a little every token
and serves any mix of adapters in one batch (``adapter_names``). So: several adapters in a batch dispatch; one
adapter merges when the request is long enough for the tokens' savings to pay for merging and unmerging::

    plan = sits_lora.serving_plan(model, ["support"] * 8, new_tokens=512)
    plan.action, plan.reason            # "merge", "one adapter for 512 tokens: merging pays after 61 tokens ..."
    plan.apply()                        # merges (or unmerges / sets the adapter for a dispatch)
    out = model.generate(input_ids=ids, max_new_tokens=512, **plan.generate_kwargs)

The costs come from :func:`measure_serving_costs` (once per model, adapter and batch size, kept on the model): a
decode-sized forward (batch x 1 token) unmerged and merged, and one merge + unmerge, timed on the model's device (on
a GPU with CUDA events; under ``graph_decode`` decoding costs what the GPU spends, so pass ``graphs=True`` to time the
forwards as replayed CUDA graphs). Pass ``costs=`` to use costs measured elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..utils.cuda_graphs import capture_or_undo
from ..utils import validation
from ..utils.merging import base_weights_kept, merged_adapters, time_ms, why_not_mergeable

BASE = "__base__"


@dataclass(frozen=True)
class ServingCosts:
    """Measured milliseconds: a decode step unmerged and merged, and merging + unmerging the adapter once."""

    dispatch_ms: float
    merged_ms: float
    merge_ms: float

    @property
    def crossover_tokens(self) -> float:
        """New tokens from which merging pays (inf when a merged step is no faster)."""
        saved = self.dispatch_ms - self.merged_ms
        return self.merge_ms / saved if saved > 0 else float("inf")


@dataclass
class ServingPlan:
    """What :func:`serving_plan` decided: ``action`` "merge", "dispatch" or "base", for ``adapter`` (merge) or
    ``adapter_names`` (dispatch), why, and the costs it used (None when none were needed)."""

    model: nn.Module = field(repr=False)
    action: str
    adapter: Optional[str]
    adapter_names: Optional[list]
    reason: str
    costs: Optional[ServingCosts] = None

    @property
    def generate_kwargs(self) -> dict:
        """What to pass to ``generate`` / ``forward`` with this plan applied (``adapter_names`` for a mixed batch)."""
        return {"adapter_names": self.adapter_names} if self.action == "dispatch" and self.adapter_names else {}

    def apply(self) -> "ServingPlan":
        """Put the model in the plan's state: merge the adapter (unmerging any other first), or unmerge for a
        dispatch (and make a single adapter active), or disable the adapters for "base"."""
        model = self.model
        if self.action != "base":
            model.base_model.enable_adapter_layers()
        merged = merged_adapters(model)
        if self.action == "merge":
            if merged != {self.adapter}:
                if merged:
                    model.unmerge_adapter()
                model.set_adapter(self.adapter)
                model.merge_adapter([self.adapter])
        else:
            if merged:
                model.unmerge_adapter()
            if self.action == "dispatch" and self.adapter is not None:
                model.set_adapter(self.adapter)
            if self.action == "base":
                model.base_model.disable_adapter_layers()
        return self


def _check_model(model: nn.Module, caller: str) -> None:
    if not hasattr(model, "peft_config") or not hasattr(model, "merge_adapter"):
        raise TypeError(f"{caller} needs a PeftModel (get_peft_model(model, SitsLoraConfig(...))), got "
                        f"{type(model).__name__}")


def _step(model: nn.Module, ids: torch.Tensor, graphs: bool):
    """A decode-sized forward; with ``graphs`` on a GPU, that forward recorded once and replayed."""
    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    if not graphs:
        return forward
    for _ in range(2):                   # off the recording: autotuning, lazy initialization
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capture_or_undo(graph):
        forward()
    return graph.replay


def measure_serving_costs(model: nn.Module, adapter: str, batch_size: int = 1, graphs: bool = False,
                          repeats: int = 5) -> ServingCosts:
    """Time a decode-sized forward of ``batch_size`` x 1 tokens with ``adapter`` unmerged and merged, and one merge +
    unmerge, on the model's device; the model is left as it was (module docstring). Kept on the model per (adapter,
    batch size, graphs)."""
    _check_model(model, "measure_serving_costs")
    if adapter not in model.peft_config:
        raise ValueError(f"measure_serving_costs: no adapter named {adapter!r}; the model has "
                         f"{sorted(model.peft_config)}")
    validation.check_arguments("measure_serving_costs", batch_size=(batch_size, validation.positive_int()),
                               repeats=(repeats, validation.positive_int()))
    parameter = next(model.parameters())
    device = parameter.device
    if graphs and device.type != "cuda":
        raise ValueError("measure_serving_costs: graphs=True times CUDA graphs; the model is on "
                         f"{device}: pass graphs=False")
    key = (adapter, batch_size, graphs, device)
    cache = model.__dict__.setdefault("_sits_serving_costs", {})
    if key in cache:
        return cache[key]
    reason = why_not_mergeable(model, adapter)
    if reason is not None:
        raise ValueError(f"measure_serving_costs: adapter {adapter!r} cannot be merged: {reason}")
    merged_before, active_before, training = merged_adapters(model), list(model.active_adapters), model.training
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    ids = torch.randint(0, vocab, (batch_size, 1), device=device, generator=torch.Generator().manual_seed(0)
                        if device.type == "cpu" else None)
    model.eval()

    def merge_unmerge():
        model.merge_adapter([adapter])
        model.unmerge_adapter()

    with base_weights_kept(model, adapter, *merged_before):   # the timed merges' rounding undone, and ours
        try:
            if merged_before:
                model.unmerge_adapter()
            model.set_adapter(adapter)
            dispatch = time_ms(_step(model, ids, graphs), device, repeats)
            merge = time_ms(merge_unmerge, device, max(1, repeats // 2))
            model.merge_adapter([adapter])
            merged = time_ms(_step(model, ids, graphs), device, repeats)
            model.unmerge_adapter()
        finally:
            if len(active_before) == 1:
                model.set_adapter(active_before[0])
            else:
                model.base_model.set_adapter(active_before)
            for name in merged_before:
                model.merge_adapter([name])
            model.train(training)
    cache[key] = costs = ServingCosts(dispatch_ms=dispatch, merged_ms=merged, merge_ms=merge)
    return costs


def serving_plan(model: nn.Module, adapter_names: Union[str, Sequence[str]], new_tokens: int,
                 costs: Optional[ServingCosts] = None, graphs: bool = False, apply: bool = False) -> ServingPlan:
    """Whether a request whose samples take ``adapter_names`` (one name per sample, or one name for all;
    "__base__": no adapter) for ``new_tokens`` tokens should merge its adapter or dispatch (module docstring).
    ``costs``: measured elsewhere (default: :func:`measure_serving_costs` on this model, once, with ``graphs``).
    ``apply``: put the model in that state before returning."""
    _check_model(model, "serving_plan")
    names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"serving_plan: adapter_names must be an adapter name or a list of them (one per sample), "
                         f"got {adapter_names!r}")
    unknown = sorted({n for n in names if n != BASE and n not in model.peft_config})
    if unknown:
        raise ValueError(f"serving_plan: no adapter named {unknown}; the model has {sorted(model.peft_config)} "
                         f"(or {BASE!r} for none)")
    validation.check_arguments("serving_plan", new_tokens=(new_tokens, validation.positive_int()))
    distinct = list(dict.fromkeys(names))
    per_sample = names if len(names) > 1 else None
    if distinct == [BASE]:
        plan = ServingPlan(model, "base", None, None, "no sample takes an adapter: the base model, adapters off")
    elif len(distinct) > 1:
        plan = ServingPlan(model, "dispatch", None, per_sample,
                           f"{len(distinct)} different adapters (or none) in one batch: a merged model serves one; "
                           "the mixed batch runs them unmerged")
    else:
        adapter = distinct[0]
        reason = why_not_mergeable(model, adapter)
        if reason is not None:
            plan = ServingPlan(model, "dispatch", adapter, None, f"adapter {adapter!r} cannot be merged: {reason}")
        elif merged_adapters(model) == {adapter}:
            plan = ServingPlan(model, "merge", adapter, None, f"adapter {adapter!r} is merged already: nothing to pay")
        else:
            batch = len(names)
            costs = costs or measure_serving_costs(model, adapter, batch_size=batch, graphs=graphs)
            crossover = costs.crossover_tokens
            pays = new_tokens > crossover
            reason = (f"one adapter for {new_tokens} tokens: merging ({costs.merge_ms:.2f} ms with the unmerge) pays "
                      f"after {crossover:.0f} tokens (a step {costs.dispatch_ms:.3f} ms unmerged, {costs.merged_ms:.3f} "
                      "merged)" if crossover != float("inf") else
                      f"one adapter: a merged step ({costs.merged_ms:.3f} ms) is no faster than an unmerged one "
                      f"({costs.dispatch_ms:.3f} ms)")
            plan = ServingPlan(model, "merge" if pays else "dispatch", adapter, None,
                               reason if pays else reason.replace("pays after", "would pay only after"), costs)
    return plan.apply() if apply else plan


__all__ = ["ServingCosts", "ServingPlan", "measure_serving_costs", "serving_plan"]
