"""What a trainer's training micro-batch computes, the way the native step computes it: the loss and the metrics the
trainer logs, from the decoder's hidden states through the fused linear cross-entropy, on the device and without a
host sync, so that the whole optimizer step can be recorded as CUDA graphs (``sits_lora.training.step``).

One objective per kind of trainer, chosen from its class (:func:`objective_for`):

- ``CausalLMObjective``, ``transformers.Trainer``: the causal language model's own loss (labels shifted by one,
  -100 ignored), no metrics;
- ``SFTObjective``, TRL's ``SFTTrainer``: its negative log-likelihood loss, and the metrics its ``compute_loss``
  logs (``entropy``, ``mean_token_accuracy``, ``num_tokens``);
- ``DPOObjective``, TRL's ``DPOTrainer``: the policy forward over [chosen; rejected], the reference forward with the
  adapters disabled (or the precomputed reference log-probabilities), its losses, and its metrics (rewards,
  margins, accuracies, log-probabilities, logits, entropy, token accuracy).

TRL's own ``compute_loss`` reads every metric with ``.item()`` and picks the labelled positions with a boolean mask;
both wait for the GPU. Here a micro-batch returns its metrics as one fp32 vector on the device; the trainer keeps
them and hands them to TRL's metric lists at its next log (:meth:`Objective.publish`), when the Trainer reads the
loss anyway. The values are the ones TRL's own path logs: the same per-token arithmetic (``sits_lora.ops``'s
PyTorch path spells it as TRL's chunked log-probabilities do), reduced over the same (batch, length - 1) layout.

Each objective says, in :meth:`Objective.unsupported`, which trainer settings it does not compute (a DPO loss type
it does not know, a custom ``compute_loss``, ...): the trainer then keeps its own loss, eagerly, and says why.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.cross_entropy import linear_cross_entropy_rows
from .packing import PACKED_TOKENS
from .step import DECODER_INPUTS, IGNORE_INDEX, causal_lm, causal_lm_loss, fused_loss_support

# What TRL's collator adds to a padding-free (packed) batch, passed to the decoder as TRL's own forward passes it:
# the attention kernels read the sequence boundaries from them
PACKED_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

# The DPO losses computed here (TRL's DPOConfig.loss_type); TRL's others (aot and aot_unpaired sort the batch,
# exo_pair, discopop, and sft, which picks the chosen tokens with a boolean mask) keep TRL's own loss.
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "bco_pair", "sppo_hard", "nca_pair", "apo_zero", "apo_down",
              "sigmoid_norm")


def trl_trainer(trainer: Any, name: Optional[str] = None) -> bool:
    """Whether ``trainer`` is TRL's trainer ``name`` or a subclass of it (any of TRL's when ``name`` is None), without
    importing TRL (read from the MRO)."""
    return any(cls.__module__.split(".")[0] == "trl" and name in (None, cls.__name__) for cls in type(trainer).__mro__)


def _defining_class(trainer: Any, method: str) -> type:
    """The first class of ``trainer``'s MRO that defines ``method``, sits_lora's own step mixin aside (whose
    compute_loss runs the objective)."""
    return next(cls for cls in type(trainer).__mro__
                if method in vars(cls) and not cls.__module__.startswith("sits_lora."))


class Objective:
    """One micro-batch's loss and metrics for one kind of trainer (module docstring)."""

    label = ""                        # how the decision line names this loss
    metric_names: tuple = ()          # the order of the metrics vector

    def unsupported(self, trainer: Any, model: nn.Module, inputs: dict) -> str:
        """Why this objective does not compute ``trainer``'s loss on batches like ``inputs`` ("" when it does)."""
        raise NotImplementedError

    def __call__(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> tuple:
        """(the loss to backpropagate, the metrics as one fp32 vector in ``metric_names`` order, or None)."""
        raise NotImplementedError

    def publish(self, trainer: Any, rows: list) -> None:
        """Hand the metrics of the micro-batches since the last log (one list of floats each) to the trainer."""


class CausalLMObjective(Objective):
    """``transformers.Trainer``: the causal LM loss the model's forward computes, no metrics."""

    label = "the fused linear cross-entropy without host syncs"

    def unsupported(self, trainer, model, inputs) -> str:
        from transformers import Trainer

        why = _model_unsupported(model)
        if why:
            return why
        if trainer.compute_loss_func is not None:
            return "compute_loss_func is set"
        if getattr(trainer.args, "label_smoothing_factor", 0):
            return f"label_smoothing_factor={trainer.args.label_smoothing_factor}"
        if _defining_class(trainer, "compute_loss") is not Trainer:
            return f"{_defining_class(trainer, 'compute_loss').__name__} overrides compute_loss"
        extra = sorted(set(inputs) - set(DECODER_INPUTS) - {"labels", "shift_labels"})
        if extra:
            return f"the batches carry {', '.join(extra)}"
        if "labels" not in inputs and "shift_labels" not in inputs:
            return "the batches carry no labels"
        return ""

    def __call__(self, model, inputs, num_items_in_batch=None):
        return causal_lm_loss(model, inputs, num_items_in_batch), None


def _shifted_rows(model: nn.Module, inputs: dict, labels: Tensor, stats: bool):
    """The decoder's hidden states for ``inputs`` scored against ``labels`` shifted by one, per position: a
    :class:`~sits_lora.ops.cross_entropy.RowStatistics` of (batch, length - 1) tensors, laid out as TRL's fused head
    lays them out (position t scores token t + 1; the last position scores none and is left out)."""
    lm = causal_lm(model)
    decoder_inputs = {k: inputs[k] for k in DECODER_INPUTS + PACKED_INPUTS if k in inputs}
    hidden = lm.model(**decoder_inputs, use_cache=False)[0]                       # (B, T, H)
    return linear_cross_entropy_rows(hidden[:, :-1], lm.lm_head.weight, labels[:, 1:], ignore_index=IGNORE_INDEX,
                                     stats=stats)


def skipped_hooks(model: nn.Module) -> str:
    """The forward hooks the objective's direct call of the decoder and of the head's weight would skip: those on
    the model the trainer calls, on the causal LM under it, and on its lm_head ("" when there are none)."""
    lm = causal_lm(model)
    found = []
    for name, module in (("the model", model), ("the causal LM", lm), ("lm_head", getattr(lm, "lm_head", None))):
        if module is None:
            continue
        hooks = [h for d in (module._forward_hooks, module._forward_pre_hooks) for h in d.values()]
        if hooks:
            owners = sorted({type(getattr(h, "__self__", h)).__name__ for h in hooks})
            found.append(f"{name} ({', '.join(owners)})")
    if not found:
        return ""
    return ("forward hooks on " + ", ".join(dict.fromkeys(found)) + ", which the fused loss would skip (it calls "
            "the decoder and reads the head's weight directly)")


def _mean_or_zero(total: Tensor, count: Tensor) -> Tensor:
    """total / count where count > 0, else 0: TRL's ``(total / count).item() if count > 0 else 0.0`` on the device."""
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total, dtype=torch.float32))


