"""Sibling fusion: adapted layers of one parent that read the same input run as one operation.

q_proj / k_proj / v_proj read the same hidden states, and so do gate_proj / up_proj. The layers
stay separate modules (PEFT's state dict, merge and save are untouched); they share a
``SiblingGroup``. When the first of them is called with x, the group computes every sibling's
output in one ``LoraSiblingsFunction`` (one shrink pass over x, one saved x, one backward pass over
x for all dA, one dx) and hands the others their output when they are called with the same x.
This is done from the layers, not by patching the parent module, so it works for any model whose
parent calls its siblings on one tensor; when a sibling is called with another tensor (cross
attention, say), the group notices and the layers run one by one from then on. A diffusers cross-attention
module (``is_cross_attention``) groups only to_k / to_v, which read the text encoder's states.

Cross-attention K / V across denoising steps: every step of a diffusers pipeline hands to_k / to_v the same
``encoder_hidden_states`` tensor, so their outputs (base and LoRA) are the same every step. Without autograd
(``torch.no_grad``, as pipelines call the denoiser) a cross-attention group keeps its outputs and gives them back
while x is the same tensor, unchanged (its version counter), and the weights, LoRA scalings and active adapter are
the ones they were computed with: the first step pays, the others do not. ``reuse_across_calls=False`` turns it
off (``sits_lora.diffusion.reuse_cross_attention_kv``). Under ``torch.inference_mode`` nothing is kept: inference
tensors have no version counter to prove x unchanged.

Calls too small for the fused kernels' launches to pay (``sits_lora.ops.choice.small_call``) run each layer alone on
ATen matmuls (``sits_lora.ops.aten``); a cross-attention group still keeps their outputs across calls.

Eager mode only: under torch.compile each layer is one custom op and Inductor schedules them. The exception is a
cross-attention group told to keep its outputs under compile as well (``keep_under_compile``, set by
``sits_lora.diffusion.compile_blocks``): dynamo cannot trace the kept-outputs decision (tensor identity and version
counters), so each to_k / to_v call is one opaque operator (``sits_lora::kept_sibling_output``) whose body runs
the eager group, which answers from what it kept or computes and keeps. The operator returns a copy: what the group
keeps must outlive the graph, whose buffers inductor may reuse. No graph break: the block stays one graph, and
inductor fuses across the call (a break there split a diffusers transformer block into five graphs).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from .. import ops
from ..bases import autocast_inputs
from .forward_plan import dropout_active, plan_forward

SIBLING_NAME_SETS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
    ("to_q", "to_k", "to_v"),
    ("add_q_proj", "add_k_proj", "add_v_proj"),   # diffusers' joint attention (SD3, Flux): the text stream
    ("w1", "w3"),
)
# diffusers' cross-attention (Attention.is_cross_attention): to_q reads the image tokens, to_k / to_v the text
CROSS_ATTENTION_NAMES = ("to_k", "to_v")


def _version(t: Optional[torch.Tensor]) -> Optional[int]:
    """t's version counter; None for an inference tensor (torch.inference_mode), which has none."""
    return None if t is None or t.is_inference() else t._version


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b``, or a view of the same memory with the same layout: what a compiled graph may pass
    instead of the caller's tensor (the version counter is shared with it, and the kept reference keeps the memory
    from being handed to another tensor)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


# every group, for the kept-output operator: it finds its layer from the layer's base weight, a graph input.
# Operators take no Python objects, and a constant key per group would be baked into each compiled block's graph:
# no two blocks could share a compilation (SDXL's 70 transformer blocks passed dynamo's recompile limit and the rest
# ran eagerly).
_GROUPS: "weakref.WeakSet[SiblingGroup]" = weakref.WeakSet()
_BY_WEIGHT: "dict[int, weakref.ref]" = {}


