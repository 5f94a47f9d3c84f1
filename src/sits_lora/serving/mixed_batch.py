"""A sits_lora layer's forward for a batch whose samples take different adapters (PEFT's ``adapter_names``).

The layer asks :func:`mixed_batch_forward` first; it answers None (PEFT's own mixed-batch loop runs, as before)
unless every adapter the batch names is plain LoRA on this layer (no DoRA or other variant, no LoRA bias, not
merged), the base is a plain ``nn.Linear`` and the input resolves to the Triton kernels (``SitsLoraConfig.kernel``:
a CUDA GPU in bf16 / fp16, or the interpreter under kernel="triton"). Then the base layer runs once and
``sits_lora.ops.mixed_batch`` adds every sample's adapter in one segmented shrink and one segmented expand; a
decode step's few rows (``ops.decode_call``) run the base product and every row's adapter as one kernel
(``ops.lora_linear_decode_mixed``).

Two things are made once and reused: the adapters' stacked A / B per layer (made again when an adapter is added or
removed, or a weight is written: their version counters), and the batch's row plan, per adapter names, shared by
every layer whose adapters are stacked in the same order (a model's layers all are, as a rule). A stack made again
in the same shape is written into the old one's memory, so that a CUDA graph recorded over this layer
(``sits_lora.serving.graphs``) reads the new weights once an eager call (a prefill) has refreshed them;
:func:`buffers_in_use` names what such a recording must keep alive.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from .. import ops
from ..utils.cast_copies import source_key, written_into

_PLANS: "OrderedDict[tuple, object]" = OrderedDict()
_MAX_PLANS = 32      # a generation makes one plan per prompt length and one for decoding: a few per request


def _plan(sample_adapter: tuple, rows_per_sample: int, device: torch.device):
    key = (sample_adapter, rows_per_sample, device)
    plan = _PLANS.get(key)
    if plan is None:
        from ..ops.mixed_batch import mixed_batch_plan

        plan = _PLANS[key] = mixed_batch_plan(sample_adapter, rows_per_sample, device)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def _stacks(layer, adapters: tuple, dtype: Optional[torch.dtype] = None):
    """(A, B, scalings) of ``adapters`` stacked, in the adapters' dtype or cast to ``dtype``; every copy is made
    again (in its old memory where the shape holds) when an adapter's weights or scaling changed, whichever copy the
    call asks for: an eager call that takes one path refreshes what a recorded call on the other path reads."""
    weights = [(layer.lora_A[a].weight, layer.lora_B[a].weight) for a in adapters]
    key = (adapters, source_key(tuple(t for pair in weights for t in pair)), tuple(layer.scaling[a] for a in adapters))
    cached = layer.__dict__.get("_mixed_batch_stacks")
    if cached is None or cached[0] != key:
        from ..ops.mixed_batch import stack_adapters

        copies = {} if cached is None else cached[1]
        with torch.no_grad():
            stacked = stack_adapters([a for a, _ in weights], [b for _, b in weights],
                                     [layer.scaling[a] for a in adapters])
            for cast in set(copies) | {None}:
                copies[cast] = written_into(copies.get(cast), _cast(stacked, cast))
        cached = (key, copies)
        layer.__dict__["_mixed_batch_stacks"] = cached   # not a buffer: no state dict entry, no .to()
    copies = cached[1]
    if dtype not in copies:
        with torch.no_grad():
            copies[dtype] = _cast(copies[None], dtype)
    return copies[dtype]


def _cast(stacked: tuple, dtype: Optional[torch.dtype]) -> tuple:
    A, B, scalings = stacked
    return stacked if dtype is None else (A.to(dtype), B.to(dtype), scalings)   # the scalings stay fp32


def buffers_in_use(layers) -> list:
    """The row plans and the ``layers``' stacks the mixed-batch path holds now: a CUDA graph recorded over these
    layers reads them, so it keeps them alive (a plan dropped from the cache or a stack made in another shape would
    otherwise free memory the graph still reads)."""
    return list(_PLANS.values()) + [stacks for layer in layers if "_mixed_batch_stacks" in layer.__dict__
                                    for stacks in layer.__dict__["_mixed_batch_stacks"][1].values()]


def _route(layer, x: torch.Tensor, adapter_names: list) -> Optional[tuple]:
    """How the layer's mixed-batch call runs: None (PEFT's loop: module docstring), ("base",) (no adapter of this
    layer named), ("decode", (W, b, A, B, scalings), row_adapter) for a decode step's one kernel (the stacks cast to
    the activations' dtype), or ("segmented", A, B, scalings, plan)."""
    base = layer.base_layer
    if (layer.merged or layer.disable_adapters or layer.training or layer.fan_in_fan_out
            or type(base) is not nn.Linear or base._forward_hooks or base._forward_pre_hooks):
        return None
    named = tuple(dict.fromkeys(a for a in adapter_names if a in layer.lora_A))   # this layer's, in batch order
    if any(a in layer.lora_variant or layer.lora_bias[a] for a in named):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(
            layer.lora_A[a].weight.requires_grad or layer.lora_B[a].weight.requires_grad for a in named)):
        return None   # the kernels have no backward: a call that may be differentiated takes PEFT's loop
    if x.dim() < 2 or x.shape[0] != len(adapter_names):
        return None
    rows_per_sample = x.numel() // x.shape[-1] // len(adapter_names)
    requested = "auto" if all(layer.sits_kernel.get(a, "auto") == "auto" for a in named) else "triton"
    if ops.resolve_kernel(requested, x, layer.out_features) != "triton":
        return None
    if not named:
        return ("base",)
    order = tuple(sorted(named))          # the stack order: the same in every layer that has these adapters
    index = {a: g for g, a in enumerate(order)}
    plan = _plan(tuple(index.get(a, -1) for a in adapter_names), rows_per_sample, x.device)
    if ops.decode_call(x, layer.in_features) and base.weight.dtype == x.dtype:
        # a decode step's few rows: the base product and every row's adapter in one kernel (ops.decode). The
        # stacks cast to the activations' dtype, which the kernel casts each tile to anyway: the same outputs,
        # and half the bytes of fp32 adapters that every program of the kernel reads (all G adapters' A)
        return ("decode", (base.weight, base.bias, *_stacks(layer, order, x.dtype)), plan.row_adapter)
    return ("segmented", *_stacks(layer, order), plan)


