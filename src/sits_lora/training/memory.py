"""Memory plan of a LoRA training step: what the device holds at the peak, by part.

The cost model (every number is bytes; T = batch_size x seq_len tokens, h hidden size, I MLP
size, V vocabulary, H / KV query / key-value heads of size d, a the activation element size):

- frozen weights, adapters: the parameters as they are (tied weights once; under FSDP2 or ZeRO-3 the rank's
  shards, plus the parameters outside the decoder layers and two decoder layers gathered whole at the peak); 4-bit
  bases (sits_lora's INT4, bitsandbytes under SitsLoraLinear4bit) add one dequantization buffer of the largest such
  layer's W.
- optimizer states: AdamW keeps 2 tensors per trainable parameter (8-bit AdamW 2 bytes, SGD none).
- adapter gradients: made during backward, after the peak, and set to None by ``zero_grad``; they
  are at the peak only with gradient accumulation (they live through the next forward).
- activations, per decoder layer, what autograd saves for backward:
    every RMSNorm upcasts its input to fp32 and saves it (4·T·h); Liger's keeps its input as it is and
    the fp32 1/rms (a·T·h + 4·T);
    attention (sdpa / flash) saves q, k, v (k, v at KV heads: transformers passes enable_gqa to
    sdpa when there is no padding mask) and its output (a·T·H·d), plus the fp32 log-sum-exp;
    eager attention saves q and K/V repeated to H heads and the T x S probabilities twice (fp32 and a);
    the gated MLP saves the gate output, its activation and the up output (3·a·T·I; Liger's fused
    SiLU·mul the gate and up outputs, 2·a·T·I);
    each adapted layer saves what a probe of that very layer shows (below); layers that read the
    same tensor (q / k / v, gate / up) share one saved input; o_proj's input is a contiguous copy of
    the attention output. With ``recompute_lora_inputs`` (sits_lora.activations) an input is not saved
    where the frozen block keeps what it is made from: q/k/v (not in the first block unless the
    embeddings pass a gradient) and gate/up when the norm keeps its input (Liger's, or an fp32 residual
    stream), o_proj's under sdpa / flash, down_proj's always.
  A checkpointed layer keeps only its input (a·T·h); during backward one layer is recomputed at a
  time.
- logits and loss: transformers upcasts the logits to fp32 for the cross-entropy; at the start of
  backward the saved log-softmax, its incoming gradient and the gradient it produces are three
  fp32 T x V buffers (12·T·V), on top of every saved activation: that is the peak. Liger's fused
  linear cross-entropy holds its input's gradient (a·T·h) and one chunk of about T x h logits instead;
  sits_lora's (``ops.linear_cross_entropy``, the loss of the recorded default step) the same gradient and one
  chunk of logits as ``chunk_rows_for`` cuts it.

Adapted layers are probed, not assumed: one forward of each distinct layer on 16 and 32 tokens
under ``torch.autograd.graph.saved_tensors_hooks`` records what it saves for backward (its own
input, which siblings share, or new tensors such as PEFT's fp32 copy of the input, the T x r
shrink output, a dropout mask), on the layer's device and under the training autocast. So the plan
follows whatever kernel the layer runs (PEFT's, sits_lora's reference or Triton).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from ..utils.units import GIB
from ..activations.offload import offloads_activations, offloads_checkpoints
from ..activations.selective import is_selective
from ..activations.tiled_mlp import mlp_tile_tokens as mlp_tile_tokens_of
from ..bases.int4 import Int4BaseLinear
from ..ops.cross_entropy import chunk_rows_for
from ..utils.cuda_graphs import cublas_workspace_bytes
from ..utils.model_structure import decoder_layers, stored_bytes, text_config, unwrap_model  # noqa: F401 (re-exported)


OPTIMIZERS = ("adamw", "adamw_8bit", "adafactor", "sgd", "sgd_momentum", "lion", "none")
# Optimizer state bytes per byte of trainable parameter (8-bit Adam: two 1-byte states per fp32
# (4-byte) parameter).
_STATE_PER_PARAM_BYTE = {"adamw": 2.0, "adamw_8bit": 0.5, "sgd": 0.0, "sgd_momentum": 1.0, "lion": 1.0, "none": 0.0}

_ATTN_IN = ("q_proj", "k_proj", "v_proj")
_MLP_IN = ("gate_proj", "up_proj")


def _from_liger(module: Optional[nn.Module]) -> bool:
    """Whether ``module``'s forward is Liger-Kernel's (its class, or a forward Liger bound to a loaded model)."""
    if module is None:
        return False
    forward = getattr(module, "forward", None)
    return getattr(getattr(forward, "__func__", forward), "__module__", "").startswith("liger_kernel")


def _inputs_require_grad(model: nn.Module) -> bool:
    """Whether the first decoder layer's input needs a gradient (trainable embeddings, or transformers' /
    PEFT's ``enable_input_require_grads``), so that its norm keeps that input for backward."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if embeddings is None:
        return False
    if any(p.requires_grad for p in embeddings.parameters()):
        return True
    return any(getattr(hook, "__name__", "") == "make_inputs_require_grads" for hook in embeddings._forward_hooks.values())