def _model_unsupported(model: nn.Module) -> str:
    """Why the fused loss cannot stand for ``model``'s own ("" when it can): its head, or hooks it would skip."""
    supported, why = fused_loss_support(model)
    return why if not supported else skipped_hooks(model)


def _common_unsupported(trainer: Any, model: nn.Module, inputs: dict, own_class: str) -> str:
    """What the TRL objectives share of :meth:`Objective.unsupported`."""
    why = _model_unsupported(model)
    if why:
        return why
    head = causal_lm(model).lm_head
    if head.weight.requires_grad:
        return "the lm_head trains (the per-token loss leaves its weight without a gradient)"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the model's MoE router loss (output_router_logits)"
    owner = _defining_class(trainer, "compute_loss")
    if owner.__name__ != own_class or owner.__module__.split(".")[0] != "trl":
        return f"{owner.__name__} overrides compute_loss"
    peft_config = getattr(model, "peft_config", None) or {}
    if any(getattr(c, "num_virtual_tokens", None) for c in peft_config.values()):
        return "a prompt-learning adapter (virtual tokens before the inputs)"
    return ""


class SFTObjective(Objective):
    """TRL's ``SFTTrainer``: ``loss_type="nll"``, its entropy, mean token accuracy and token count."""

    label = "TRL SFTTrainer's loss and metrics (entropy, mean_token_accuracy, num_tokens) by the fused linear " \
            "cross-entropy, on the GPU"
    metric_names = ("entropy", "mean_token_accuracy", "num_tokens")

    def __init__(self, trainer: Any) -> None:
        args = trainer.args
        self.average_tokens = bool(getattr(args, "average_tokens_across_devices", False))
        self.processes = trainer.accelerator.num_processes // max(1, trainer.get_tp_size()) \
            if hasattr(trainer, "get_tp_size") else trainer.accelerator.num_processes

    def unsupported(self, trainer, model, inputs) -> str:
        why = _common_unsupported(trainer, model, inputs, "SFTTrainer")
        if why:
            return why
        args = trainer.args
        if getattr(args, "loss_type", "nll") != "nll":
            return f"loss_type={args.loss_type!r} (computed here: 'nll')"
        if trainer.compute_loss_func is not None:
            return "compute_loss_func is set"
        if getattr(trainer, "label_smoother", None) is not None:
            return f"label_smoothing_factor={args.label_smoothing_factor}"
        extra = sorted(set(inputs) - set(DECODER_INPUTS) - set(PACKED_INPUTS) - {"labels", PACKED_TOKENS})
        if extra:
            return f"the batches carry {', '.join(extra)}"
        if "labels" not in inputs:
            return "the batches carry no labels"
        return ""

    def __call__(self, model, inputs, num_items_in_batch=None):
        labels = inputs["labels"]
        rows = _shifted_rows(model, inputs, labels, stats=True)                      # (B, T-1) each
        label_mask = labels[..., 1:] != IGNORE_INDEX
        count = label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = rows.loss.sum() / torch.as_tensor(count).clamp(min=1)
        if self.average_tokens and num_items_in_batch is not None and self.processes != 1:
            loss = loss * self.processes
        num_valid = label_mask.sum()
        if PACKED_TOKENS in inputs:            # a packed batch padded to its budget: TRL counts it unpadded
            tokens = inputs[PACKED_TOKENS]
        elif "attention_mask" in inputs:
            tokens = inputs["attention_mask"].sum()
        else:
            tokens = torch.full((), inputs["input_ids"].shape[-1], device=labels.device)
        metrics = torch.stack([_mean_or_zero(rows.entropy.sum(), num_valid),
                               _mean_or_zero(rows.is_top1.sum(), num_valid),
                               tokens.float()])
        return loss, metrics.float()

    def publish(self, trainer, rows) -> None:
        metrics = trainer._metrics["train"]
        for entropy, accuracy, tokens in rows:
            metrics["entropy"].append(entropy)
            metrics["mean_token_accuracy"].append(accuracy)
            trainer._total_train_tokens += int(tokens) // getattr(trainer, "_tp_size", 1)
        metrics["num_tokens"] = [trainer._total_train_tokens]


