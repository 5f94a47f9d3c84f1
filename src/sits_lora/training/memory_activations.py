"""What a training step saves for backward, by part, for the memory plan (training.memory; the cost model is its
module docstring): the model's sizes, the frozen decoder block, the adapted layers from probes, the blocks under
checkpointing and offloading, and what lies outside the blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from ..activations.offload import offloads_activations, offloads_checkpoints
from ..activations.selective import is_selective
from ..activations.tiled_mlp import mlp_tile_tokens as mlp_tile_tokens_of
from ..utils.model_structure import base_layer_of, is_adapted, linear_dims
from .memory_probe import LayerSaves, autocast_available, layer_key, probe_layer
from .memory_weights import is_sharded

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


@dataclass
class ModelShape:
    """The sizes the cost model reads (the module docstring's letters), and what runs the norms, MLP and loss."""

    T: int
    B: int
    S: int
    h: int
    H: int
    KV: int
    d: int
    V: int
    I: int  # noqa: E741 (the module docstring's name)
    a: int                 # bytes of an activation element
    resid: int             # bytes of a residual-stream element
    act_dtype: torch.dtype
    weight_dtype: torch.dtype
    attn_impl: str
    liger_norm: bool
    liger_mlp: bool
    liger_loss: bool
    tile: Optional[int]    # the MLP's tile in tokens, None untiled
    tiled: bool            # a tiled MLP keeps its input alone; at or under one tile it runs as it is
    padded: bool           # batches carry a padding mask: sdpa then repeats K / V to every query head


def model_shape(inner: nn.Module, config, first: nn.Module, attn: nn.Module, mlp: nn.Module, batch_size: int,
              seq_len: int, autocast_dtype: Optional[torch.dtype], liger: Optional[bool],
              mlp_tile_tokens: Optional[int], padded: bool) -> ModelShape:
    T = batch_size * seq_len
    tile = mlp_tile_tokens_of(mlp) if mlp_tile_tokens is None else (mlp_tile_tokens or None)
    h = int(config.hidden_size)
    H = int(config.num_attention_heads)
    liger_norm, liger_mlp, liger_loss = (_from_liger(getattr(first, "input_layernorm", None)), _from_liger(mlp),
                                         _from_liger(inner))
    if liger is not None:
        liger_norm = liger_mlp = liger_loss = liger
    weight_dtype = base_layer_of(attn.q_proj).weight.dtype
    if not weight_dtype.is_floating_point:  # a quantized base: activations in the compute dtype
        weight_dtype = getattr(base_layer_of(attn.q_proj), "compute_dtype", None) or torch.bfloat16
    act_dtype = autocast_dtype or weight_dtype
    a = torch.finfo(act_dtype).bits // 8
    return ModelShape(
        T=T, B=batch_size, S=seq_len, h=h, H=H, KV=int(getattr(config, "num_key_value_heads", None) or H),
        d=int(getattr(config, "head_dim", None) or h // H), V=int(config.vocab_size), I=linear_dims(mlp.down_proj)[0],
        a=a, resid=torch.finfo(weight_dtype).bits // 8 if weight_dtype.is_floating_point else a,
        act_dtype=act_dtype, weight_dtype=weight_dtype,
        attn_impl=str(getattr(config, "_attn_implementation", None) or "eager"),
        liger_norm=liger_norm, liger_mlp=liger_mlp, liger_loss=liger_loss, tile=tile,
        tiled=tile is not None and T > tile, padded=padded)


class AdaptedLayers:
    """What the adapted layers save beyond the frozen block, from one probe of each distinct layer
    (training.memory_probe; a layer that cannot be probed is assumed to save its input and a T x r fp32 tensor)."""

    def __init__(self, inner: nn.Module, shape: ModelShape, autocast_dtype: Optional[torch.dtype],
                 recompute_lora_inputs: Optional[bool], notes: list):
        self.shape, self.autocast_dtype, self.recompute_lora_inputs, self.notes = (shape, autocast_dtype,
                                                                                  recompute_lora_inputs, notes)
        self.probes: dict[tuple, LayerSaves] = {}
        self.device = next((p.device for p in inner.parameters()), torch.device("cpu"))
        if autocast_dtype is not None and not autocast_available(self.device.type):
            notes.append(f"autocast does not exist on {self.device.type}: the adapted layers were probed without it "
                         f"(PEFT's layers then save an fp32 copy of their input, more than under bf16 autocast)")
        # Which LoRA inputs sits_lora.activations rebuilds in backward instead of saving (recompute_lora_inputs):
        # those whose makers the frozen block keeps. The norm keeps its input when it is Liger's, or transformers' on
        # an fp32 residual stream (in bf16 it keeps an fp32 copy instead); the first block's norm keeps nothing
        # unless the embeddings pass a gradient. sdpa / flash keep their output (o_proj's input, transposed); the
        # gated product keeps both factors (down_proj's input).
        self.norm_keeps_input = shape.liger_norm or shape.resid == 4
        self.first_input_grad = _inputs_require_grad(inner)

    def saves_of(self, module: nn.Module) -> LayerSaves:
        key = layer_key(module)
        if key not in self.probes:
            r = max((int(getattr(p, "ds_shape", p.shape)[0]) for n, p in module.named_parameters() if "lora_A" in n),
                    default=16)
            assumed = LayerSaves(True, 0.0, 4.0 * r, probed=False)
            if any(is_sharded(p) for p in module.parameters()):
                # a probe's forward would gather the layer's ZeRO-3 partitions (a collective every rank would have to
                # make alike) or FSDP2 shards: every rank assumes the common case instead
                self.probes[key] = assumed
                self.notes.append(f"{type(module).__name__} {linear_dims(module)} not probed (its parameters are "
                                  f"sharded); assumed it saves its input and a T x r fp32 tensor")
                return assumed
            try:
                self.probes[key] = probe_layer(module, self.shape.weight_dtype, self.autocast_dtype)
            except Exception as error:  # a layer that cannot run alone (offloaded, meta): assume the common case
                self.probes[key] = assumed
                self.notes.append(f"{type(module).__name__} {linear_dims(module)} could not be probed "
                                  f"({type(error).__name__}); assumed it saves its input and a T x r fp32 tensor")
        return self.probes[key]

    def rebuilt(self, module: nn.Module, slot: str, index: int) -> bool:
        if self.recompute_lora_inputs is None:
            attached = vars(module).get("input_recompute") is not None
        else:  # a sits_lora layer (its class has the attribute) can have it, PEFT's cannot
            attached = self.recompute_lora_inputs and hasattr(type(module), "input_recompute")
        if not attached:
            return False
        if slot == "attn_in":
            return self.norm_keeps_input and (index > 0 or self.first_input_grad)
        if slot == "mlp_in":
            return self.norm_keeps_input
        if slot == "attn_out":
            return self.shape.attn_impl != "eager"
        return slot == "mlp_act"

    def in_block(self, block: nn.Module, index: int, recompute: bool) -> float:
        """Bytes the adapted layers of one block save beyond what the frozen block saves (``recompute``: the
        block runs without outer saved-tensor hooks, so rebuilt inputs are not saved)."""
        T, a = self.shape.T, self.shape.a
        extra = 0.0
        shared_slots = set()
        for name, module in block.named_modules():
            if not is_adapted(module) or (self.shape.tiled and name.startswith("mlp.")):
                continue  # (a tiled MLP's layers keep nothing past their tile)
            saves = self.saves_of(module)
            extra += saves.const_bytes + saves.bytes_per_token * T
            if not saves.saves_input:
                continue
            leaf = name.rsplit(".", 1)[-1]
            d_in = linear_dims(module)[0]
            # o_proj's input is a new contiguous copy of the attention output (eager and sdpa alike)
            slot = {"o_proj": "attn_out", "down_proj": "mlp_act"}.get(
                leaf, "attn_in" if leaf in _ATTN_IN else "mlp_in" if leaf in _MLP_IN else name)
            if recompute and self.rebuilt(module, slot, index):
                continue
            shared_slots.add((slot, a * T * d_in))
        return extra + sum(size for _, size in shared_slots)

    def outside(self, inner: nn.Module, blocks: Sequence[nn.Module]) -> float:
        """Bytes the adapted linear layers outside the decoder blocks save (their input and what the probe shows)."""
        block_ids = {id(m) for b in blocks for m in b.modules()}
        total = 0.0
        for _, module in inner.named_modules():
            if id(module) in block_ids or not is_adapted(module) or not isinstance(base_layer_of(module), nn.Linear):
                continue
            saves = self.saves_of(module)
            total += saves.const_bytes + saves.bytes_per_token * self.shape.T
            total += self.shape.a * self.shape.T * linear_dims(module)[0] if saves.saves_input else 0
        return total


def frozen_block_bytes(first: nn.Module, shape: ModelShape, notes: list) -> float:
    """What one frozen decoder block saves for backward: its norms, attention and gated MLP."""
    T, B, S, H, KV, d, a = shape.T, shape.B, shape.S, shape.H, shape.KV, shape.d, shape.a
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
            norms += shape.resid * T * weight.numel() + 4 * T
        else:
            norms += 4 * T * weight.numel()
    if shape.attn_impl == "eager":
        attention = a * T * H * d * 3 + B * H * S * S * (4 + a)
    else:
        if shape.attn_impl not in ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
            notes.append(f"attention implementation {shape.attn_impl!r} modelled like sdpa (q, k, v, output, "
                         f"log-sum-exp)")
        kv_heads_saved = H if shape.padded else KV
        attention = a * T * H * d * 2 + 2 * a * T * kv_heads_saved * d + 4 * B * H * S
    # transformers' gated MLP keeps gate, act(gate) and up; Liger's fused SiLU·mul keeps gate and up only
    mlp_saved = a * T * shape.h if shape.tiled else (2 if shape.liger_mlp else 3) * a * T * shape.I
    if shape.attn_impl == "eager":
        notes.append("eager attention keeps the T x S probabilities (fp32 and a copy) in every layer; sdpa does not")
    return norms + attention + mlp_saved


@dataclass
class BlockActivations:
    """The decoder blocks' saved activations at the peak, and what the plan says about them."""

    saved: float                  # bytes the blocks keep for backward at the peak
    per_block_full: list          # each block's saved bytes without checkpointing
    host_blocks: list             # whether each block's saved tensors wait in host memory
    checkpointed: int             # blocks under gradient checkpointing
    offloaded_inputs: int         # checkpointed blocks whose input waits in host memory
    label: str                    # the plan's "checkpointing" text


def block_activations(blocks: Sequence[nn.Module], shape: ModelShape, frozen_block: float, adapted: AdaptedLayers,
                  gradient_checkpointing: Optional[bool], activation_offload: Optional[bool],
                  offloaded_layers: Optional[Sequence[int]]) -> BlockActivations:
    T, a, resid = shape.T, shape.a, shape.resid
    # per block: whether its checkpointed input waits in host memory
    if activation_offload is None:
        offloaded = [offloads_checkpoints(b) for b in blocks]
    else:
        offloaded = [bool(activation_offload)] * len(blocks)
    if gradient_checkpointing is None:
        checkpointed = [getattr(b, "gradient_checkpointing", False) is True for b in blocks]
    else:
        checkpointed = [bool(gradient_checkpointing)] * len(blocks)
    # a checkpointed block recomputes under the checkpoint's saved-tensor hooks: its LoRA inputs are saved then
    per_block_full = [frozen_block + adapted.in_block(b, i, recompute=not ck)
                      for i, (b, ck) in enumerate(zip(blocks, checkpointed))]
    # blocks whose saved tensors wait on the host (enable_activation_offload, no checkpointing): none stays, but in
    # backward one block's tensors are back and the next block's are on their way
    if offloaded_layers is None:
        host_blocks = [offloads_activations(b) and not ck for b, ck in zip(blocks, checkpointed)]
    else:
        chosen = set(offloaded_layers)
        host_blocks = [i in chosen and not ck for i, ck in enumerate(checkpointed)]
    # under the offload's hooks the LoRA layers save their inputs (rebuilding stays out of outer hooks): those go too
    per_block_full = [frozen_block + adapted.in_block(b, i, recompute=False) if off else full
                      for i, (b, off, full) in enumerate(zip(blocks, host_blocks, per_block_full))]
    per_block_kept = [0.0 if off else full for off, full in zip(host_blocks, per_block_full)]
    # selective checkpointing (keep attention) keeps attention's output and log-sum-exp besides the input; its
    # policy knows scaled_dot_product_attention's kernels only (flash_attn's and eager attention keep nothing)
    attention_kept = a * T * shape.H * shape.d + 4 * shape.B * shape.H * shape.S
    selective = [is_selective(b) and shape.attn_impl == "sdpa" for b in blocks]
    kept_terms = [((0 if off else resid * T * shape.h) + (attention_kept if sel else 0)) if ck else kept
                  for ck, off, sel, kept in zip(checkpointed, offloaded, selective, per_block_kept)]
    saved = sum(kept_terms)
    if any(host_blocks):
        # backward reaches the last offloaded block after freeing every block above it: from then on the blocks
        # below it, that block's tensors back on the device and the next one's arriving
        last = max(i for i, off in enumerate(host_blocks) if off)
        arriving = 2 * max(full for full, off in zip(per_block_full, host_blocks) if off)
        saved = max(saved, sum(kept_terms[:last]) + arriving)
    n_offloaded = sum(ck and off for ck, off in zip(checkpointed, offloaded))
    if n_offloaded and checkpointed[0] and offloaded[0] and adapted.first_input_grad:
        # the first block's input is the embeddings' output, a leaf that needs a gradient: its accumulator keeps
        # it on the device, and the offload leaves it there
        saved += resid * T * shape.h
        n_offloaded -= 1
    n_ckpt = sum(checkpointed)
    label = "off" if n_ckpt == 0 else ("every layer" if n_ckpt == len(blocks) else f"{n_ckpt} of {len(blocks)} layers")
    if any(host_blocks):
        label += f", {sum(host_blocks)} layers' saved tensors offloaded to host"
    if any(ck and sel for ck, sel in zip(checkpointed, selective)):
        label += ", attention kept (selective)"
    if n_offloaded:
        label += (", inputs offloaded to host" if n_offloaded == n_ckpt
                  else f", {n_offloaded} layers' inputs offloaded to host")
    if shape.tiled:
        label += f", MLP in tiles of {shape.tile} tokens"
    return BlockActivations(saved, per_block_full, host_blocks, n_ckpt, n_offloaded, label)


def outside_blocks_bytes(shape: ModelShape, adapted: AdaptedLayers, inner: nn.Module,
                         blocks: Sequence[nn.Module]) -> float:
    """What is saved outside the decoder blocks: the final norm's input (an fp32 copy, or Liger's as it is), the RoPE
    tables and the adapted layers outside the blocks."""
    T, h = shape.T, shape.h
    final_norm = shape.resid * T * h + 4 * T if shape.liger_norm else 4.0 * T * h
    return final_norm + 2 * 4 * shape.S * shape.d + adapted.outside(inner, blocks)


__all__ = ["AdaptedLayers", "BlockActivations", "ModelShape", "block_activations", "frozen_block_bytes", "model_shape",
           "outside_blocks_bytes"]