class UnsupportedModelError(ValueError):
    """plan_memory has no activation model for this architecture."""


@dataclass
class MemoryPlan:
    """Bytes the device holds at the peak of a training step, by part (see the module docstring)."""

    batch_size: int
    seq_len: int
    frozen_weights: int
    adapter_weights: int
    adapter_grads: int
    optimizer_states: int
    activations: int
    logits_and_loss: int
    total: int
    optimizer: str
    gradient_checkpointing: str
    activation_dtype: str
    layers: int
    activations_per_layer: int
    grads_at_peak: bool
    notes: list[str] = field(default_factory=list)
    # pinned host memory the offloaded checkpoints take (not part of ``total``, which is the device's)
    host_offload: int = 0
    # which cross-entropy the plan holds: "model" (the logits in fp32), "liger" or "fused" (sits_lora's)
    loss: str = "model"
    # what recording the step as CUDA graphs adds (its streams' cuBLAS workspaces): part of ``total``
    recording: int = 0

    @property
    def loss_note(self) -> str:
        return {"model": "  (fp32 cross-entropy buffers)", "liger": "  (Liger's fused linear cross-entropy)",
                "fused": "  (sits_lora's fused linear cross-entropy)"}.get(self.loss, "")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["total_gib"] = self.total / GIB
        return d

    def gib(self, part: str) -> float:
        return getattr(self, part) / GIB

    def table(self) -> str:
        """An aligned table of the parts and the total, in GiB."""
        grads_note = "" if self.grads_at_peak else "  (not at the peak: made during backward)"
        rows = [
            ("frozen weights", self.frozen_weights, ""),
            ("adapters", self.adapter_weights, ""),
            ("adapter gradients", self.adapter_grads, grads_note),
            ("optimizer states", self.optimizer_states, f"  ({self.optimizer})"),
            ("activations", self.activations,
             f"  ({self.layers} layers, {format_bytes(self.activations_per_layer)} each without checkpointing; "
             f"checkpointing: {self.gradient_checkpointing})"),
            ("logits and loss", self.logits_and_loss, self.loss_note),
            *([("recording", self.recording, "  (cuBLAS workspaces of its warm-up and capture streams)")]
              if self.recording else []),
            ("total at peak", self.total, ""),
        ]
        if self.host_offload:
            rows.append(("pinned host memory", self.host_offload, "  (offloaded layer inputs; not in the total)"))
        head = (f"  memory plan: batch {self.batch_size} x seq {self.seq_len} = {self.batch_size * self.seq_len} "
                f"tokens, activations in {self.activation_dtype}")
        width = max(len(r[0]) for r in rows)
        return "\n".join([head] + [f"  {name:<{width}}  {format_bytes(value):>10}{note}" for name, value, note in rows])


def format_bytes(n: float) -> str:
    """GiB above 1 GiB, MiB below (the tiny test models plan a few MiB)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.2f} MiB"


# ----------------------------------------------------------------------------- model structure


def base_layer_of(module: nn.Module) -> nn.Module:
    get = getattr(module, "get_base_layer", None)
    return get() if callable(get) else module


def linear_dims(module: nn.Module) -> tuple[int, int]:
    base = base_layer_of(module)
    if hasattr(base, "in_features"):
        return int(base.in_features), int(base.out_features)
    weight = base.weight
    return int(weight.shape[1]), int(weight.shape[0])


def is_adapted(module: nn.Module) -> bool:
    """A PEFT tuner layer (it has a base layer) with trainable parameters."""
    return callable(getattr(module, "get_base_layer", None)) and any(p.requires_grad for p in module.parameters())


def checkpointed_layers(model: nn.Module) -> int:
    """How many decoder blocks of ``model`` run under gradient checkpointing now."""
    _, blocks = decoder_layers(unwrap_model(model))
    return sum(1 for b in blocks if getattr(b, "gradient_checkpointing", False) is True)


# ----------------------------------------------------------------------------- probing adapted layers


@dataclass
class LayerSaves:
    """What one adapted layer saves for backward: its input or not, plus a + b·T other bytes."""

    saves_input: bool
    const_bytes: float
    bytes_per_token: float
    probed: bool = True


def _autocast_available(device_type: str) -> bool:
    check = getattr(torch.amp, "is_autocast_available", None)
    return bool(check(device_type)) if check is not None else device_type in ("cpu", "cuda")


def _sibling_layers(module: nn.Module) -> list[nn.Module]:
    """The layers that run together with ``module`` (sits_lora's sibling fusion), or just ``module``."""
    group = getattr(module, "_sibling_group", None)
    layers = list(getattr(group, "layers", None) or [])
    return layers if module in layers else [module]


def _snapshot(obj) -> dict:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(obj).items()}


