"""What to change when a run's memory plan is over its budget: each alternative planned, cheapest first. Read by
SitsHardwareCallback's memory check and by ``sits-lora check``."""

from __future__ import annotations

import importlib.util

import torch

from ..activations.tiled_mlp import DEFAULT_TILE_TOKENS
from .constraints import choose_offloaded_layers
from .memory import MemoryPlan, plan_memory


def memory_alternatives(model, batch: int, seq_len: int, plan: MemoryPlan, budget: int, n_ckpt: int,
                        plan_kwargs: dict, hardware=None) -> dict[str, MemoryPlan]:
    """Plans of the changes that shrink an over-budget ``plan``, by label (what to set), cheapest first: Liger-Kernel
    (on a GPU, installed, not applied yet), rebuilt LoRA inputs (sits_lora layers that save theirs), the saved
    tensors of the layers whose copies hide behind the forward in host memory (with ``hardware``'s pinned bandwidth
    and matmul rate, when nothing is checkpointed), gradient checkpointing (when ``n_ckpt``, the checkpointed
    layers, is 0), checkpointing with the kept inputs on the host
    and the MLP in tiles (when it plans lower than all before it), the largest per-device batch that fits
    ``budget`` (with the gradient accumulation that keeps the effective batch), and half the rank.
    ``plan_kwargs``: the keyword arguments ``plan`` was made with."""
    out: dict[str, MemoryPlan] = {}
    # cheapest first: what costs no step time, then recomputation, then a smaller batch, then a smaller adapter
    liger_applies = (not plan_kwargs.get("liger") and torch.cuda.is_available()
                     and importlib.util.find_spec("liger_kernel") is not None)
    if liger_applies:
        liger = plan_memory(model, batch, seq_len, **{**plan_kwargs, "liger": True})
        if liger.total < plan.total:
            out["Liger-Kernel's RMSNorm, SwiGLU and fused cross-entropy (TrainingArguments(use_liger_kernel=True))"] = liger
    sits_layers = [m for m in model.modules() if hasattr(type(m), "input_recompute")]
    if sits_layers and any(vars(m).get("input_recompute") is None for m in sits_layers):
        rebuilt = plan_memory(model, batch, seq_len, **{**plan_kwargs, "recompute_lora_inputs": True})
        if rebuilt.total < plan.total:
            out["LoRA inputs rebuilt in backward (SitsLoraConfig(recompute_lora_inputs=True); costs a little step "
                "time, more on small launch-bound models)"] = rebuilt
    bandwidth = getattr(hardware, "pinned_bandwidth", None)
    rate = getattr(hardware, "matmul_flops", None)
    if n_ckpt == 0 and bandwidth and rate:
        # no recompute: the layers whose saved tensors can cross PCIe while the forward computes
        chosen = choose_offloaded_layers(model, batch, seq_len, pinned_bandwidth=bandwidth, matmul_flops=rate,
                                         **plan_kwargs)["layers"]
        if chosen:
            offloaded = plan_memory(model, batch, seq_len, **{**plan_kwargs, "offloaded_layers": chosen})
            if offloaded.total < plan.total:
                out[f"the saved tensors of decoder layers {chosen[0]}-{chosen[-1]} in pinned host memory, copies hidden "
                    f"behind the forward (sits_lora.activations.enable_activation_offload(model, "
                    f"range({chosen[0]}, {chosen[-1] + 1})))"] = offloaded
    if n_ckpt == 0:
        out["gradient checkpointing (TrainingArguments(gradient_checkpointing=True))"] = plan_memory(
            model, batch, seq_len, gradient_checkpointing=True, **plan_kwargs)
    if not plan_kwargs.get("activation_offload"):
        # what still grows with the sequence under checkpointing: the kept layer inputs (to the host) and one
        # layer's MLP (in tiles)
        offloaded = plan_memory(model, batch, seq_len, **{**plan_kwargs, "gradient_checkpointing": True,
                                                          "activation_offload": True,
                                                          "mlp_tile_tokens": DEFAULT_TILE_TOKENS})
        if offloaded.total < min([plan.total] + [p.total for p in out.values()]):
            out["checkpointed layer inputs in pinned host memory and the MLP in tiles (sits_lora.activations: "
                "enable_offloaded_checkpointing(model); tile_mlp(model))"] = offloaded
    if batch > 1:
        low, high = 1, batch - 1
        best = None
        while low <= high:
            mid = (low + high) // 2
            candidate = plan_memory(model, mid, seq_len, **plan_kwargs)
            if candidate.total <= budget:
                best, low = (mid, candidate), mid + 1
            else:
                high = mid - 1
        b, candidate = best or (1, plan_memory(model, 1, seq_len, **plan_kwargs))
        out[f"per_device_train_batch_size={b} (with gradient_accumulation_steps x{-(-batch // b)} for the same "
            f"effective batch)"] = candidate
    ranks = [r for m in model.modules() for r in getattr(m, "r", {}).values()] if hasattr(model, "modules") else []
    if ranks and max(ranks) > 1:
        r = max(ranks)
        ratio = (r // 2) / r
        shrink = (1 - ratio) * (plan.adapter_weights + plan.optimizer_states
                                + (plan.adapter_grads if plan.grads_at_peak else 0))
        alt = MemoryPlan(**{**plan.__dict__, "total": int(plan.total - shrink), "notes": list(plan.notes)})
        out[f"r={r // 2} (adapters, their gradients and optimizer states halve)"] = alt
    return out


__all__ = ["memory_alternatives"]