def _layer_of(weight: torch.Tensor):
    """The grouped layer whose base weight is ``weight`` (its memory: a graph passes its own tensor object)."""
    ref = _BY_WEIGHT.get(weight.data_ptr())
    layer = None if ref is None else ref()
    if layer is not None and _same_tensor(layer.base_layer.weight, weight):
        return layer
    # a miss: weights moved (.to(device)) or groups made since; index every group's layers again
    _BY_WEIGHT.clear()
    found = []
    for group in list(_GROUPS):
        for other in group.layers:
            _BY_WEIGHT[other.base_layer.weight.data_ptr()] = weakref.ref(other)
            if _same_tensor(other.base_layer.weight, weight):
                found.append(other)
    if len(found) != 1:
        raise RuntimeError(
            f"sits_lora: a kept cross-attention output was asked for a base weight that {len(found)} grouped layers "
            "have (tied weights, or a layer no longer grouped); compile with keep_cross_attention_kv=False")
    return found[0]


class SiblingGroup:
    """Layers of one parent module that read the same input."""

    def __init__(self, layers: list, reuse_across_calls: bool = False) -> None:
        self.layers = layers
        self.out_features = sum(layer.out_features for layer in layers)  # the fused op's output width
        self.enabled = True
        self.reuse_across_calls = reuse_across_calls
        self.keep_under_compile = False
        self._pending_x: Optional[torch.Tensor] = None
        self._pending_version: Optional[int] = -1
        self._pending: dict[int, torch.Tensor] = {}
        self._pending_tag = None
        # what the outputs were computed from and the outputs, while they may be given back (the module doc):
        # (x, x's version, (tensor, version) of every weight, (adapter, scaling, training mode) per layer,
        # {id(layer): output}, the outputs' versions); a changed mode can turn dropout on, which the fused op refuses
        self._kept: Optional[tuple] = None
        _GROUPS.add(self)

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.deepcopy of a model or pipeline) or an unpickled group: findable by the operator as well
        self.__dict__.update(state)
        _GROUPS.add(self)

    def release(self) -> None:
        """Drop what the group keeps across calls (it holds x and the outputs until x changes)."""
        self._kept = None

    @property
    def kept(self) -> Optional[tuple]:
        """What the group keeps across calls (x first, then what its outputs were computed from, and the outputs), or
        None: a recording compares it by identity to see whether a call gave the kept outputs back."""
        return self._kept

    def _keep(self, x: torch.Tensor, plan, adapters: list, outputs) -> None:
        weights, biases, As, Bs, scalings = plan
        tensors = tuple(t for t in (*weights, *biases, *As, *Bs) if t is not None)
        by_layer = {id(layer): y for layer, y in zip(self.layers, outputs)}
        self._kept = (x, _version(x), tuple((t, _version(t)) for t in tensors),
                      tuple((a, float(s), layer.training) for layer, a, s in zip(self.layers, adapters, scalings)),
                      by_layer, tuple(_version(y) for y in outputs))

    def _kept_output(self, layer, x: torch.Tensor) -> Optional[torch.Tensor]:
        """layer's kept output when nothing it was computed from has changed since (cheap: a kept call is host
        time only, and a generation makes dozens a step)."""
        kept = self._kept
        if kept is None or not _same_tensor(x, kept[0]):
            return None
        kept_x, x_version, tensors, adapters, outputs, versions = kept
        valid = (_version(x) == x_version and all(_version(t) == v for t, v in tensors)
                 and all(other.active_adapter in (a, [a]) and other.scaling.get(a) == s and other.training == mode
                         for other, (a, s, mode) in zip(self.layers, adapters))
                 and all(_version(y) == v for y, v in zip(outputs.values(), versions)))
        if not valid:
            self._kept = None
            return None
        return outputs.get(id(layer))

    def _clear(self) -> None:
        self._pending_x, self._pending = None, {}

    def holds_output(self, layer, x: torch.Tensor) -> bool:
        """Whether the group already computed ``layer``'s output for ``x`` (a sibling ran first): the layer's
        call then only hands it over, and saves nothing for backward."""
        return self._pending_x is not None and _same_tensor(x, self._pending_x) and id(layer) in self._pending

    def handed_over(self, layer, x: torch.Tensor, tag=None) -> Optional[torch.Tensor]:
        """layer's output when a sibling's call computed it for this x (and ``tag``: what else the call depends on,
        a mixed batch's adapter names); None otherwise (and the group off for good when a sibling read another
        tensor: this parent does not feed its siblings one input)."""
        if not self._pending:
            return None
        key = id(layer)
        same = _same_tensor(x, self._pending_x)
        if same and _version(x) == self._pending_version and key in self._pending and tag == self._pending_tag:
            out = self._pending.pop(key)
            if not self._pending:
                self._clear()
            return out
        if not same:
            self.enabled = False
            self._clear()
        return None

    def hand_over(self, layer, x: torch.Tensor, outputs: list, tag=None) -> torch.Tensor:
        """layer's output of ``outputs`` (one a sibling); the others' kept for their calls with x (and ``tag``)."""
        self._pending_x, self._pending_version, self._pending_tag = x, _version(x), tag
        self._pending = {id(other): y for other, y in zip(self.layers, outputs) if other is not layer}
        return outputs[self.layers.index(layer)]

    def decode_forward(self, layer, x: torch.Tensor) -> Optional[torch.Tensor]:
        """layer's output of a decode call (``ops.decode_call``), every sibling's computed by one kernel
        (``ops.lora_linear_decode_siblings``), or None when a sibling cannot take that path (each layer then runs
        its own decode kernel or another path)."""
        if not self.enabled:
            return None
        out = self.handed_over(layer, x)
        if out is not None or not self.enabled:
            return out
        operands = []
        for other in self.layers:
            plan = plan_forward(other, x)
            if plan.kernel != "decode" or not plan.siblings:   # each sibling's own plan: the decode kernel
                return None
            operands.append(other.frozen_base.decode_operands(other, plan.adapter, x))
        projections = [found[1] for found in operands]
        if not ops.decode_siblings_fuse(projections):
            return None
        with operands[0][2]:
            outputs = ops.lora_linear_decode_siblings(operands[0][0], projections)
        return self.hand_over(layer, x, outputs)

    def forward(self, layer, x: torch.Tensor) -> Optional[torch.Tensor]:
        """layer's output through the group, or None when the layer must run on its own."""
        if not self.enabled:
            return None
        if torch.compiler.is_compiling():
            # not keeps_now(): dynamo cannot trace torch.is_inference_mode_enabled (a graph break of its own); the
            # eager group checks it, and under inference mode computes the outputs without keeping them
            if self.keep_under_compile and self.reuse_across_calls and not torch.is_grad_enabled():
                return kept_sibling_output(x, layer.base_layer.weight)
            return None
        out = self.handed_over(layer, x)
        if out is not None or not self.enabled:
            return out
        keep = self.keeps_now()
        if keep:
            out = self._kept_output(layer, x)
            if out is not None:
                return out
        requested = "auto" if all(k == "auto" for k in layer.sits_kernel.values()) else "triton"
        small = ops.small_call(requested, x, layer.in_features, self.out_features)
        if small and not keep:
            return None  # each layer runs alone on ATen matmuls (ops.aten): one shared pass over x saves nothing here
        adapters = []
        plan = self._plan(x, adapters)
        if plan is None:
            self._kept = None
            return None
        weights, biases, As, Bs, scalings = plan
        casts = [autocast_inputs(x, w, b) for w, b in zip(weights, biases)]
        x_in, autocast_off = casts[0][0], casts[0][3]
        with autocast_off:
            if small:   # kept across calls: the outputs are computed once, on the path for their size
                outputs = [ops.lora_linear_aten(x_in, x_in, c[1], c[2], A, B, scale)
                           for c, A, B, scale in zip(casts, As, Bs, scalings)]
            else:
                outputs = ops.lora_siblings_triton(x_in, [c[1] for c in casts], [c[2] for c in casts], As, Bs,
                                                   scalings)
        if keep:
            self._keep(x, plan, adapters, outputs)
            return outputs[self.layers.index(layer)]   # the others find their outputs kept
        return self.hand_over(layer, x, outputs)

    def keeps_now(self) -> bool:
        """Whether a call now may keep its outputs or answer from kept ones: reuse on, nothing to differentiate,
        not under inference mode (its tensors have no version counter)."""
        return self.reuse_across_calls and not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    def _plan(self, x: torch.Tensor, adapters: Optional[list] = None):
        """(weights, biases, As, Bs, scalings) when every sibling can take the fused path now; each layer's
        adapter appended to ``adapters`` when it is given."""
        weights, biases, As, Bs, scalings = [], [], [], [], []
        for layer in self.layers:
            # each sibling's own plan: the fused path on a base that fuses siblings (not a quantized one, not a
            # dynamic-rank adapter that routes: a per-token rank is not the static product here), on the kernels
            # (not the reference: a trainable base, fp32), without dropout (each would need its own mask of x)
            plan = plan_forward(layer, x)
            if not plan.siblings or plan.kernel not in ("triton", "aten") or dropout_active(layer, plan.adapter):
                return None
            adapter, base = plan.adapter, layer.base_layer
            if adapters is not None:
                adapters.append(adapter)
            weights.append(base.weight)
            biases.append(base.bias)
            As.append(layer.lora_A[adapter].weight)
            Bs.append(layer.lora_B[adapter].weight)
            scalings.append(layer.scaling[adapter])
        return weights, biases, As, Bs, scalings


