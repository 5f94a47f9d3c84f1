"""The hardware constraints a run is checked against before its first step.

Each check returns a :class:`ConstraintResult` ("ok", "violated" or "skipped", with its numbers
and, when violated, what to change). :func:`apply_policies` turns them into log lines or, under
"strict", one :class:`HardwareConstraintError` listing every violation.

Rank ceiling (:func:`check_rank`), a roofline; the cost model per adapted linear layer
(K inputs, N outputs, T tokens per micro-batch, a bytes per activation element, F the measured
bf16 matmul rate, BW the measured HBM bandwidth):

    base layer, forward + input gradient:  t_base = 2 · max(2·T·K·N / F, (T·K + K·N + T·N)·a / BW)
    LoRA branch at rank r:                 t_lora = max(6·T·r·(K+N) / F, bytes(r) / BW)
      fused kernel (sits_lora Triton):     bytes(r) = r·(16·T + 16·(K+N))       (h, g in fp32; A, B and grads)
      unfused (PEFT, the torch reference): bytes(r) = the same + (5·T·K + 6·T·N)·a  (extra passes over x, y)

The ceiling is the largest r with t_lora <= share · t_base. A roofline is a lower bound on time,
so the ceiling is an upper bound on rank: a rank above it cannot stay under the share.

PCIe (:func:`check_pcie`): bytes moved between host and device per optimizer step (the batch,
parameters offloaded to the host, activations offloaded by checkpointing, anything a module reports
through ``sits_pcie_bytes_per_step()``) over the measured pinned bandwidth, against the step time
(the roofline 4·N·T / F of a LoRA step, or the measured step time once there is one). A transfer
that takes longer than the step cannot hide behind compute, even perfectly overlapped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..bases.int4 import Int4BaseLinear
from ..utils.model_structure import base_layer_of, decoder_layers, is_adapted, linear_dims, unwrap_model
from ..utils.units import format_bytes
from .memory import MemoryPlan, plan_memory

logger = logging.getLogger("sits_lora")

CONSTRAINTS = ("memory", "rank", "pcie", "int4")
POLICIES = ("warn", "strict", "off")


class HardwareConstraintError(RuntimeError):
    """A constraint under policy "strict" is violated; raised before the first training step."""


@dataclass
class ConstraintResult:
    name: str
    status: str  # "ok" | "violated" | "skipped"
    summary: str
    details: dict = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "summary": self.summary, "details": self.details,
                "suggestions": self.suggestions}


def resolve_policies(policy) -> dict[str, str]:
    """``policy``: one of "warn" / "strict" / "off" for every constraint, or a dict naming some of them."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"SitsHardwareCallback(policy={policy!r}) is invalid: allowed values are "
                             f"{', '.join(map(repr, POLICIES))}, or a dict such as {{'memory': 'strict', 'rank': 'warn'}}.")
        return {name: policy for name in CONSTRAINTS}
    if isinstance(policy, dict):
        unknown = sorted(set(policy) - set(CONSTRAINTS))
        if unknown:
            raise ValueError(f"SitsHardwareCallback(policy=...) names unknown constraints {unknown}; the constraints are "
                             f"{', '.join(map(repr, CONSTRAINTS))}.")
        bad = {k: v for k, v in policy.items() if v not in POLICIES}
        if bad:
            raise ValueError(f"SitsHardwareCallback(policy={policy!r}) is invalid for {sorted(bad)}: each value must be "
                             f"one of {', '.join(map(repr, POLICIES))}.")
        return {name: policy.get(name, "warn") for name in CONSTRAINTS}
    raise ValueError(f"SitsHardwareCallback(policy={policy!r}) is invalid: pass 'warn', 'strict', 'off' or a dict.")


# ----------------------------------------------------------------------------- memory


