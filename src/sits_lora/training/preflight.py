"""What SitsHardwareCallback checks before the first step, and its report.

:func:`check_run` reads the run's shape from the Trainer's arguments, the model and the data, plans its memory
(``plan_memory``) and checks the four constraints (memory, rank, PCIe, INT4 alignment) that the policies leave on;
:func:`write_report` prints the hardware, the constraints and the plan, and writes them with the run's settings to
``output_dir/hardware_report.json``. The callback calls both at train begin, applies the policies to the results and
keeps what it needs later (the plan's inputs, to plan the recorded step again; the PCIe parts, to check them again
against the measured step time).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..activations.offload import offloads_checkpoints
from ..utils.env import environment
from ..utils.model_structure import checkpointed_layers, decoder_layers, text_config, unwrap_model
from ..utils.units import GIB
from .alternatives import memory_alternatives
from .constraints import (
    ConstraintResult,
    check_int4,
    check_memory,
    check_pcie,
    check_rank,
    estimate_step_seconds,
    pcie_bytes_per_step,
    results_table,
)
from .hardware import HardwareReport
from .memory import MemoryPlan, UnsupportedModelError, plan_memory
from .run_shape import batch_bytes, infer_seq_len, optimizer_kind, weight_bytes

logger = logging.getLogger("sits_lora")

REPORT_FILE = "hardware_report.json"


@dataclass
class RunCheck:
    """What :func:`check_run` found: a result per constraint checked, the memory plan when one could be made, the
    plan's inputs ``(batch, seq_len, plan_memory kwargs)`` when the sequence length is known, and the bytes a step
    moves over PCIe by part when that constraint was checked."""
    results: list[ConstraintResult] = field(default_factory=list)
    memory_plan: Optional[MemoryPlan] = None
    plan_inputs: Optional[tuple] = None
    pcie_parts: Optional[dict] = None


def memory_budget(model, hardware: HardwareReport, budget_gib: Optional[float]) -> tuple[Optional[int], str]:
    """The bytes a run may use and where that figure comes from: the user's budget, else what the GPU has free
    (plus what the allocator holds already), else the host's available memory plus the model on it."""
    if budget_gib is not None:
        return int(budget_gib * GIB), "memory_budget_gib"
    if hardware.is_cuda:
        device = torch.device(hardware.device)
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device)), f"free on {hardware.device}"
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
    return int(hardware.free_memory + resident), "available host memory"


def check_run(args, model, train_dataloader, hardware: HardwareReport, policies: dict, *, seq_len: Optional[int],
              rank_share: float, memory_budget_gib: Optional[float]) -> RunCheck:
    """The memory plan and a result for each constraint whose policy is not "off" (module docstring)."""
    seq_len = seq_len or infer_seq_len(train_dataloader)
    batch = int(args.per_device_train_batch_size)
    accumulation = int(args.gradient_accumulation_steps)
    tokens = batch * seq_len if seq_len else None
    autocast = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    optimizer = optimizer_kind(str(getattr(args.optim, "value", args.optim)))
    # transformers' offload (every checkpointed layer's input), or sits_lora's own, which the plan reads per layer
    # from the model (enable_offloaded_checkpointing(keep_on_device=...))
    transformers_offload = bool((getattr(args, "activation_checkpointing_kwargs", None)
                                 or getattr(args, "gradient_checkpointing_kwargs", None) or {}).get("offload", False))
    blocks = decoder_layers(unwrap_model(model))[1]
    offload = transformers_offload or any(offloads_checkpoints(b) for b in blocks)
    n_ckpt = checkpointed_layers(model)
    plan_kwargs = dict(optimizer=optimizer, autocast_dtype=autocast, gradient_accumulation_steps=accumulation,
                       activation_offload=True if transformers_offload else None)
    check = RunCheck(plan_inputs=(batch, seq_len, plan_kwargs) if seq_len else None)
    plan_error = ""
    if seq_len:
        try:
            check.memory_plan = plan_memory(model, batch, seq_len, **plan_kwargs)
        except UnsupportedModelError as error:
            plan_error = str(error)
        except Exception as error:  # a plan must never stop training by itself
            plan_error = f"plan_memory failed: {type(error).__name__}: {error}"
            logger.warning("sits_lora: %s; the memory check is skipped.", plan_error)
    else:
        plan_error = "sequence length unknown (pass SitsHardwareCallback(seq_len=...))"
    plan = check.memory_plan

    if policies["memory"] != "off":
        budget, source = memory_budget(model, hardware, memory_budget_gib)
        alternatives = {}
        if plan is not None and budget is not None and plan.total > budget:
            alternatives = memory_alternatives(model, batch, seq_len, plan, budget, n_ckpt, plan_kwargs, hardware)
        check.results.append(check_memory(plan, budget, source, alternatives, plan_error))

    act_bytes = 2 if autocast is not None else weight_bytes(model)
    if policies["rank"] != "off":
        check.results.append(check_rank(model, hardware, tokens, act_bytes, rank_share, autocast_dtype=autocast))

    if policies["pcie"] != "off":
        offload_bytes = 0
        if plan is not None:
            offload_bytes = plan.host_offload  # what goes to the host, layer by layer, as planned
        elif offload and seq_len:
            config = text_config(unwrap_model(model))
            offload_bytes = n_ckpt * tokens * int(config.hidden_size) * weight_bytes(model)
        check.pcie_parts = pcie_bytes_per_step(
            model, batch_bytes=batch_bytes(train_dataloader, batch), activation_offload_bytes=offload_bytes,
            gradient_checkpointing=n_ckpt > 0, accumulation=accumulation)
        step_seconds = None
        if hardware.is_cuda and hardware.matmul_flops and tokens:
            step_seconds = estimate_step_seconds(model, tokens, hardware.matmul_flops, accumulation, n_ckpt > 0)
        check.results.append(check_pcie(check.pcie_parts, hardware, step_seconds, "roofline estimate"))

    if policies["int4"] != "off":
        check.results.append(check_int4(model))
    return check


def write_report(args, state, hardware: HardwareReport, check: RunCheck, policies: dict, nan_policy: str) -> None:
    """Print the hardware, the constraints and the plan (local process zero), and write them with the run's settings
    to ``output_dir/hardware_report.json`` (world process zero; written whole or not at all)."""
    if state.is_local_process_zero:
        lines = ["[sits_lora] hardware", hardware.table()]
        if check.results:
            lines += ["[sits_lora] constraints", results_table(check.results)]
        if check.memory_plan is not None:
            lines.append(check.memory_plan.table())
        print("\n".join(lines), flush=True)
    if state.is_world_process_zero and args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        payload = {
            "hardware": hardware.to_dict(),
            "constraints": [r.to_dict() for r in check.results],
            "policies": policies,
            "memory_plan": check.memory_plan.to_dict() if check.memory_plan is not None else None,
            "nan_policy": nan_policy,
            "training": {"per_device_train_batch_size": args.per_device_train_batch_size,
                         "gradient_accumulation_steps": args.gradient_accumulation_steps,
                         "world_size": args.world_size, "bf16": args.bf16, "fp16": args.fp16,
                         "use_liger_kernel": bool(getattr(args, "use_liger_kernel", False))},
            "environment": environment(),
        }
        path = os.path.join(args.output_dir, REPORT_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        os.replace(tmp, path)
