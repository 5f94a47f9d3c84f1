"""Merge or dispatch a denoiser's LoRA for a run of generations, from costs measured on this pipeline as it is set up.

An unmerged LoRA keeps the base weights intact (switching or scaling adapters costs nothing) and, eagerly or under
``graph_denoiser``, costs about nothing per image: the cross-attention to_k / to_v keep their outputs across the
steps of a generation, so the adapter's only other calls are small. Compiled (``compile_blocks``) every other LoRA
call is a few more small kernels in the graph, and with ``keep_cross_attention_kv=False`` the K / V are computed
every step as the base model's are: unmerged then cost more than merged (docs/diffusion.md, "Every block
compiled"). Merging costs a pass over every adapted weight, and the same again to unmerge. So::

    plan = sits_lora.diffusion.merge_plan(pipe, images=20, steps=30)   # after compile_blocks / graph_denoiser
    plan.action, plan.reason      # "merge", "20 images x 30 steps: merging (... ms with the unmerge) pays after ..."
    plan.apply()                  # merges (or unmerges, for "dispatch")

:func:`measure_denoiser_costs` times one denoiser call (a guided step: batch 2, the same text states every call, as
in a generation) unmerged and merged, and one merge + unmerge, on the pipeline in the state it is in: compiled
blocks and recorded graphs included (the first merged call compiles or records; the timer's warm-up takes it).
Merge before ``quantize_fp8``: a quantized base holds e4m3 codes, which a LoRA cannot be merged into.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..utils.merging import base_weights_kept, merged_adapters, time_ms, tuner_layers, why_not_mergeable
from ..utils import validation
from .reuse import denoiser_of


@dataclass(frozen=True)
class DenoiserCosts:
    """Measured milliseconds: one denoiser call with the adapter unmerged and merged, and one merge + unmerge."""

    unmerged_ms: float
    merged_ms: float
    merge_ms: float

    @property
    def crossover_calls(self) -> float:
        """Denoiser calls from which merging pays (inf when a merged call is no faster)."""
        saved = self.unmerged_ms - self.merged_ms
        return self.merge_ms / saved if saved > 0 else float("inf")


@dataclass
class DenoiserPlan:
    """What :func:`merge_plan` decided: ``action`` "merge" or "dispatch" for ``adapter``, why, and the costs it
    used (None when none were needed)."""

    model: nn.Module = field(repr=False)
    action: str
    adapter: str
    reason: str
    costs: Optional[DenoiserCosts] = None

    def apply(self) -> "DenoiserPlan":
        """Merge the adapter (unmerging any other first), or unmerge everything for a dispatch."""
        merged = merged_adapters(self.model)
        if self.action == "merge" and merged == {self.adapter}:
            return self
        if merged:
            _unmerge(self.model)
        if self.action == "merge":
            _merge(self.model, self.adapter)
        return self


def _merge(model: nn.Module, adapter: str) -> None:
    for layer in tuner_layers(model):
        if adapter in getattr(layer, "lora_A", {}):
            layer.merge(adapter_names=[adapter])


def _unmerge(model: nn.Module) -> None:
    for layer in tuner_layers(model):
        while layer.merged:
            layer.unmerge()


def _active_adapter(model: nn.Module, caller: str) -> str:
    layers = tuner_layers(model)
    if not layers:
        raise ValueError(f"{caller}: the denoiser has no adapter; add one first "
                         "(unet.add_adapter(SitsLoraConfig(...)) or pipe.load_lora_weights(...))")
    active = {a for layer in layers for a in layer.active_adapters if a in getattr(layer, "lora_A", {})}
    if len(active) != 1:
        raise ValueError(f"{caller}: {len(active)} adapters are active ({sorted(active)}); pass adapter= to plan "
                         "for one (a merged model holds one adapter's weights)")
    return active.pop()


def example_inputs(model: nn.Module, batch: int = 2, text_tokens: int = 77) -> dict:
    """Random inputs of one denoising call of a ``UNet2DConditionModel`` at its configured size: ``batch`` 2 is a
    step with classifier-free guidance. Other denoisers: pass the call's keyword arguments as ``inputs=``."""
    if type(model).__name__ != "UNet2DConditionModel":
        raise TypeError(f"example inputs are built for a UNet2DConditionModel only, not {type(model).__name__}: "
                        "pass one denoising call's keyword arguments as inputs=")
    config = model.config
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    size = config.sample_size if isinstance(config.sample_size, (tuple, list)) else (config.sample_size,) * 2
    if not isinstance(config.cross_attention_dim, int):
        raise TypeError(f"cross_attention_dim={config.cross_attention_dim!r} differs per block: pass inputs=")
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    inputs = dict(sample=randn(batch, config.in_channels, *size),
                  timestep=torch.full((batch,), 500, device=device),
                  encoder_hidden_states=randn(batch, text_tokens, config.cross_attention_dim))
    if config.addition_embed_type == "text_time":   # SDXL: pooled text embeddings and the six size / crop ids
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {"text_embeds": randn(batch, pooled), "time_ids": randn(batch, 6)}
    return inputs