def check_memory(plan: Optional[MemoryPlan], budget: Optional[int], budget_source: str,
                 alternatives: dict[str, MemoryPlan], skip_reason: str = "") -> ConstraintResult:
    if plan is None:
        return ConstraintResult("memory", "skipped", skip_reason or "no memory plan")
    details = {"plan": plan.to_dict(), "budget_bytes": budget, "budget_source": budget_source}
    summary = f"plan {format_bytes(plan.total)}"
    if budget is None:
        return ConstraintResult("memory", "skipped", summary + ", no budget known", details)
    summary += f" vs {format_bytes(budget)} {budget_source}"
    if plan.total <= budget:
        return ConstraintResult("memory", "ok", summary, details)
    suggestions = []
    recommended = False
    for label, alt in alternatives.items():  # cheapest first: the first that fits is the recommendation
        fits = "fits" if alt.total <= budget else "still over"
        if fits == "fits" and not recommended:
            recommended, fits = True, "fits; recommended: the cheapest change that fits"
        suggestions.append(f"{label}: {format_bytes(alt.total)} ({fits})")
    details["alternatives"] = {k: v.total for k, v in alternatives.items()}
    return ConstraintResult("memory", "violated", summary + f": over by {format_bytes(plan.total - budget)}",
                            details, suggestions)


# ----------------------------------------------------------------------------- rank ceiling


def _routes_in_training(layer: nn.Module, adapter: str) -> bool:
    """A dynamic-rank layer (it has ``routing_on``) that routes ``adapter`` while training."""
    routing_on = getattr(layer, "routing_on", None)
    if not callable(routing_on):
        return False
    # routing_on reads layer.training, and the Trainer calls model.train() only after on_train_begin,
    # where the constraints are checked: ask the layer as it will be during training.
    was = layer.training
    layer.training = True
    try:
        return bool(routing_on(adapter))
    finally:
        layer.training = was