def _probe_layer(module: nn.Module, input_dtype: torch.dtype, autocast_dtype: Optional[torch.dtype]) -> LayerSaves:
    """What ``module`` saves for backward, per layer; sibling layers (q / k / v under sits_lora's sibling
    fusion) are called together on one input, as the model calls them, and share the result equally.

    ``input_dtype`` is the dtype the layer receives in the model: the residual stream's, which is the
    weights' even under autocast (RMSNorm hands back its input dtype). With fp32 weights under bf16
    autocast the layer gets fp32, so sits_lora runs its reference path and each of q / k / v makes its
    own bf16 copy of the input; a probe fed bf16 would show neither."""
    layers = _sibling_layers(module)
    group = getattr(module, "_sibling_group", None) if len(layers) > 1 else None
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
                            if autocast_dtype is not None and _autocast_available(device.type)
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


def _layer_key(module: nn.Module) -> tuple:
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


# ----------------------------------------------------------------------------- the plan


def _local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter sharded by FSDP2 (a DTensor) or partitioned by DeepSpeed ZeRO-3 (its
    ``ds_tensor``; the parameter itself is then an empty placeholder), or the tensor itself."""
    partition = getattr(t, "ds_tensor", None)
    if partition is not None:
        return partition
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t).__name__ == "DTensor" else t


def _is_sharded(t: torch.Tensor) -> bool:
    return _local_shard(t) is not t


def _whole_bytes(t: torch.Tensor) -> int:
    """A parameter's bytes gathered whole (ZeRO-3 keeps the whole count in ``ds_numel``)."""
    return int(getattr(t, "ds_numel", None) or t.numel()) * t.element_size()


def _held_bytes(p: torch.Tensor, local: torch.Tensor) -> int:
    """What a rank holds of ``p`` between gathers: its shard (``local``); ZeRO-3 also keeps a parameter below
    ``stage3_param_persistence_threshold`` (LoRA factors, norms) whole on every rank from the first forward on,
    beside its partition."""
    # a 4-bit weight's quantization state included; a ZeRO-Offload partition lives in host memory, not counted
    size = stored_bytes(local) if local.device == p.device else 0
    if getattr(p, "ds_persist", False):
        size += _whole_bytes(p)
    return size


def _fsdp_gathered_bytes(model: nn.Module, blocks: Sequence[nn.Module]) -> int:
    """Bytes FSDP2 (or ZeRO-3) adds to a rank's shards at the step's peak (the start of backward): the root's
    parameters (those outside the decoder layers: embeddings, final norm, the head, which the loss still needs) and
    two decoder layers (the one running backward and the next one, prefetched) gathered whole into buffers of their
    own, the shards staying. 0 when nothing is sharded. ZeRO-3 gathers by buckets: it may keep more live
    (``stage3_max_live_parameters``), and it releases a frozen input embedding after its forward (counted here)."""
    def extra(params) -> int:
        return sum(_whole_bytes(p) for p in params if _is_sharded(p) and not getattr(p, "ds_persist", False))

    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = extra(p for p in model.parameters() if id(p) not in in_blocks)
    per_block = sorted((extra(block.parameters()) for block in blocks), reverse=True)
    return root + sum(per_block[:2])


def _optimizer_bytes(optimizer: str, trainable: list[nn.Parameter]) -> int:
    if optimizer == "adafactor":
        # Factored second moment: a row and a column vector per matrix, a full one for vectors.
        total = 0
        for p in trainable:
            total += (p.shape[0] + p.shape[1]) * 4 if p.dim() == 2 else p.numel() * 4
        return total
    factor = _STATE_PER_PARAM_BYTE[optimizer]
    if optimizer == "adamw_8bit":
        return int(sum(p.numel() * 2 for p in trainable))
    return int(sum(p.numel() * p.element_size() for p in trainable) * factor)


def _check_args(batch_size, seq_len, optimizer, gradient_accumulation_steps):
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"plan_memory: {name}={value!r} is invalid: it must be a positive integer.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"plan_memory: optimizer={optimizer!r} is invalid: allowed values are "
                         f"{', '.join(map(repr, OPTIMIZERS))}.")