def _check_adapter(model: nn.Module, adapter: str, caller: str) -> None:
    names = sorted({name for layer in tuner_layers(model) for name in getattr(layer, "lora_A", {})})
    if adapter not in names:
        raise ValueError(f"{caller}: the denoiser has no adapter named {adapter!r}; it has {names or 'none'}")


def measure_denoiser_costs(pipe_or_model, adapter: Optional[str] = None, inputs: Optional[dict] = None,
                           repeats: int = 5) -> DenoiserCosts:
    """Time one denoiser call with ``adapter`` (default: the active one) unmerged and merged, and one merge +
    unmerge, on the denoiser's device and in its current state (module docstring); the denoiser is left merged or
    not as it was. ``inputs``: one call's keyword arguments (default: :func:`example_inputs`)."""
    model = denoiser_of(pipe_or_model, "measure_denoiser_costs")
    adapter = adapter or _active_adapter(model, "measure_denoiser_costs")
    _check_adapter(model, adapter, "measure_denoiser_costs")   # else every layer is skipped: costs of nothing
    validation.check_arguments("measure_denoiser_costs", repeats=(repeats, validation.positive_int()))
    reason = why_not_mergeable(model, adapter)
    if reason is not None:
        raise ValueError(f"measure_denoiser_costs: adapter {adapter!r} cannot be merged: {reason} (merge before "
                         "quantize_fp8)")
    inputs = example_inputs(model) if inputs is None else inputs
    device = next(model.parameters()).device
    merged_before = merged_adapters(model)

    def call():
        with torch.no_grad():
            model(**inputs)

    def merge_unmerge():
        _merge(model, adapter)
        _unmerge(model)

    with base_weights_kept(model, adapter, *merged_before):   # the timed merges' rounding undone, and ours
        _unmerge(model)
        try:
            unmerged = time_ms(call, device, repeats)
            merge = time_ms(merge_unmerge, device, max(1, repeats // 2))
            _merge(model, adapter)
            merged = time_ms(call, device, repeats)
            _unmerge(model)
        finally:
            for name in merged_before:
                _merge(model, name)
    return DenoiserCosts(unmerged_ms=unmerged, merged_ms=merged, merge_ms=merge)


def merge_plan(pipe_or_model, images: int, steps: int = 30, adapter: Optional[str] = None,
               costs: Optional[DenoiserCosts] = None, inputs: Optional[dict] = None,
               apply: bool = False) -> DenoiserPlan:
    """Whether ``images`` generations of ``steps`` denoising steps each should run the adapter (default: the
    active one) merged or unmerged (module docstring). ``costs``: measured elsewhere (default:
    :func:`measure_denoiser_costs` now, with ``inputs``). ``apply``: put the denoiser in that state."""
    model = denoiser_of(pipe_or_model, "merge_plan")
    validation.check_arguments("merge_plan", images=(images, validation.positive_int()),
                               steps=(steps, validation.positive_int()))
    adapter = adapter or _active_adapter(model, "merge_plan")
    _check_adapter(model, adapter, "merge_plan")
    reason = why_not_mergeable(model, adapter)
    if reason is not None:
        plan = DenoiserPlan(model, "dispatch", adapter, f"adapter {adapter!r} cannot be merged: {reason} (merge "
                                                        "before quantize_fp8)")
    elif merged_adapters(model) == {adapter}:
        plan = DenoiserPlan(model, "merge", adapter, f"adapter {adapter!r} is merged already: nothing to pay")
    else:
        costs = costs or measure_denoiser_costs(model, adapter, inputs)
        calls, crossover = images * steps, costs.crossover_calls
        if crossover == float("inf"):
            why = (f"a merged call ({costs.merged_ms:.2f} ms) is no faster than an unmerged one "
                   f"({costs.unmerged_ms:.2f} ms)")
        else:
            why = (f"{images} images x {steps} steps: merging ({costs.merge_ms:.1f} ms with the unmerge) "
                   f"{'pays' if calls > crossover else 'would pay only'} after {crossover:.0f} denoiser calls (a call "
                   f"{costs.unmerged_ms:.2f} ms unmerged, {costs.merged_ms:.2f} merged)")
        plan = DenoiserPlan(model, "merge" if calls > crossover else "dispatch", adapter, why, costs)
    return plan.apply() if apply else plan


__all__ = ["DenoiserCosts", "DenoiserPlan", "example_inputs", "measure_denoiser_costs", "merge_plan"]