def layer_runs_fused(module: nn.Module, cuda: bool, autocast_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether sits_lora layer ``module`` will train on the fused Triton kernels, on a CUDA device when ``cuda``,
    under autocast to ``autocast_dtype`` when given.

    The forward plan's rule (sits_lora.layers.forward_plan), applied to the dtype the fused op computes in:
    autocast's when it is on, else the one the layer receives in the model, its weights' (the residual stream's):
    "auto" is fused for bf16 / fp16 only, "triton" for any, neither with a trainable base weight. A dynamic-rank
    layer that routes runs the PyTorch reference (there is no bucketed kernel yet); PEFT's own layers are never
    fused.
    """
    kernels = getattr(module, "sits_kernel", None)
    if not kernels or not cuda:
        return False
    base = base_layer_of(module)
    weight = getattr(base, "weight", None)
    if weight is None:
        return False
    input_dtype = autocast_dtype or (weight.dtype if weight.dtype.is_floating_point
                                     else getattr(base, "compute_dtype", None))
    for adapter, kernel in kernels.items():
        if _routes_in_training(module, adapter):
            return False
        if kernel == "torch" or (kernel == "auto" and input_dtype not in (torch.bfloat16, torch.float16)):
            return False
        if kernel == "triton" and (weight.requires_grad or (getattr(base, "bias", None) is not None
                                                            and base.bias.requires_grad)):
            return False
    return True


def rank_ceiling(K: int, N: int, T: int, act_bytes: int, flops: float, bandwidth: float, share: float,
                 fused: bool) -> int:
    """Largest LoRA rank whose branch stays under ``share`` of the base layer's time (the module docstring's model)."""
    t_base = 2 * max(2 * T * K * N / flops, (T * K + K * N + T * N) * act_bytes / bandwidth)
    budget = share * t_base
    per_rank_flops = 6 * T * (K + N) / flops
    per_rank_bytes = (16 * T + 16 * (K + N)) / bandwidth
    fixed_bytes = 0.0 if fused else (5 * T * K + 6 * T * N) * act_bytes / bandwidth
    by_flops = budget / per_rank_flops
    by_bytes = (budget - fixed_bytes) / per_rank_bytes
    return max(int(math.floor(min(by_flops, by_bytes))), 0)


def check_rank(model: nn.Module, hardware, tokens: Optional[int], act_bytes: int, share: float,
               is_fused: Optional[Callable[[nn.Module], bool]] = None,
               autocast_dtype: Optional[torch.dtype] = None) -> ConstraintResult:
    """Each adapted layer's rank against :func:`rank_ceiling`. ``is_fused(layer)`` says whether a layer runs
    the fused kernel; by default :func:`layer_runs_fused` on the device of the layer's parameters, under
    autocast to ``autocast_dtype`` when given."""
    if not hardware.is_cuda:
        return ConstraintResult("rank", "skipped", "no CUDA device")
    if not tokens:
        return ConstraintResult("rank", "skipped", "sequence length unknown (pass seq_len=...)")
    if not (hardware.matmul_flops and hardware.hbm_bandwidth):
        return ConstraintResult("rank", "skipped", "matmul rate or bandwidth not measured")
    groups: dict[tuple, list[str]] = {}
    for name, module in model.named_modules():
        if not is_adapted(module) or not isinstance(base_layer_of(module), nn.Linear):
            continue
        K, N = linear_dims(module)
        ranks = [v for v in getattr(module, "r", {}).values()] or [0]
        fused = (is_fused(module) if is_fused is not None
                 else layer_runs_fused(module, next(module.parameters()).device.type == "cuda", autocast_dtype))
        groups.setdefault((K, N, max(ranks), fused), []).append(name)
    rows, over = [], []
    for (K, N, r, fused), names in sorted(groups.items()):
        ceiling = rank_ceiling(K, N, tokens, act_bytes, hardware.matmul_flops, hardware.hbm_bandwidth, share, fused)
        row = {"shape": [K, N], "rank": r, "ceiling": ceiling, "fused": fused, "layers": len(names),
               "example": names[0]}
        rows.append(row)
        if r > ceiling:
            over.append(row)
    if not rows:
        return ConstraintResult("rank", "skipped", "no adapted linear layers")
    details = {"share": share, "tokens_per_micro_batch": tokens, "layers": rows}
    lowest = min(row["ceiling"] for row in rows)
    if not over:
        return ConstraintResult("rank", "ok", f"every rank is within its ceiling (lowest ceiling {lowest}, "
                                               f"{share:.0%} of layer time)", details)
    suggestions = []
    for row in over:
        K, N = row["shape"]
        fix = f"lower r to <= {row['ceiling']}" if row["ceiling"] > 0 else "no rank fits"
        if not row["fused"]:
            fix += ", or run the fused kernel (SitsLoraConfig(kernel='auto') with bf16 / fp16 weights on a GPU)"
        suggestions.append(f"{row['example']} and {row['layers'] - 1} similar ({K} x {N}, r={row['rank']}): "
                           f"ceiling {row['ceiling']}: {fix}")
    return ConstraintResult("rank", "violated",
                            f"{sum(r['layers'] for r in over)} layer(s) above their rank ceiling at a {share:.0%} share",
                            details, suggestions)


# ----------------------------------------------------------------------------- PCIe


def pcie_bytes_per_step(model: nn.Module, *, batch_bytes: int, activation_offload_bytes: int,
                        gradient_checkpointing: bool, accumulation: int) -> dict[str, int]:
    """Bytes between host and device per optimizer step, by source."""
    parts = {"batch": batch_bytes * accumulation}
    device = None
    offloaded = 0
    for p in model.parameters():
        if p.device.type == "cuda":
            device = p.device
        elif p.device.type in ("cpu", "meta"):
            offloaded += p.numel() * p.element_size()
    if device is not None and offloaded:
        # Host-resident weights go to the device for the forward, again for the backward, and once
        # more for a checkpointed recompute.
        parts["offloaded_parameters"] = offloaded * (3 if gradient_checkpointing else 2) * accumulation
    if activation_offload_bytes:
        parts["offloaded_activations"] = 2 * activation_offload_bytes * accumulation
    reported = 0
    for module in model.modules():
        fn = getattr(module, "sits_pcie_bytes_per_step", None)
        if callable(fn):
            reported += int(fn())
    if reported:
        parts["reported_by_modules"] = reported
    return parts


def check_pcie(parts: dict[str, int], hardware, step_seconds: Optional[float], step_source: str) -> ConstraintResult:
    total = sum(parts.values())
    details = {"bytes_per_step": parts, "total_bytes": total}
    if not hardware.is_cuda:
        return ConstraintResult("pcie", "skipped", "no CUDA device", details)
    bandwidth = hardware.pinned_bandwidth
    if not bandwidth or not step_seconds:
        return ConstraintResult("pcie", "skipped", "bandwidth or step time unknown", details)
    seconds = total / bandwidth
    details.update({"transfer_seconds": seconds, "step_seconds": step_seconds, "step_source": step_source,
                    "pinned_bandwidth": bandwidth})
    summary = (f"{total / 2**20:.1f} MiB per step, {seconds * 1e3:.2f} ms at {bandwidth / 1e9:.1f} GB/s "
               f"vs {step_seconds * 1e3:.1f} ms step ({step_source})")
    if seconds <= step_seconds:
        return ConstraintResult("pcie", "ok", summary, details)
    biggest = max(parts, key=parts.get)
    return ConstraintResult("pcie", "violated", summary + ": the transfers cannot hide behind compute", details,
                            [f"the largest transfer is {biggest} ({parts[biggest] / 2**20:.1f} MiB): keep it on the "
                             f"device, or raise the batch so that compute covers it"])


def choose_offloaded_layers(model: nn.Module, batch_size: int, seq_len: int, *, pinned_bandwidth: float,
                            matmul_flops: float, **plan_kwargs) -> dict:
    """Which decoder layers can keep their saved tensors in host memory with the copies hidden behind compute
    (``sits_lora.activations.enable_activation_offload(model, result["layers"])``).

    One layer saves S bytes (plan_memory's activations per layer) and its forward takes at least F = 2·N·T / rate
    (N: the frozen weights of a layer's linear layers, T tokens; attention only adds to it). Offloading k of the L
    layers moves k·S bytes to the host during a forward of L·F seconds and back during a backward of about twice
    that: the copies hide when k·S / bandwidth <= L·F. The first k layers go: their copies have the most forward
    time after them, and backward needs them last.

    Returns {"layers", "saved_bytes_per_layer", "copy_seconds_per_layer", "forward_seconds_per_layer"}.
    """
    if pinned_bandwidth <= 0 or matmul_flops <= 0:
        raise ValueError(f"choose_offloaded_layers: pinned_bandwidth={pinned_bandwidth} and matmul_flops="
                         f"{matmul_flops} must be > 0 (HardwareReport.pinned_bandwidth and .matmul_flops).")
    _, blocks = decoder_layers(unwrap_model(model))
    if not blocks:
        raise ValueError(f"choose_offloaded_layers: {type(model).__name__} has no decoder layers to offload.")
    plan = plan_memory(model, batch_size, seq_len, gradient_checkpointing=False, **plan_kwargs)
    # the frozen linear layers of one block (PEFT keeps them as its layers' base_layer; the adapters train)
    weights = sum(m.in_features * m.out_features for m in blocks[0].modules()
                  if isinstance(m, nn.Linear) and not m.weight.requires_grad)
    if not weights:
        raise ValueError(f"choose_offloaded_layers: the decoder layers of {type(model).__name__} have no frozen "
                         f"nn.Linear layers to estimate their compute from (a quantized base?): choose the layers "
                         f"yourself (sits_lora.activations.enable_activation_offload(model, layers)).")
    forward_s = 2 * weights * batch_size * seq_len / matmul_flops
    copy_s = plan.activations_per_layer / pinned_bandwidth
    count = len(blocks) if copy_s <= forward_s else int(len(blocks) * forward_s / copy_s)
    return {"layers": list(range(count)), "saved_bytes_per_layer": plan.activations_per_layer,
            "copy_seconds_per_layer": copy_s, "forward_seconds_per_layer": forward_s}


def estimate_step_seconds(model: nn.Module, tokens: int, flops: float, accumulation: int,
                          gradient_checkpointing: bool) -> float:
    """Roofline of one optimizer step: forward and input-gradient GEMMs of every linear weight, 4·N·T."""
    n = 0
    for module in model.modules():
        base = base_layer_of(module)
        if base is module and isinstance(module, nn.Linear) and not any(
                p.requires_grad for p in module.parameters()):
            n += module.in_features * module.out_features
    work = 4 * n * tokens * (1.5 if gradient_checkpointing else 1.0)  # a recompute adds one forward (2 of 4)
    return work * accumulation / flops


# ----------------------------------------------------------------------------- INT4 alignment


def _check_int4_base(name: str, module: Int4BaseLinear, problems: list) -> None:
    """sits_lora's INT4 base: the packed codes start on a 32-byte boundary and every row is a multiple of 32 bytes."""
    packed = module.weight
    out_f, in_f = module.out_features, module.in_features
    if packed.data_ptr() % 32:
        problems.append(f"{name} ({out_f} x {in_f}): packed INT4 codes at byte offset {packed.data_ptr() % 32} mod 32, "
                        f"not 32-byte aligned (a view into a shared buffer); fix: module.weight.data = "
                        f"module.weight.data.clone()")
    row_bytes = packed.stride(0) * packed.element_size()
    if row_bytes % 32:
        problems.append(f"{name} ({out_f} x {in_f}): packed rows of {row_bytes} bytes, not a multiple of 32 (the rows "
                        f"were not padded); fix: quantize again with sits_lora (SitsLoraConfig(base_quant='int4'))")


def check_int4(model: nn.Module) -> ConstraintResult:
    """Every 4-bit layer: sits_lora's INT4 base (packed codes and rows 32-byte aligned) and bitsandbytes'
    Linear4bit (packed data 32-byte aligned, in_features a multiple of the block)."""
    import sys

    layers, problems = [], []
    for name, module in model.named_modules():
        if isinstance(module, Int4BaseLinear):
            layers.append(name)
            _check_int4_base(name, module, problems)
    bnb = sys.modules.get("bitsandbytes")  # a model cannot hold bnb layers unless bitsandbytes was imported
    linear4bit = bnb.nn.Linear4bit if bnb is not None else ()
    for name, module in model.named_modules():
        if not linear4bit or not isinstance(module, linear4bit):
            continue
        weight = module.weight
        state = getattr(weight, "quant_state", None)
        if state is None:
            continue  # not quantized yet (still on the host before .to(device))
        block = int(state.blocksize)
        out_f, in_f = (int(s) for s in state.shape)
        ptr = weight.data_ptr()
        layers.append(name)
        fix_shape = (f"exclude it from 4-bit quantization (BitsAndBytesConfig(llm_int8_skip_modules=['{name}'])) "
                     f"or pad in_features to {math.ceil(in_f / block) * block}")
        if ptr % 32:
            problems.append(f"{name} ({out_f} x {in_f}): packed weight at byte offset {ptr % 32} mod 32, not 32-byte "
                            f"aligned (a view into a shared buffer); fix: give it its own allocation, "
                            f"module.weight.data = module.weight.data.clone()")
        if in_f % block:
            problems.append(f"{name} ({out_f} x {in_f}): in_features={in_f} is not a multiple of the 4-bit block "
                            f"size {block}, so blocks straddle rows; fix: {fix_shape}")
        elif (out_f * in_f) % 2:
            problems.append(f"{name} ({out_f} x {in_f}): an odd number of weights does not pack two per byte; "
                            f"fix: {fix_shape}")
    if not layers:
        why = "no quantized 4-bit layers" + ("" if bnb is not None else " (bitsandbytes not loaded)")
        return ConstraintResult("int4", "skipped", why)
    details = {"layers_checked": len(layers), "problems": problems}
    if not problems:
        return ConstraintResult("int4", "ok", f"{len(layers)} 4-bit layers aligned", details)
    return ConstraintResult("int4", "violated", f"{len(problems)} problem(s) in {len(layers)} 4-bit layers", details,
                            problems)


# ----------------------------------------------------------------------------- policies


def results_table(results: list[ConstraintResult]) -> str:
    width = max(len(r.name) for r in results)
    lines = []
    for r in results:
        lines.append(f"  {r.name:<{width}}  {r.status:<8}  {r.summary}")
        lines.extend(f"  {'':<{width}}  {'':<8}  - {s}" for s in r.suggestions)
    return "\n".join(lines)


def apply_policies(results: list[ConstraintResult], policies: dict[str, str], plan: Optional[MemoryPlan]) -> None:
    """Log violated constraints under "warn"; raise one HardwareConstraintError for those under "strict"."""
    strict = [r for r in results if r.status == "violated" and policies.get(r.name) == "strict"]
    for r in results:
        if r.status == "violated" and policies.get(r.name) == "warn":
            logger.warning("sits_lora %s constraint violated: %s%s", r.name, r.summary,
                           "".join(f"\n  - {s}" for s in r.suggestions))
    if not strict:
        return
    parts = [f"SitsHardwareCallback(policy='strict'): {len(strict)} constraint(s) violated, so training stops before "
             f"its first step. What to change:"]
    for r in strict:
        parts.append(f"[{r.name}] {r.summary}")
        parts.extend(f"  - {s}" for s in r.suggestions)
        if r.name == "memory" and plan is not None:
            parts.append(plan.table())
    parts.append("To train anyway, use policy='warn' for these constraints (e.g. policy={'memory': 'warn'}).")
    raise HardwareConstraintError("\n".join(parts))
