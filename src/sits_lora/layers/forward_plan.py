"""How an adapted layer's forward runs: one decision, :func:`plan_forward`, from the layer's state and the call.

A SitsLoraLinear (or SitsLoraLinear4bit) asks ``plan_forward(layer, x, args, kwargs)`` and executes the answer;
the frozen bases (``sits_lora.bases``), the sibling groups, serving's mixed batches and the LoRA variants run
what it names and choose nothing. The paths, first match wins:

1. ``"fused"``: one active plain-LoRA adapter over a base the layer's ``frozen_base`` can run
   (``FusedAdapterChoice.fused_adapter``): the base product and the LoRA branch in one op of that base. The plan
   names the op's implementation (``kernel``): ``"decode"`` (a few rows, nothing to differentiate: one kernel,
   ``ops.decode``), ``"triton"`` (the fused kernels), ``"aten"`` (a call too small for the kernels' launches to
   pay, ``ops.aten``) or ``"torch"`` (the reference: CPU, fp32, a trainable base, a tensor past 32-bit offsets);
   None for a base with one implementation (fp8). ``siblings``: the layer's sibling group (q / k / v, gate / up)
   is asked first; it answers with one op for the whole group when every sibling can share it now, else the
   planned kernel runs for this layer alone.
2. ``"routed"``: an adapter whose variant routes (per-token dynamic rank) computes the whole output.
3. ``"mixed_batch"``: ``adapter_names`` given (a batch whose samples take different adapters): one segmented pass
   (``sits_lora.serving.mixed_batch``) when every named adapter is plain LoRA on the kernels, else PEFT's loop.
4. ``"peft"``: PEFT's own forward (disabled or merged adapters, several active adapters, DoRA and PEFT's other
   variants, a base module the user replaced or hooked).

``rebuild_input``: the layer's input is saved for backward as a rebuild from what the frozen model keeps
(``sits_lora.activations``), unless its sibling group already holds this call's output.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import ops


class ForwardPlan(NamedTuple):
    path: str                        # "fused", "mixed_batch", "routed" or "peft"
    adapter: Optional[str] = None    # "fused" / "routed": the adapter that runs
    kernel: Optional[str] = None     # "fused": "decode", "triton", "aten", "torch", or None (the base has one)
    siblings: bool = False           # "fused": ask the layer's sibling group first
    rebuild_input: bool = False


def _mixed_batch_call(args: tuple, kwargs: dict) -> bool:
    return (kwargs.get("adapter_names") is not None and not args
            and all(v is None for k, v in kwargs.items() if k != "adapter_names"))


def plan_forward(layer, x: torch.Tensor, args: tuple = (), kwargs: Optional[dict] = None) -> ForwardPlan:
    """The path of ``layer``'s forward for the call ``layer(x, *args, **kwargs)`` (module docstring).

    Raises what the call cannot do (a routed dynamic-rank adapter in a mixed batch or beside other active
    adapters) before anything runs."""
    kwargs = kwargs or {}
    group = layer.sibling_group
    rebuild = layer.input_recompute is not None and not (group is not None and group.holds_output(layer, x))
    adapter = layer.fused_adapter(args, kwargs)
    if adapter is None:
        routed = layer.routed_adapter(args, kwargs)
        if routed is not None:
            return ForwardPlan("routed", routed, rebuild_input=rebuild)
        return ForwardPlan("mixed_batch" if _mixed_batch_call(args, kwargs) else "peft", rebuild_input=rebuild)
    base = layer.frozen_base
    siblings = group is not None and base.fuses_siblings
    if not base.kernels:
        return ForwardPlan("fused", adapter, None, siblings, rebuild)
    # the fused op's implementation, from the adapter's SitsLoraConfig.kernel, the input and the base (one function
    # inline: this runs in every adapted layer's every call)
    requested = layer.sits_kernel[adapter]
    dtype = base.kernel_dtype(layer, x)
    kernel = ops.resolve_kernel(requested, x, layer.out_features, dtype)
    if kernel == "triton":
        if ("decode" in base.kernels and ops.decode_call(x, layer.in_features)
                and not (siblings and group.reuse_across_calls)   # a group answering from kept outputs
                and not dropout_active(layer, adapter) and base.decodes(layer, x, dtype)):
            kernel = "decode"
        elif base.trains_weight(layer):
            kernel = "torch"   # the fused kernels assume a frozen base (no dW / db); the reference computes them
        elif "aten" in base.kernels and ops.small_call(requested, x, layer.in_features, layer.out_features):
            kernel = "aten"    # too small for the kernels' launches to pay (ops.aten)
    return ForwardPlan("fused", adapter, kernel, siblings, rebuild)


def dropout_active(layer, adapter: str) -> bool:
    """Whether the adapter's LoRA dropout changes its input in this call (training, p > 0)."""
    dropout = layer.lora_dropout[adapter]
    return isinstance(dropout, torch.nn.Dropout) and dropout.training and dropout.p > 0