def _modelled_layers(inner: nn.Module) -> tuple:
    """(config, decoder blocks, the first block, its self_attn, its mlp), or UnsupportedModelError where the model
    has no decoder blocks with self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj."""
    config = text_config(inner)
    _, blocks = decoder_layers(inner)
    if not blocks or config is None:
        raise UnsupportedModelError(
            f"plan_memory: {type(inner).__name__} has no list of decoder layers and config; it models transformers "
            f"decoder models (Llama, Mistral, Qwen2 and similar)."
        )
    first = blocks[0]
    attn = getattr(first, "self_attn", None)
    mlp = getattr(first, "mlp", None)
    missing = [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attn, n)]
    missing += [f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj") if not hasattr(mlp, n)]
    if missing:
        raise UnsupportedModelError(
            f"plan_memory: the decoder layers of {type(inner).__name__} ({type(first).__name__}) have no "
            f"{', '.join(missing)}; it models layers with self_attn.{{q,k,v,o}}_proj and mlp.{{gate,up,down}}_proj "
            f"(Llama, Mistral, Qwen2 and similar)."
        )
    return config, blocks, first, attn, mlp


def _parameter_bytes(inner: nn.Module, blocks: Sequence[nn.Module], notes: list) -> tuple:
    """(frozen bytes, adapter bytes, the trainable tensors as this rank holds them): tied parameters once, the rank's
    shards under FSDP2 / ZeRO-3 with what they gather at the peak, and the 4-bit bases' dequantization buffers."""
    # Parameters, tied ones once; under FSDP2 (fully_shard) or ZeRO-3 the rank's own shards (ZeRO-3's are views
    # into one flat buffer: a tensor is its storage and its place in it).
    seen: set[tuple[int, int]] = set()
    frozen = adapters = 0
    trainable: list[torch.Tensor] = []
    for p in list(inner.parameters()) + list(inner.buffers()):
        local = _local_shard(p)
        place = (local.untyped_storage()._cdata, local.storage_offset())
        if place in seen:
            continue
        seen.add(place)
        size = _held_bytes(p, local)
        if isinstance(p, nn.Parameter) and p.requires_grad:
            adapters += size
            trainable.append(local)
        else:
            frozen += size
    gathered = _fsdp_gathered_bytes(inner, blocks)
    if gathered:
        frozen += gathered
        notes.append(f"FSDP2 / ZeRO-3: each rank holds its shards of the parameters; at the peak the parameters outside the "
                     f"decoder layers and two decoder layers (the one running, the one prefetched) are gathered "
                     f"whole: {format_bytes(gathered)} more, counted in the frozen weights")
    # INT4 bases hold packed codes (counted above) and dequantize into one buffer per device, the size of the
    # largest such layer's W, for the GEMM of a training batch (sits_lora.ops.int4_linear)
    dequant_buffer = max((m.in_features * m.out_features * m.weight_scales.element_size()
                          for m in inner.modules() if isinstance(m, Int4BaseLinear)), default=0)
    # the same for the bitsandbytes 4-bit bases of SitsLoraLinear4bit layers (W in the dtype it was quantized from),
    # and a buffer of its own, one byte a value, for those that form W in e4m3 for fp8 GEMMs (a buffer per dtype)
    bnb4 = [m for m in inner.modules() if type(m).__name__ == "SitsLoraLinear4bit"]
    dequant_buffer = max([dequant_buffer] + [
        m.in_features * m.out_features * m.get_base_layer().weight.quant_state.dtype.itemsize
        for m in bnb4 if not hasattr(m.frozen_base, "w_inv")])
    dequant_buffer += max([0] + [m.in_features * m.out_features for m in bnb4 if hasattr(m.frozen_base, "w_inv")])
    frozen += dequant_buffer
    devices = {p.device for p in inner.parameters() if p.device.type != "meta"}
    if len(devices) > 1:
        notes.append(f"the parameters span {len(devices)} devices ({', '.join(sorted(map(str, devices)))}): the plan "
                     f"is their sum, not the peak of one device")
    return frozen, adapters, trainable


def _loss_and_transient(fused_loss: bool, liger_loss: bool, tile: Optional[int], a: int, T: int, h: int, V: int,
                        I: int) -> tuple:
    """(bytes the loss holds at the start of backward, bytes one layer's backward holds at once) for T tokens, hidden
    size h, vocabulary V, MLP size I, activations of a bytes; ``tile``: the MLP's tile when it runs in tiles."""
    if fused_loss:
        # sits_lora's fused linear cross-entropy never holds the T x V logits: it computes the gradient of its
        # input in forward (T x h, kept for backward) one chunk of logits at a time
        loss = a * T * h + a * chunk_rows_for(T, V, h, a) * V + 4 * T
    elif liger_loss:
        # Liger's does the same with chunks of about T x h logits
        rows = -(-T // -(-V // h))
        chunk = min(1 << (rows - 1).bit_length(), T)
        loss = a * T * h + a * chunk * V + 4 * T
    else:
        loss = 12.0 * T * V
    if liger_loss:
        # Liger's SwiGLU backward writes its gradients over the saved gate and up: one T x I gradient and a few
        # T x h ones at a time
        transient = a * T * I + 3 * a * T * h
    else:
        # One layer's backward holds about four T x I tensors of gradients at once (of the MLP output,
        # the activation, the up projection, and the down projection's input): fitted to the peaks a
        # tensor tracker measured on the CPU. Under checkpointing the layer's recomputed saves add to it.
        transient = 4 * a * T * I
    if tile is not None:
        # one tile's gate, up, product and their gradients, the T x h input gradient being filled, and the
        # attention's backward (dq, dk, dv) that now outweighs the MLP's
        transient = 6 * a * tile * I + 3 * a * T * h
    return loss, transient


def plan_memory(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    *,
    gradient_checkpointing: Optional[bool] = None,
    optimizer: str = "adamw",
    autocast_dtype: Optional[torch.dtype] = None,
    gradient_accumulation_steps: int = 1,
    padded: bool = False,
    activation_offload: Optional[bool] = None,
    recompute_lora_inputs: Optional[bool] = None,
    liger: Optional[bool] = None,
    mlp_tile_tokens: Optional[int] = None,
    offloaded_layers: Optional[Sequence[int]] = None,
    fused_loss: bool = False,
    recorded: bool = False,
) -> MemoryPlan:
    """Predict the peak device memory of one LoRA training step of ``model`` (see the module docstring).

    Args:
        model: a transformers decoder model, plain or wrapped by PEFT / sits_lora, on its training device.
        batch_size, seq_len: sequences per micro-batch and tokens per sequence.
        gradient_checkpointing: None reads it from the model (``model.gradient_checkpointing_enable()``,
            or the Trainer's ``gradient_checkpointing=True``, sets it on the decoder layers); True / False
            override it for every layer.
        optimizer: one of "adamw", "adamw_8bit", "adafactor", "sgd", "sgd_momentum", "lion", "none".
        autocast_dtype: the dtype of mixed-precision autocast (``TrainingArguments(bf16=True)`` runs the
            forward under bf16 autocast), None without autocast.
        gradient_accumulation_steps: above 1 the gradients live through the next forward, so they count.
        padded: batches carry a padding mask; sdpa then repeats K/V to every query head.
        activation_offload: checkpointed layer inputs live in host memory (sits_lora's
            ``enable_offloaded_checkpointing``, or transformers' ``activation_checkpointing_kwargs={"offload":
            True}``); None reads it from the model (sits_lora's offloaded checkpointing).
        recompute_lora_inputs: None plans what the model's sits_lora layers do (``SitsLoraConfig(
            recompute_lora_inputs=...)``); True / False plan every sits_lora layer with / without it.
        liger: None plans the model as it is (Liger-Kernel's RMSNorm, SwiGLU and fused cross-entropy when
            they are applied); True / False plan it with / without them.
        mlp_tile_tokens: None plans the MLPs as they run (``tile_mlp``); 0 plans them untiled, a positive
            number tiled by that many tokens.
        offloaded_layers: None plans the layers whose saved tensors go to the host as the model has them
            (``enable_activation_offload``); a list of decoder layer indices plans those instead.
        fused_loss: True plans the loss as sits_lora's fused linear cross-entropy (what NativeLoraTrainer's
            recorded step runs: ``trainer.step_recording``); False as the model computes it.
        recorded: True adds what recording the step as CUDA graphs holds beyond the eager step: the cuBLAS
            workspaces of the stream its warm-up runs on and of the stream it captures on
            (:func:`sits_lora.utils.cuda_graphs.cublas_workspace_bytes` each; none for a model off CUDA).

    Raises:
        UnsupportedModelError: the model has no decoder blocks with self_attn.{q,k,v,o}_proj and
            mlp.{gate,up,down}_proj (Llama, Mistral, Qwen2 / 3 and similar have them).
    """
    _check_args(batch_size, seq_len, optimizer, gradient_accumulation_steps)
    if mlp_tile_tokens is not None and (isinstance(mlp_tile_tokens, bool) or not isinstance(mlp_tile_tokens, int)
                                        or mlp_tile_tokens < 0):
        raise ValueError(f"plan_memory: mlp_tile_tokens={mlp_tile_tokens!r} is invalid: it must be an int >= 0 (0 plans "
                         f"the MLPs untiled, None as the model runs them).")
    inner = unwrap_model(model)
    config, blocks, first, attn, mlp = _modelled_layers(inner)

    notes: list[str] = []
    T, B, S = batch_size * seq_len, batch_size, seq_len
    # per block: whether its checkpointed input waits in host memory
    if activation_offload is None:
        offloaded = [offloads_checkpoints(b) for b in blocks]
    else:
        offloaded = [bool(activation_offload)] * len(blocks)
    tile = mlp_tile_tokens_of(mlp) if mlp_tile_tokens is None else (mlp_tile_tokens or None)
    # a tiled MLP keeps its input alone; at or under one tile it runs as it is
    tiled = tile is not None and T > tile
    h = int(config.hidden_size)
    H = int(config.num_attention_heads)
    KV = int(getattr(config, "num_key_value_heads", None) or H)
    d = int(getattr(config, "head_dim", None) or h // H)
    V = int(config.vocab_size)
    I = linear_dims(mlp.down_proj)[0]
    attn_impl = str(getattr(config, "_attn_implementation", None) or "eager")
    norm_module = getattr(first, "input_layernorm", None)
    liger_norm, liger_mlp, liger_loss = _from_liger(norm_module), _from_liger(mlp), _from_liger(inner)
    if liger is not None:
        liger_norm = liger_mlp = liger_loss = liger

    frozen, adapters, trainable = _parameter_bytes(inner, blocks, notes)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    opt_bytes = _optimizer_bytes(optimizer, trainable)

    weight_dtype = base_layer_of(attn.q_proj).weight.dtype
    if not weight_dtype.is_floating_point:  # a quantized base: activations in the compute dtype
        weight_dtype = getattr(base_layer_of(attn.q_proj), "compute_dtype", None) or torch.bfloat16
    act_dtype = autocast_dtype or weight_dtype
    a = torch.finfo(act_dtype).bits // 8
    resid = torch.finfo(weight_dtype).bits // 8 if weight_dtype.is_floating_point else a

    # Probes of the adapted layers, one per distinct kind.
    probes: dict[tuple, LayerSaves] = {}
    probe_device = next((p.device for p in inner.parameters()), torch.device("cpu"))
    if autocast_dtype is not None and not _autocast_available(probe_device.type):
        notes.append(f"autocast does not exist on {probe_device.type}: the adapted layers were probed without it "
                     f"(PEFT's layers then save an fp32 copy of their input, more than under bf16 autocast)")

    def saves_of(module: nn.Module) -> LayerSaves:
        key = _layer_key(module)
        if key not in probes:
            r = max((int(getattr(p, "ds_shape", p.shape)[0]) for n, p in module.named_parameters() if "lora_A" in n),
                    default=16)
            assumed = LayerSaves(True, 0.0, 4.0 * r, probed=False)
            if any(_is_sharded(p) for p in module.parameters()):
                # a probe's forward would gather the layer's ZeRO-3 partitions (a collective every rank would have to
                # make alike) or FSDP2 shards: every rank assumes the common case instead
                probes[key] = assumed
                notes.append(f"{type(module).__name__} {linear_dims(module)} not probed (its parameters are sharded); "
                             f"assumed it saves its input and a T x r fp32 tensor")
                return assumed
            try:
                probes[key] = _probe_layer(module, weight_dtype, autocast_dtype)
            except Exception as error:  # a layer that cannot run alone (offloaded, meta): assume the common case
                probes[key] = assumed
                notes.append(f"{type(module).__name__} {linear_dims(module)} could not be probed "
                             f"({type(error).__name__}); assumed it saves its input and a T x r fp32 tensor")
        return probes[key]

    # Which LoRA inputs sits_lora.activations rebuilds in backward instead of saving (recompute_lora_inputs): those
    # whose makers the frozen block keeps. The norm keeps its input when it is Liger's, or transformers' on an
    # fp32 residual stream (in bf16 it keeps an fp32 copy instead); the first block's norm keeps nothing unless
    # the embeddings pass a gradient. sdpa / flash keep their output (o_proj's input, transposed); the gated
    # product keeps both factors (down_proj's input).
    norm_keeps_input = liger_norm or resid == 4
    first_input_grad = _inputs_require_grad(inner)

    def rebuilt(module: nn.Module, slot: str, index: int) -> bool:
        if recompute_lora_inputs is None:
            attached = vars(module).get("input_recompute") is not None
        else:  # a sits_lora layer (its class has the attribute) can have it, PEFT's cannot
            attached = recompute_lora_inputs and hasattr(type(module), "input_recompute")
        if not attached:
            return False
        if slot == "attn_in":
            return norm_keeps_input and (index > 0 or first_input_grad)
        if slot == "mlp_in":
            return norm_keeps_input
        if slot == "attn_out":
            return attn_impl != "eager"
        return slot == "mlp_act"

    def adapted_extra(block: nn.Module, index: int, recompute: bool) -> float:
        """Bytes the adapted layers of one block save beyond what the frozen block saves (``recompute``: the
        block runs without outer saved-tensor hooks, so rebuilt inputs are not saved)."""
        extra = 0.0
        shared_slots = set()
        for name, module in block.named_modules():
            if not is_adapted(module) or (tiled and name.startswith("mlp.")):
                continue  # (a tiled MLP's layers keep nothing past their tile)
            saves = saves_of(module)
            extra += saves.const_bytes + saves.bytes_per_token * T
            if not saves.saves_input:
                continue
            leaf = name.rsplit(".", 1)[-1]
            d_in = linear_dims(module)[0]
            # o_proj's input is a new contiguous copy of the attention output (eager and sdpa alike)
            slot = {"o_proj": "attn_out", "down_proj": "mlp_act"}.get(
                leaf, "attn_in" if leaf in _ATTN_IN else "mlp_in" if leaf in _MLP_IN else name)
            if recompute and rebuilt(module, slot, index):
                continue
            shared_slots.add((slot, a * T * d_in))
        return extra + sum(size for _, size in shared_slots)

    # The frozen block.
    norms = 0.0
    for name, module in first.named_modules():
        weight = getattr(module, "weight", None)
        if "norm" not in type(module).__name__.lower() or not isinstance(weight, torch.Tensor):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if weight.numel() == d and leaf.startswith("k"):
            norms += 4 * T * KV * d
        elif weight.numel() == d:
            norms += 4 * T * H * d
        elif _from_liger(module):  # Liger's RMSNorm keeps its input as it is and the fp32 1/rms per token
            norms += resid * T * weight.numel() + 4 * T
        else:
            norms += 4 * T * weight.numel()
    kv_heads_saved = H if (padded or attn_impl == "eager") else KV
    if attn_impl == "eager":
        attention = a * T * H * d * 3 + B * H * S * S * (4 + a)
    else:
        if attn_impl not in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
            notes.append(f"attention implementation {attn_impl!r} modelled like sdpa (q, k, v, output, log-sum-exp)")
        attention = a * T * H * d * 2 + 2 * a * T * kv_heads_saved * d + 4 * B * H * S
    # transformers' gated MLP keeps gate, act(gate) and up; Liger's fused SiLU·mul keeps gate and up only
    mlp_saved = a * T * h if tiled else (2 if liger_mlp else 3) * a * T * I
    frozen_block = norms + attention + mlp_saved
    if attn_impl == "eager":
        notes.append("eager attention keeps the T x S probabilities (fp32 and a copy) in every layer; sdpa does not")

    if gradient_checkpointing is None:
        checkpointed = [getattr(b, "gradient_checkpointing", False) is True for b in blocks]
    else:
        checkpointed = [bool(gradient_checkpointing)] * len(blocks)
    # a checkpointed block recomputes under the checkpoint's saved-tensor hooks: its LoRA inputs are saved then
    per_block_full = [frozen_block + adapted_extra(b, i, recompute=not ck)
                      for i, (b, ck) in enumerate(zip(blocks, checkpointed))]
    # blocks whose saved tensors wait on the host (enable_activation_offload, no checkpointing): none stays, but in
    # backward one block's tensors are back and the next block's are on their way
    if offloaded_layers is None:
        host_blocks = [offloads_activations(b) and not ck for b, ck in zip(blocks, checkpointed)]
    else:
        chosen = set(offloaded_layers)
        host_blocks = [i in chosen and not ck for i, ck in enumerate(checkpointed)]
    # under the offload's hooks the LoRA layers save their inputs (rebuilding stays out of outer hooks): those go too
    per_block_full = [frozen_block + adapted_extra(b, i, recompute=False) if off else full
                      for i, (b, off, full) in enumerate(zip(blocks, host_blocks, per_block_full))]
    per_block_kept = [0.0 if off else full for off, full in zip(host_blocks, per_block_full)]
    # selective checkpointing (keep attention) keeps attention's output and log-sum-exp besides the input; its
    # policy knows scaled_dot_product_attention's kernels only (flash_attn's and eager attention keep nothing)
    attention_kept = a * T * H * d + 4 * B * H * S
    selective = [is_selective(b) and attn_impl == "sdpa" for b in blocks]
    kept_terms = [((0 if off else resid * T * h) + (attention_kept if sel else 0)) if ck else kept
                  for ck, off, sel, kept in zip(checkpointed, offloaded, selective, per_block_kept)]
    saved_blocks = sum(kept_terms)
    if any(host_blocks):
        # backward reaches the last offloaded block after freeing every block above it: from then on the blocks
        # below it, that block's tensors back on the device and the next one's arriving
        last = max(i for i, off in enumerate(host_blocks) if off)
        arriving = 2 * max(full for full, off in zip(per_block_full, host_blocks) if off)
        saved_blocks = max(saved_blocks, sum(kept_terms[:last]) + arriving)
    n_offloaded = sum(ck and off for ck, off in zip(checkpointed, offloaded))
    if n_offloaded and checkpointed[0] and offloaded[0] and first_input_grad:
        # the first block's input is the embeddings' output, a leaf that needs a gradient: its accumulator keeps
        # it on the device, and the offload leaves it there
        saved_blocks += resid * T * h
        n_offloaded -= 1
    n_ckpt = sum(checkpointed)
    gc_label = "off" if n_ckpt == 0 else ("every layer" if n_ckpt == len(blocks) else f"{n_ckpt} of {len(blocks)} layers")
    if any(host_blocks):
        gc_label += f", {sum(host_blocks)} layers' saved tensors offloaded to host"
    if any(ck and sel for ck, sel in zip(checkpointed, selective)):
        gc_label += ", attention kept (selective)"
    if n_offloaded:
        gc_label += (", inputs offloaded to host" if n_offloaded == n_ckpt
                     else f", {n_offloaded} layers' inputs offloaded to host")
    if tiled:
        gc_label += f", MLP in tiles of {tile} tokens"

    # Outside the blocks: the final norm's input (fp32 copy, or Liger's as it is), RoPE tables, adapted layers
    # outside the blocks.
    final_norm = resid * T * h + 4 * T if liger_norm else 4.0 * T * h
    outside = final_norm + 2 * 4 * S * d
    block_ids = {id(m) for b in blocks for m in b.modules()}
    for name, module in inner.named_modules():
        if id(module) in block_ids or not is_adapted(module):
            continue
        if isinstance(base_layer_of(module), nn.Linear):
            saves = saves_of(module)
            extra = saves.const_bytes + saves.bytes_per_token * T
            extra += a * T * linear_dims(module)[0] if saves.saves_input else 0
            outside += extra
    activations = saved_blocks + outside

    loss, transient = _loss_and_transient(fused_loss, liger_loss, tile if tiled else None, a, T, h, V, I)
    recompute = max(per_block_full) + transient if n_ckpt else transient
    if n_offloaded:
        recompute += resid * T * h  # the next layer's input, fetched back while this layer runs backward
    grads_at_peak = gradient_accumulation_steps > 1
    peak_dynamic = max(activations + loss, activations + recompute) + (grads if grads_at_peak else 0)
    if not grads_at_peak and grads > activations + loss:
        peak_dynamic = grads + max(per_block_full)
        grads_at_peak = True
    # Each CUDA stream that first runs a cuBLAS GEMM gets a workspace of its own, which the allocator counts and keeps:
    # a recording warms up on one side stream and captures on another. Counted in full: a stream an earlier recording
    # used already has its workspace, and then the plan is that much above the step.
    recording = 2 * cublas_workspace_bytes(probe_device) if recorded else 0
    total = frozen + adapters + opt_bytes + peak_dynamic + recording

    return MemoryPlan(
        batch_size=batch_size, seq_len=seq_len,
        frozen_weights=int(frozen), adapter_weights=int(adapters), adapter_grads=int(grads),
        optimizer_states=int(opt_bytes), activations=int(activations + max(recompute - loss, 0)),
        logits_and_loss=int(loss), total=int(total), optimizer=optimizer, gradient_checkpointing=gc_label,
        activation_dtype=str(act_dtype).removeprefix("torch."), layers=len(blocks),
        activations_per_layer=int(max(per_block_full)), grads_at_peak=grads_at_peak, notes=notes,
        host_offload=int(resid * T * h * n_offloaded
                         + sum(full for full, off in zip(per_block_full, host_blocks) if off)),
        loss="fused" if fused_loss else ("liger" if liger_loss else "model"), recording=int(recording),
    )


# ----------------------------------------------------------------------------- measuring


class PeakMemoryMeter:
    """Measure the peak memory of the code inside ``with PeakMemoryMeter(device) as meter:``.

    On CUDA: ``torch.cuda.max_memory_allocated`` after a reset, so ``meter.peak`` counts every
    tensor alive at the peak, the model included. On the CPU (for tests): a dispatch mode counts
    the storage bytes of every tensor the code creates, plus those passed to :meth:`track` (the
    model's parameters, say), freed when their storage dies.
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak = 0
        self._mode = None

    def __enter__(self) -> "PeakMemoryMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _HostTensorTracker()
            self._mode.__enter__()
        return self

    def track(self, *tensors: torch.Tensor) -> None:
        if self._mode is not None:
            for t in tensors:
                self._mode.add(t)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak = self._mode.peak


class _HostTensorTracker(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size = self.live.pop(key, None)
        if size is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            self.add(t)
        return out