class DPOObjective(Objective):
    """TRL's ``DPOTrainer`` with a PEFT adapter and no separate reference model: the reference is the model with
    its adapters disabled (or the precomputed log-probabilities the batches carry)."""

    label = "TRL DPOTrainer's loss and metrics (rewards, margins, accuracies, log-probabilities, logits, entropy) " \
            "by the fused linear cross-entropy, the reference with the adapters disabled, on the GPU"
    metric_names = ("entropy", "num_tokens", "chosen_logit_sum", "chosen_tokens",
                    "rejected_logit_sum", "rejected_tokens", "mean_token_accuracy", "rewards/chosen",
                    "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")

    def __init__(self, trainer: Any) -> None:
        self.beta = float(trainer.beta)
        self.loss_types = list(trainer.loss_types)
        self.loss_weights = list(trainer.loss_weights)
        self.label_smoothing = float(getattr(trainer, "label_smoothing", 0.0))
        self.precomputed = bool(getattr(trainer, "precompute_ref_logps", False))
        self.unwrap = trainer.accelerator.unwrap_model

    def unsupported(self, trainer, model, inputs) -> str:
        why = _common_unsupported(trainer, model, inputs, "DPOTrainer")
        if why:
            return why
        unknown = [t for t in trainer.loss_types if t not in DPO_LOSSES]
        if unknown:
            return f"loss_type {', '.join(map(repr, unknown))} (computed here: {', '.join(DPO_LOSSES)})"
        divergence = getattr(trainer, "f_divergence_type", "reverse_kl")
        divergence = getattr(divergence, "value", divergence)
        if divergence != "reverse_kl" and not (
                divergence == "alpha_divergence" and abs(trainer.f_alpha_divergence_coef - 1.0) < 1e-6):
            return f"f_divergence_type={divergence!r} (computed here: 'reverse_kl')"
        if getattr(trainer, "ld_alpha", None) is not None:
            return f"ld_alpha={trainer.ld_alpha}"
        if getattr(trainer, "use_weighting", False):
            return "use_weighting=True"
        if not self.precomputed:
            if getattr(trainer, "ref_model", None) is not None:
                return "a separate reference model (computed here: the adapters disabled, or precomputed)"
            unwrapped = trainer.accelerator.unwrap_model(model)
            if not callable(getattr(unwrapped, "disable_adapter", None)):
                return "a model without PEFT adapters (its reference would be itself)"
            if "ref" in (getattr(unwrapped, "peft_config", None) or {}):
                return "a 'ref' adapter (computed here: the adapters disabled)"
        known = {"input_ids", "attention_mask", "completion_mask"}
        if self.precomputed:
            known |= {"ref_chosen_logps", "ref_rejected_logps"}
        extra = sorted(set(inputs) - known)
        if extra:
            return f"the batches carry {', '.join(extra)}"
        missing = sorted(known - set(inputs))
        if missing:
            return f"the batches lack {', '.join(missing)}"
        return ""

    def _logps(self, model, inputs, labels, stats: bool):
        rows = _shifted_rows(model, inputs, labels, stats)                            # (2B, L-1) each
        return rows, -rows.loss.sum(dim=1)                                            # per-sequence log p

    def __call__(self, model, inputs, num_items_in_batch=None):
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, IGNORE_INDEX)
        decoder_inputs = {k: inputs[k] for k in ("input_ids", "attention_mask")}
        rows, logps = self._logps(model, decoder_inputs, labels, stats=True)
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)
        if self.precomputed:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            with torch.no_grad(), self.unwrap(model).disable_adapter():
                _, ref_logps = self._logps(model, decoder_inputs, labels, stats=False)
            ref_chosen, ref_rejected = ref_logps.chunk(2, dim=0)
        chosen_ratios = chosen_logps - ref_chosen
        rejected_ratios = rejected_logps - ref_rejected
        loss = 0.0
        for loss_type, weight in zip(self.loss_types, self.loss_weights):
            loss = loss + self._per_sequence(loss_type, chosen_ratios, rejected_ratios, completion_mask).mean() \
                * weight
        return loss, self._metrics(inputs, rows, completion_mask, chosen_logps, rejected_logps, chosen_ratios,
                                   rejected_ratios)

    def _per_sequence(self, loss_type: str, chosen: Tensor, rejected: Tensor, completion_mask: Tensor) -> Tensor:
        """TRL's per-sequence loss of ``loss_type`` from the chosen and rejected log-ratios (reverse KL scores)."""
        beta, smoothing = self.beta, self.label_smoothing
        delta = chosen - rejected
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if loss_type in ("ipo", "sigmoid_norm"):
            # divided by each completion's length
            chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
            normed = chosen / chosen_mask.sum(dim=1).clamp(min=1.0) - rejected / rejected_mask.sum(dim=1).clamp(
                min=1.0)
            if loss_type == "ipo":
                return (normed - 1 / (2 * beta)) ** 2
            return -F.logsigmoid(beta * normed)
        if loss_type == "robust":
            clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
            flipped = -smoothing * F.logsigmoid(-beta * delta)
            return (clean - flipped) / (1 - 2 * smoothing)
        if loss_type == "bco_pair":
            return -F.logsigmoid(beta * chosen) - F.logsigmoid(-(beta * rejected))
        if loss_type == "sppo_hard":
            return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
        if loss_type == "nca_pair":
            chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
            return (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
                    - 0.5 * F.logsigmoid(-rejected_rewards))
        if loss_type == "apo_zero":
            return (1 - torch.sigmoid(beta * chosen)) + torch.sigmoid(beta * rejected)
        if loss_type == "apo_down":
            return torch.sigmoid(beta * chosen) + (1 - torch.sigmoid(beta * (chosen - rejected)))
        raise ValueError(f"DPOObjective: loss_type {loss_type!r} is not computed here ({', '.join(DPO_LOSSES)})")

    def _metrics(self, inputs, rows, completion_mask, chosen_logps, rejected_logps, chosen_ratios,
                 rejected_ratios) -> Tensor:
        mask = completion_mask[..., 1:]                                              # (2B, L-1)
        chosen_mask, rejected_mask = mask.chunk(2, dim=0)
        chosen_mean_logits, rejected_mean_logits = rows.mean_logit.chunk(2, dim=0)
        chosen_top1, _ = rows.is_top1.chunk(2, dim=0)
        chosen_tokens = chosen_mask.sum()
        chosen_rewards = self.beta * chosen_ratios.detach()
        rejected_rewards = self.beta * rejected_ratios.detach()
        values = [
            _mean_or_zero((rows.entropy * mask).sum(), mask.sum()), inputs["attention_mask"].sum(),
            (chosen_mean_logits * chosen_mask).sum(), chosen_tokens,
            (rejected_mean_logits * rejected_mask).sum(), rejected_mask.sum(),
            _mean_or_zero((chosen_top1 & chosen_mask.bool()).sum(), chosen_tokens),
            chosen_rewards.mean(), rejected_rewards.mean(), (chosen_rewards > rejected_rewards).float().mean(),
            (chosen_rewards - rejected_rewards).mean(), chosen_logps.detach().mean(), rejected_logps.detach().mean(),
        ]
        return torch.stack([v.float() for v in values])

    def publish(self, trainer, rows) -> None:
        metrics = trainer._metrics["train"]
        for row in rows:
            values = dict(zip(self.metric_names, row))
            # in TRL's order; the mean logits divided on the host in double precision, as TRL divides them
            metrics["entropy"].append(values["entropy"])
            trainer._total_train_tokens += int(values["num_tokens"]) // getattr(trainer, "_tp_size", 1)
            for side in ("chosen", "rejected"):
                tokens = int(values[f"{side}_tokens"])
                metrics[f"logits/{side}"].append(values[f"{side}_logit_sum"] / tokens if tokens > 0 else 0.0)
            for name in ("mean_token_accuracy", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                         "rewards/margins", "logps/chosen", "logps/rejected"):
                metrics[name].append(values[name])
        metrics["num_tokens"] = [trainer._total_train_tokens]


def objective_for(trainer: Any) -> Optional[Objective]:
    """The objective of ``trainer``'s kind (TRL's SFTTrainer, DPOTrainer, else a transformers Trainer); None for a
    trainer of another library's kind (its own loss then runs)."""
    if trl_trainer(trainer, "SFTTrainer"):
        return SFTObjective(trainer)
    if trl_trainer(trainer, "DPOTrainer"):
        return DPOObjective(trainer)
    if trl_trainer(trainer):
        return None     # TRL's other trainers (GRPO, KTO, ...): their own losses
    return CausalLMObjective()


__all__ = ["DPO_LOSSES", "CausalLMObjective", "DPOObjective", "Objective", "SFTObjective", "objective_for",
           "trl_trainer"]
