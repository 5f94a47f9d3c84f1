"""What an adapted layer saves for backward, found by running it: the memory plan's probes (training.memory).

One forward of each distinct layer on 16 and 32 tokens under ``torch.autograd.graph.saved_tensors_hooks`` records
what it saves (its own input, which siblings share, or new tensors such as PEFT's fp32 copy of the input, the T x r
shrink output, a dropout mask), on the layer's device and under the training autocast, so the plan follows
whatever kernel the layer runs.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..utils.model_structure import base_layer_of, linear_dims


@dataclass
class LayerSaves:
    """What one adapted layer saves for backward: its input or not, plus a + b·T other bytes."""

    saves_input: bool
    const_bytes: float
    bytes_per_token: float
    probed: bool = True


def autocast_available(device_type: str) -> bool:
    check = getattr(torch.amp, "is_autocast_available", None)
    return bool(check(device_type)) if check is not None else device_type in ("cpu", "cuda")


def _sibling_layers(module: nn.Module) -> list[nn.Module]:
    """The layers that run together with ``module`` (sits_lora's sibling fusion), or just ``module``."""
    group = getattr(module, "sibling_group", None)
    layers = list(getattr(group, "layers", None) or [])
    return layers if module in layers else [module]


def _snapshot(obj) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(obj).items()}


def probe_layer(module: nn.Module, input_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype]) -> LayerSaves:
    """What ``module`` saves for backward, per layer; sibling layers (q / k / v under sits_lora's sibling
    fusion) are called together on one input, as the model calls them, and share the result equally.

    ``input_dtype`` is the dtype the layer receives in the model: the residual stream's, which is the
    weights' even under autocast (RMSNorm hands back its input dtype). With fp32 weights under bf16
    autocast the layer gets fp32, so sits_lora runs its reference path and each of q / k / v makes its
    own bf16 copy of the input; a probe fed bf16 would show neither."""
    layers = _sibling_layers(module)
    group = getattr(module, "sibling_group", None) if len(layers) > 1 else None
    group_state = _snapshot(group) if group is not None else None  # the probe must leave the group as it was
    # and the running amax an fp8 base records in training mode (the model's fp8 scaling state)
    states = {id(s): s for s in (getattr(getattr(layer, "frozen_base", None), "state", None) for layer in layers)
              if isinstance(s, nn.Module)}
    state_buffers = [(b, b.clone()) for s in states.values() for b in s.buffers()]
    d_in, _ = linear_dims(module)
    try:
        device = next(p.device for p in module.parameters())
    except StopIteration:
        device = torch.device("cpu")
    # Storages are compared by identity (_cdata), which also works for meta tensors (no data pointer).
    param_ptrs = {p.untyped_storage()._cdata for layer in layers for p in layer.parameters()}
    results = []
    was_training = [layer.training for layer in layers]
    for layer in layers:
        layer.train()
    try:
        fork_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=fork_devices):
            for tokens in (16, 32):
                x = torch.randn(1, tokens, d_in, device=device, dtype=input_dtype, requires_grad=True)
                x_ptr = x.untyped_storage()._cdata
                saved: dict[int, int] = {}
                saves_input = False

                def pack(t, saved=saved):
                    nonlocal saves_input
                    st = t.untyped_storage()
                    ptr = st._cdata
                    if ptr == x_ptr:
                        saves_input = True
                    elif ptr not in param_ptrs and st.nbytes():
                        saved[ptr] = st.nbytes()
                    return t

                autocast = (torch.autocast(device.type, dtype=autocast_dtype)
                            if autocast_dtype is not None and autocast_available(device.type)
                            else contextlib.nullcontext())
                # A probe is not training: what a layer warns about then (a dynamic-rank layer with no rank
                # budget attached yet, at train begin) would mislead; the real forward warns if it applies.
                with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    outs = [layer(x) for layer in layers]
                del outs
                results.append((tokens, saves_input, float(sum(saved.values())) / len(layers)))
    finally:
        for layer, mode in zip(layers, was_training):
            layer.train(mode)
        if group is not None:
            vars(group).clear()
            vars(group).update(group_state)
        with torch.no_grad():
            for buffer, value in state_buffers:
                buffer.copy_(value)
    (t1, in1, b1), (t2, in2, b2) = results
    per_token = max((b2 - b1) / (t2 - t1), 0.0)
    return LayerSaves(saves_input=in1 or in2, const_bytes=max(b1 - per_token * t1, 0.0), bytes_per_token=per_token)


def layer_key(module: nn.Module) -> tuple:
    siblings = _sibling_layers(module)
    if len(siblings) > 1:
        return ("siblings",) + tuple(_single_layer_key(layer) for layer in siblings)
    return _single_layer_key(module)


def _single_layer_key(module: nn.Module) -> tuple:
    d_in, d_out = linear_dims(module)
    trainable = tuple((tuple(p.shape), p.dtype) for p in module.parameters() if p.requires_grad)
    dropout = tuple(sorted((k, getattr(v, "p", 0.0)) for k, v in getattr(module, "lora_dropout", {}).items()))
    kernel = tuple(sorted(getattr(module, "sits_kernel", {}).items()))
    return (type(module), d_in, d_out, trainable, dropout, kernel, base_layer_of(module).weight.dtype)


__all__ = ["LayerSaves", "autocast_available", "layer_key", "probe_layer"]