@torch.library.custom_op("sits_lora::kept_sibling_output", mutates_args=())
def kept_sibling_output(x: torch.Tensor, base_weight: torch.Tensor) -> torch.Tensor:
    """The grouped layer with this base weight called with x, eagerly (its group answers from what it kept, or
    computes and keeps), as one operator a compiled graph calls without breaking; a copy, so that the graph owns
    its output and the group's kept tensor stays as it was."""
    return _layer_of(base_weight).forward(x).clone()


@kept_sibling_output.register_fake
def _kept_sibling_output_fake(x: torch.Tensor, base_weight: torch.Tensor) -> torch.Tensor:
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    return x.new_empty((*x.shape[:-1], base_weight.shape[0]), dtype=dtype)


def sibling_group_members(model: nn.Module) -> list:
    """The module names of each sibling group's layers (one list a group, in the group's order): the layers whose
    shrink and x pass run as one launch over their shared input, at their summed rank."""
    names = {id(module): name for name, module in model.named_modules()}
    groups: dict = {}
    for module in model.modules():
        group = getattr(module, "sibling_group", None)
        if isinstance(group, SiblingGroup) and id(group) not in groups:
            groups[id(group)] = [names[id(layer)] for layer in group.layers if id(layer) in names]
    return [members for members in groups.values() if len(members) > 1]


def assign_sibling_groups(model: nn.Module, layer_cls, enabled: bool = True) -> int:
    """Give sibling layers of ``layer_cls`` a shared SiblingGroup; return the number of groups."""
    groups = 0
    for parent in model.modules():
        children = dict(parent.named_children())
        cross = getattr(parent, "is_cross_attention", False) is True
        for names in SIBLING_NAME_SETS:
            if cross and names == ("to_q", "to_k", "to_v"):
                names = CROSS_ATTENTION_NAMES
            layers = [children[n] for n in names if isinstance(children.get(n), layer_cls)]
            for layer in layers:
                layer.sibling_group = None
            if not enabled or len(layers) < 2 or len({layer.in_features for layer in layers}) != 1:
                continue
            group = SiblingGroup(layers, reuse_across_calls=cross and names == CROSS_ATTENTION_NAMES)
            for layer in layers:
                layer.sibling_group = group
            groups += 1
    return groups