def _decode_siblings(layer, x: torch.Tensor, adapter_names: list, route: tuple) -> Optional[torch.Tensor]:
    """layer's output of a mixed decode step with its sibling group's (q / k / v, gate / up) from one kernel
    (``ops.lora_linear_decode_mixed_siblings``), or None when a sibling cannot share it."""
    group = layer.sibling_group
    if group is None or group.reuse_across_calls or not group.enabled or torch.compiler.is_compiling():
        return None
    tag = tuple(adapter_names)
    projections = []
    for other in group.layers:
        found = route if other is layer else _route(other, x, adapter_names)
        # the same row plan (the same adapters in the same order) and stacks of one shape
        if found is None or found[0] != "decode" or found[2] is not route[2] or (
                found[1][2].shape != route[1][2].shape):
            return None
        projections.append(found[1])
    flat = [(w, b, A.reshape(-1, A.shape[-1]), B.permute(1, 0, 2).reshape(B.shape[1], -1), s)
            for w, b, A, B, s in projections]
    if not ops.decode_siblings_fuse(flat):
        return None
    return group.hand_over(layer, x, ops.lora_linear_decode_mixed_siblings(x, projections, route[2]), tag)


def mixed_batch_forward(layer, x: torch.Tensor, adapter_names: list) -> Optional[torch.Tensor]:
    """The layer's output for samples x[b] taking adapter ``adapter_names[b]`` ("__base__": none), or None when
    PEFT's loop must run it (module docstring). A decode step runs the layer's sibling group (q / k / v, gate / up)
    as one kernel where every sibling can take it."""
    group = layer.sibling_group
    if group is not None and group.enabled and not group.reuse_across_calls:
        out = group.handed_over(layer, x, tuple(adapter_names))   # a sibling's call computed it: nothing to route
        if out is not None:
            return out
    route = _route(layer, x, adapter_names)
    if route is None:
        return None
    if route[0] == "base":
        return layer.base_layer(x)
    if route[0] == "decode":
        out = _decode_siblings(layer, x, adapter_names, route)
        if out is not None:
            return out
        (weight, bias, A, B, scalings), row_adapter = route[1], route[2]
        return ops.lora_linear_decode_mixed(x, weight, bias, A, B, scalings, row_adapter)
    _, A, B, scalings, plan = route
    y = layer.base_layer(x)
    from ..ops.mixed_batch import lora_mixed_batch_triton

    lora_mixed_batch_triton(x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]), A, B, scalings, plan)
    return y
