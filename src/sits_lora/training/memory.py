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

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from ..ops.cross_entropy import chunk_rows_for
from ..utils.cuda_graphs import cublas_workspace_bytes
from ..utils import validation
from ..utils.model_structure import decoder_layers, text_config, unwrap_model
from ..utils.units import GIB, format_bytes
from .memory_activations import (AdaptedLayers, BlockActivations, ModelShape, block_activations, frozen_block_bytes,
                                 model_shape, outside_blocks_bytes)
from .memory_weights import parameter_bytes


OPTIMIZERS = ("adamw", "adamw_8bit", "adafactor", "sgd", "sgd_momentum", "lion", "none")
# Optimizer state bytes per byte of trainable parameter (8-bit Adam: two 1-byte states per fp32
# (4-byte) parameter).
_STATE_PER_PARAM_BYTE = {"adamw": 2.0, "adamw_8bit": 0.5, "sgd": 0.0, "sgd_momentum": 1.0, "lion": 1.0, "none": 0.0}


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


# ----------------------------------------------------------------------------- the plan


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


def _check_args(batch_size, seq_len, optimizer, gradient_accumulation_steps, mlp_tile_tokens):
    validation.check_arguments(
        "plan_memory", batch_size=(batch_size, validation.positive_int()), seq_len=(seq_len, validation.positive_int()),
        gradient_accumulation_steps=(gradient_accumulation_steps, validation.positive_int()),
        optimizer=(optimizer, validation.choice(OPTIMIZERS)),
        mlp_tile_tokens=(mlp_tile_tokens, validation.non_negative_int(
            " (0 plans the MLPs untiled, None as the model runs them)", allow_none=True)))


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


def _peak(shape: ModelShape, kept: BlockActivations, activations: float, grads: int, fused_loss: bool,
          gradient_accumulation_steps: int) -> tuple:
    """(the loss's bytes, what backward holds at once beyond the saved activations, the step's peak above the
    weights and optimizer states, whether the gradients are part of it)."""
    T, h = shape.T, shape.h
    loss, transient = _loss_and_transient(fused_loss, shape.liger_loss, shape.tile if shape.tiled else None, shape.a,
                                          T, h, shape.V, shape.I)
    recompute = max(kept.per_block_full) + transient if kept.checkpointed else transient
    if kept.offloaded_inputs:
        recompute += shape.resid * T * h  # the next layer's input, fetched back while this layer runs backward
    grads_at_peak = gradient_accumulation_steps > 1
    peak_dynamic = max(activations + loss, activations + recompute) + (grads if grads_at_peak else 0)
    if not grads_at_peak and grads > activations + loss:
        peak_dynamic = grads + max(kept.per_block_full)
        grads_at_peak = True
    return loss, recompute, peak_dynamic, grads_at_peak


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
    _check_args(batch_size, seq_len, optimizer, gradient_accumulation_steps, mlp_tile_tokens)
    inner = unwrap_model(model)
    config, blocks, first, attn, mlp = _modelled_layers(inner)
    shape = model_shape(inner, config, first, attn, mlp, batch_size, seq_len, autocast_dtype, liger, mlp_tile_tokens,
                      padded)
    notes: list[str] = []
    frozen, adapters, trainable = parameter_bytes(inner, blocks, notes)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    opt_bytes = _optimizer_bytes(optimizer, trainable)
    adapted = AdaptedLayers(inner, shape, autocast_dtype, recompute_lora_inputs, notes)
    kept = block_activations(blocks, shape, frozen_block_bytes(first, shape, notes), adapted, gradient_checkpointing,
                         activation_offload, offloaded_layers)
    activations = kept.saved + outside_blocks_bytes(shape, adapted, inner, blocks)
    loss, recompute, peak_dynamic, grads_at_peak = _peak(shape, kept, activations, grads, fused_loss,
                                                         gradient_accumulation_steps)
    # a stream an earlier recording used already has its workspace: then the plan is that much above the step
    recording = 2 * cublas_workspace_bytes(adapted.device) if recorded else 0
    offloaded_blocks = sum(full for full, off in zip(kept.per_block_full, kept.host_blocks) if off)
    return MemoryPlan(
        batch_size=batch_size, seq_len=seq_len, frozen_weights=int(frozen), adapter_weights=int(adapters),
        adapter_grads=int(grads), optimizer_states=int(opt_bytes), logits_and_loss=int(loss), layers=len(blocks),
        activations=int(activations + max(recompute - loss, 0)), activations_per_layer=int(max(kept.per_block_full)),
        total=int(frozen + adapters + opt_bytes + peak_dynamic + recording), recording=int(recording),
        optimizer=optimizer, gradient_checkpointing=kept.label, grads_at_peak=grads_at_peak, notes=notes,
        activation_dtype=str(shape.act_dtype).removeprefix("torch."),
        host_offload=int(shape.resid * shape.T * shape.h * kept.offloaded_inputs + offloaded_blocks),
        loss="fused" if fused_loss else ("liger" if shape.liger_loss else "model"))
