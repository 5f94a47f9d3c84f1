"""Whether the native step (NativeLoraTrainer, ``native_step(SFTTrainer)``, ...) records its optimizer step as CUDA
graphs, and the one line that says why.

A recording stands for one batch shape and one whole optimizer step: it pays where the shapes repeat (fixed-length
blocks, or lengths padded to a few buckets) and every step is one batch, on one GPU, with an optimizer that can
skip a bad update on the device. Each condition that fails is named with its fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..dynamic_rank.budget import dynamic_rank_layers
from ..utils.cuda_graphs import first_line
from .memory import plan_memory
from .step import skips_updates_on_device

# examples looked at to tell fixed from varying lengths (the dataset is not read whole)
_LENGTH_SAMPLE = 64
# recordings kept for bucketed lengths: each is a set of kernels replayed from one shared memory pool
_MAX_BUCKET_GRAPHS = 8


@dataclass
class RecordingDecision:
    """``on``: the step is recorded; ``reason``: the line the trainer prints; ``max_graphs``: recordings kept;
    ``checkpointing_off``: gradient checkpointing is to be switched off for the run."""

    on: bool
    reason: str
    max_graphs: int = 2
    checkpointing_off: bool = False


@dataclass
class CheckpointingPlan:
    """Gradient checkpointing as the model has it: ``on``; ``swap``: switch it off for the run (the step without
    it fits the GPU's memory); ``detail``: the planned peak against the memory available, or why it stays on."""

    on: bool
    swap: bool = False
    detail: str = ""


# the share of the memory available to this process that a step planned without checkpointing may take: the
# plan is within a few percent of the measured peak (docs/memory.md), the rest is room for the allocator
_CHECKPOINTING_HEADROOM = 0.85


def _checkpointing_on(model: nn.Module, args: Any) -> bool:
    # transformers renamed the property (the old name warns); either says the same
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if not checkpointing:
        checkpointing = getattr(args, "activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(args, "gradient_checkpointing", False)
    return bool(checkpointing)


def plan_without_checkpointing(model: nn.Module, args: Any, inputs: dict,
                               available_bytes: Optional[int] = None) -> CheckpointingPlan:
    """Whether gradient checkpointing, where it is on, can be switched off for the run: the memory plan of this
    batch's step without it (sits_lora's LoRA layers rebuilding their inputs in backward where they do, the fused
    loss, the recording) within ``_CHECKPOINTING_HEADROOM`` of the memory available (``available_bytes``: by
    default the GPU's free memory plus what this process holds)."""
    if not _checkpointing_on(model, args):
        return CheckpointingPlan(False)
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return CheckpointingPlan(True, detail="the batches carry no 2-d input_ids to plan the step's memory with")
    if available_bytes is None:
        device = next((p.device for p in model.parameters() if p.is_cuda), None)
        if device is None:
            return CheckpointingPlan(True, detail="the model is not on a CUDA GPU, whose memory the plan is held to")
        free, _ = torch.cuda.mem_get_info(device)
        available_bytes = free + torch.cuda.memory_allocated(device)
    autocast = torch.bfloat16 if getattr(args, "bf16", False) else (
        torch.float16 if getattr(args, "fp16", False) else None)
    try:
        plan = plan_memory(model, int(ids.shape[0]), int(ids.shape[1]), gradient_checkpointing=False,
                           autocast_dtype=autocast, fused_loss=True, recorded=True,
                           padded="attention_mask" in inputs)
    except Exception as error:  # noqa: BLE001 (a plan never stops training: checkpointing stays)
        return CheckpointingPlan(True, detail=f"the step's memory could not be planned ({type(error).__name__}: "
                                              f"{first_line(error)})")
    planned, room = plan.total / 2**30, _CHECKPOINTING_HEADROOM * available_bytes / 2**30
    if plan.total > _CHECKPOINTING_HEADROOM * available_bytes:
        return CheckpointingPlan(True, detail=f"the step without it is planned at {planned:.1f} GiB, over "
                                              f"{room:.1f} GiB ({_CHECKPOINTING_HEADROOM:.0%} of the GPU memory "
                                              "available)")
    return CheckpointingPlan(True, swap=True, detail=f"the step without it is planned at {planned:.1f} GiB of "
                                                     f"{room:.1f} GiB available")


def example_lengths(train_dataset: Any, limit: int = _LENGTH_SAMPLE) -> Optional[list]:
    """The ``input_ids`` lengths of the first ``limit`` examples (a preference pair's: its prompt and longer
    completion), or None when the dataset cannot be indexed (an iterable dataset) or its examples have neither."""
    if train_dataset is None or not hasattr(train_dataset, "__len__") or not hasattr(train_dataset, "__getitem__"):
        return None
    lengths = []
    try:
        for i in range(min(len(train_dataset), limit)):
            example = train_dataset[i]
            if not isinstance(example, Mapping):
                return None
            if example.get("input_ids") is not None:
                lengths.append(len(example["input_ids"]))
            elif all(example.get(k) is not None for k in ("prompt_ids", "chosen_ids", "rejected_ids")):
                # a preference pair (TRL's DPO): the prompt with the longer of its two completions
                lengths.append(len(example["prompt_ids"]) + max(len(example["chosen_ids"]),
                                                                len(example["rejected_ids"])))
            else:
                return None
    except (KeyError, IndexError, TypeError):
        return None
    return lengths


def batch_shapes(train_dataset: Any, data_collator: Any) -> tuple[Optional[bool], str, int]:
    """(fixed: True / False / None when unknown, what was found, recordings needed) for the batches the Trainer
    will make from ``train_dataset`` through ``data_collator``."""
    padding = getattr(data_collator, "padding", None)
    max_length = getattr(data_collator, "max_length", None)
    if padding == "max_length" and max_length:
        return True, f"the collator pads every batch to {max_length} tokens", 2
    lengths = example_lengths(train_dataset)
    if lengths is None:
        return None, ("example lengths not known ahead (an iterable dataset): one recording per batch shape, at "
                      "most 2"), 2
    if not lengths:
        return None, "an empty dataset", 2
    if len(set(lengths)) == 1:
        return True, f"every example {lengths[0]} tokens", 2
    multiple = getattr(data_collator, "pad_to_multiple_of", None)
    if multiple:
        buckets = len({-(-n // multiple) for n in lengths})
        if buckets <= _MAX_BUCKET_GRAPHS:
            return True, (f"lengths {min(lengths)}-{max(lengths)} padded to multiples of {multiple}: {buckets} "
                          f"bucket(s) among the first {len(lengths)} examples"), max(2, buckets)
        return False, (f"lengths {min(lengths)}-{max(lengths)} padded to multiples of {multiple} make {buckets} "
                       f"shapes among the first {len(lengths)} examples (more than {_MAX_BUCKET_GRAPHS} recordings): "
                       "pad to a larger multiple"), 2
    return False, (f"example lengths vary ({min(lengths)}-{max(lengths)} tokens among the first {len(lengths)}) and "
                   "each batch is padded to its longest: pad to a fixed length (padding='max_length') or to a few "
                   "buckets (pad_to_multiple_of), or pack the text into fixed-length blocks"), 2


def _optimizer_step_callbacks(callbacks: Any, callback: Any) -> list:
    """The names of the callbacks, other than transformers' own and sits_lora's, that act on the optimizer step:
    under a recorded step they would find it applied already and the gradients gone."""
    from transformers import TrainerCallback

    names = []
    for cb in callbacks or ():
        if cb is callback or type(cb).__module__.split(".")[0] == "transformers":
            continue
        hooks = [hook for hook in ("on_pre_optimizer_step", "on_optimizer_step")
                 if getattr(type(cb), hook, None) is not getattr(TrainerCallback, hook)]
        if hooks:
            names.append(f"{type(cb).__name__}.{'/'.join(hooks)}")
    return names


def _gradient_hooks(model: nn.Module) -> list:
    """The trainable parameters with hooks on their gradient (register_hook, register_post_accumulate_grad_hook):
    a recording runs their Python once, and its replays repeat what that run did."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and (getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))]


def _blockers(model: nn.Module, args: Any, optimizer: Any, callback: Any, accelerator: Any,
              callbacks: Any = (), checkpointing: Optional[CheckpointingPlan] = None) -> list:
    """Every condition, other than the batch shapes, that keeps the step from being recorded, each with its fix."""
    found = []
    params = [p for p in model.parameters() if p.requires_grad]
    if not torch.cuda.is_available() or not params or not params[0].is_cuda:
        found.append("the model is not on a CUDA GPU (CUDA graphs record GPU work)")
    distributed = getattr(getattr(accelerator, "distributed_type", None), "value", "NO")
    if getattr(args, "world_size", 1) > 1 or str(distributed).upper() not in ("NO", "DISTRIBUTEDTYPE.NO"):
        found.append(f"{getattr(args, 'world_size', 1)} processes ({distributed}): the recorded step runs on one GPU")
    if getattr(args, "gradient_accumulation_steps", 1) != 1:
        found.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps} (a recording is one whole "
                     "optimizer step: set it to 1 with a larger per_device_train_batch_size)")
    if getattr(args, "fp16", False):
        found.append("fp16=True (its loss scaler decides on the host each step: use bf16=True)")
    if getattr(args, "n_gpu", 1) > 1:
        found.append(f"n_gpu={args.n_gpu} (DataParallel over several GPUs: run one process per GPU)")
    if getattr(args, "torch_compile", False):
        found.append("torch_compile=True (the compiled model records its own CUDA graphs: mode='reduce-overhead')")
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    fused = adam and skips_updates_on_device(optimizer)
    nan_policy = getattr(callback, "nan_policy", "off")
    if not adam:
        # torch's Adam and AdamW count their steps on the device when capturable; an optimizer that counts them in
        # Python would replay one step count forever
        found.append(f"optimizer {type(optimizer).__name__} (recorded: torch's Adam / AdamW; optim="
                     "'adamw_torch_fused', the default)")
    elif not fused and nan_policy != "off":
        found.append(f"optimizer {type(optimizer).__name__} without fused=True (the guard skips a bad update on "
                     "the GPU through the fused kernels: optim='adamw_torch_fused', the default)")
    if nan_policy == "clamp":
        found.append("nan_policy='clamp' (it clamps on the host, per gradient: use 'skip')")
    if getattr(callback, "detect_nonfinite_activations", False):
        found.append("detect_nonfinite_activations=True (its watch reads every module's flag on the host)")
    if dynamic_rank_layers(model):
        found.append("dynamic-rank adapters (their budget is adjusted on the host between steps)")
    outside = [type(m).__name__ for m in model.modules() if callable(getattr(m, "sits_after_optimizer_step", None))
               and not callable(getattr(m, "sits_advance_in_step", None))]
    if outside:
        found.append(f"{outside[0]}: a module whose per-step state is advanced on the host after the step (it has "
                     "sits_after_optimizer_step but no sits_advance_in_step, which a recorded step would call)")
    if checkpointing is None:
        checkpointing = CheckpointingPlan(_checkpointing_on(model, args))
    if checkpointing.on and not checkpointing.swap:
        found.append("gradient checkpointing (its recomputation is not recorded"
                     + (f"; it stays on: {checkpointing.detail})" if checkpointing.detail else ")"))
    if getattr(args, "activation_offloading", False):
        found.append("activation_offloading=True (TRL's offload of activations to the host)")
    hooked = _optimizer_step_callbacks(callbacks, callback)
    if hooked:
        found.append(f"callback {', '.join(hooked)} (the recorded step applies the update inside training_step, so "
                     "it would find the step done and the gradients gone: move it to on_step_end)")
    hooked = _gradient_hooks(model)
    if hooked:
        more = f" and {len(hooked) - 2} more" if len(hooked) > 2 else ""
        found.append(f"gradient hooks on {', '.join(hooked[:2])}{more} (a recording runs their Python once and "
                     "replays what it did)")
    return found


def _pads_only_on_the_right(inputs: dict, packed_why_not: str = "") -> tuple[bool, str]:
    """Whether the first batch's attention mask is causal attention without a mask (no mask, all ones, or ones
    then zeros per row: right padding, exact under causal attention) and no packing (no position_ids)."""
    if "position_ids" in inputs:
        why = f" ({packed_why_not})" if packed_why_not else ""
        return False, f"packed batches of varying shape{why}, as their position_ids say"
    mask = inputs.get("attention_mask")
    if mask is None:
        return True, ""
    mask = torch.as_tensor(mask)
    if mask.dim() != 2:
        return False, f"a {mask.dim()}-d attention mask"
    right = bool((mask[:, 1:] <= mask[:, :-1]).all()) and bool(mask[:, 0].all())   # read once, at the decision
    return right, "" if right else "the batches pad on the left (their attention needs the mask)"


def decide_recording(requested, *, model: nn.Module, args: Any, optimizer: Any, callback: Any, accelerator: Any,
                     train_dataset: Any, data_collator: Any, inputs: dict, loss: tuple[str, str],
                     callbacks: Any = (), checkpointing: Optional[CheckpointingPlan] = None,
                     owner: str = "NativeLoraTrainer", packed: tuple = (None, ""),
                     own_loss_waits: str = "") -> RecordingDecision:
    """Whether the native step (``record_step=requested``) records (module docstring). ``loss``: (how the
    objective's loss is named, why the trainer's own loss runs instead, "" when it does not). ``checkpointing``:
    gradient checkpointing's plan (:func:`plan_without_checkpointing`; None: as the model and args have it, kept).
    ``packed``: (the fixed-budget collator packed batches take, or None; why they do not, "" where there are none).
    ``own_loss_waits``: why the trainer's own loss, where it runs, cannot be recorded ("" when it can be tried).
    ``requested`` True raises ValueError naming every condition that fails (and ``owner``, the trainer's class)."""
    label, why_not = loss
    swap = checkpointing is not None and checkpointing.swap
    swap_note = (f"; gradient checkpointing off for this run (sits_lora's LoRA layers rebuild their inputs in "
                 f"backward instead; {checkpointing.detail})" if swap else "")
    loss_note = (f"loss: {label}" if not why_not
                 else f"loss: the trainer's own (the fused one does not apply: {why_not})")
    if requested is False:
        return RecordingDecision(False, f"off (record_step=False): eager steps; {loss_note}{swap_note}",
                                 checkpointing_off=swap)
    blockers = _blockers(model, args, optimizer, callback, accelerator, callbacks, checkpointing)
    if why_not and own_loss_waits:
        blockers.append(own_loss_waits)
    budget, packed_why_not = packed
    if budget is not None:
        fixed, shapes, graphs = True, (f"packed into {budget.budget} tokens a batch, at most {budget.capacity} "
                                       f"sequences, attention read from their boundaries"), 2
    else:
        fixed, shapes, graphs = batch_shapes(train_dataset, data_collator)
        if fixed is False and "position_ids" not in inputs:
            blockers.append(shapes)
        right, why = _pads_only_on_the_right(inputs, packed_why_not)
        if not right:
            blockers.append(why)
    if blockers:
        if requested is True:
            raise ValueError(f"{owner}(record_step=True): the step cannot be recorded: " + "; ".join(blockers)
                             + ". Fix these, or pass record_step='auto' to train with eager steps")
        return RecordingDecision(False, "off: " + "; ".join(blockers) + f" (eager steps; {loss_note}{swap_note}; "
                                 "record_step=False hides this line)", checkpointing_off=swap)
    return RecordingDecision(True, f"on: CUDA graphs of the whole optimizer step after 2 eager steps ({shapes}); "
                                   f"{loss_note}; the Trainer's logging_nan_inf_filter off (the guard leaves a "
                                   f"non-finite step unapplied on the GPU){swap_note}", graphs, checkpointing_off=swap)


__all__ = ["CheckpointingPlan", "RecordingDecision", "batch_shapes", "decide_recording", "example_lengths",
           "plan_without_checkpointing"]
