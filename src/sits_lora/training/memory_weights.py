"""What a model's parameters take on the device, for the memory plan (training.memory): whole, or this rank's
shards under FSDP2 / DeepSpeed ZeRO-3 (with the layers gathered whole at the peak), and the 4-bit bases'
dequantization buffer."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..bases.int4 import Int4BaseLinear
from ..utils.model_structure import stored_bytes
from ..utils.units import format_bytes


def _local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter sharded by FSDP2 (a DTensor) or partitioned by DeepSpeed ZeRO-3 (its
    ``ds_tensor``; the parameter itself is then an empty placeholder), or the tensor itself."""
    partition = getattr(t, "ds_tensor", None)
    if partition is not None:
        return partition
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t).__name__ == "DTensor" else t


def is_sharded(t: torch.Tensor) -> bool:
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
        return sum(_whole_bytes(p) for p in params if is_sharded(p) and not getattr(p, "ds_persist", False))

    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = extra(p for p in model.parameters() if id(p) not in in_blocks)
    per_block = sorted((extra(block.parameters()) for block in blocks), reverse=True)
    return root + sum(per_block[:2])


def parameter_bytes(inner: nn.Module, blocks: Sequence[nn.Module], notes: list) -> tuple:
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
    named_bnb4 = [(name, m) for name, m in inner.named_modules() if type(m).__name__ == "SitsLoraLinear4bit"]
    bnb4 = [m for _, m in named_bnb4]
    unquantized = [name for name, m in named_bnb4 if getattr(m.get_base_layer().weight, "quant_state", None) is None]
    if unquantized:
        more = f" (and {len(unquantized) - 1} more)" if len(unquantized) > 1 else ""
        raise ValueError(f"plan_memory: the 4-bit weight of {unquantized[0]}{more} "
                         "holds no quantization state yet, so its stored size is unknown (a bitsandbytes layer built "
                         "on the meta device, or not yet moved to its device): plan the model once it is loaded "
                         "quantized, e.g. "
                         "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))")
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


__all__ = ["is_sharded", "parameter_bytes"]
