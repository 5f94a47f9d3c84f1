"""The whole optimizer step as one call, recorded as CUDA graphs: what :class:`NativeLoraTrainer` runs by default on
a GPU, and :func:`default_train_step` for a hand-written loop.

On a fast GPU a small model's eager step is as fast as the host that issues its kernels, not as the kernels: the
step is recorded once (:func:`graph_train_step`) and replayed, so the host issues one launch a step. Everything
between the batch and the updated weights is inside the recording, with nothing that waits for the GPU:

- the loss: for the causal language models whose head is a plain linear layer (:func:`fused_loss_support`), the
  decoder's hidden states go into :func:`sits_lora.ops.linear_cross_entropy` (the logits are made and consumed
  chunk by chunk, the token count stays on the device); other models use their own loss;
- the backward, then one reduction of every trainable gradient's norm: the clipping factor (``max_grad_norm``) and
  the guard's flags come from it;
- the guard: a non-finite gradient sets ``found_inf``, which the fused Adam / AdamW kernels read to leave the
  weights, their moments and their step counts as they were (the update is skipped on the GPU);
- the optimizer step and ``zero_grad(set_to_none=True)``;
- the per-step state of modules that advance it on the device (``sits_advance_in_step``: an fp8 base's delayed
  scaling), whose host side (``sits_note_advanced``) runs after each call.

The host learns of a skipped step from the flags copied back after the replay, read one step later (reading them
at once would make the host wait for the GPU at every step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..ops import linear_cross_entropy
from ..utils import validation
from .graphs import graph_train_step

logger = logging.getLogger("sits_lora")

# The causal language models whose forward is "decoder, then a bias-free linear head, then transformers'
# cross-entropy on labels shifted by one": the fused loss computes exactly what their forward's loss computes.
# Models that scale or cap their logits (Gemma's soft-capping, Cohere's logit_scale, Granite's logits_scaling)
# are left to their own forward.
FUSED_LOSS_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# model inputs the fused loss passes to the decoder (others go to the model's own forward)
DECODER_INPUTS = ("input_ids", "attention_mask", "position_ids")
IGNORE_INDEX = -100


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model under a PeftModel (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def fused_loss_support(model: nn.Module) -> tuple[bool, str]:
    """(whether :func:`causal_lm_loss` computes this model's loss, why not when it does not)."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_LOSS_MODEL_TYPES:
        return False, f"model type {model_type!r} (the fused loss covers {', '.join(FUSED_LOSS_MODEL_TYPES)})"
    head = getattr(lm, "lm_head", None)
    if type(head) is not nn.Linear or head.bias is not None:
        biased = " with a bias" if getattr(head, "bias", None) is not None else ""
        return False, (f"lm_head is a {type(head).__name__}{biased} (the fused loss reads a plain bias-free "
                       "nn.Linear head; an adapted head keeps the model's loss)")
    if not isinstance(getattr(lm, "model", None), nn.Module):
        return False, f"{type(lm).__name__} has no decoder at .model"
    return True, ""


def causal_lm_loss(model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
    """The loss a causal language model's forward computes from ``inputs`` (``labels`` shifted by one inside,
    -100 ignored; the sum over ``num_items_in_batch`` when given, else the mean over labelled tokens), computed
    from the decoder's hidden states by the fused linear cross-entropy: no logits tensor, no host sync. Only for
    models :func:`fused_loss_support` accepts."""
    lm = causal_lm(model)
    unknown = sorted(set(inputs) - set(DECODER_INPUTS) - {"labels", "shift_labels"})
    if unknown:
        raise ValueError(f"causal_lm_loss: inputs {unknown} are not decoder inputs ({', '.join(DECODER_INPUTS)}) "
                         "or labels; call the model's own forward for them")
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = torch.nn.functional.pad(inputs["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)
    decoder_inputs = {k: inputs[k] for k in DECODER_INPUTS if k in inputs}
    hidden = lm.model(**decoder_inputs, use_cache=False)[0]
    return linear_cross_entropy(hidden, lm.lm_head.weight, labels, ignore_index=IGNORE_INDEX,
                                num_items=num_items_in_batch)


@dataclass
class StepOutcome:
    """One call's results, as device tensors (reading them waits for the step): ``loss``, ``grad_norm`` (before
    clipping), ``nonfinite``, one flag per gradient in ``TrainStep.gradient_names`` order, and ``metrics``, what
    the loss function returned beside the loss (None when it returned the loss alone)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    nonfinite: torch.Tensor
    metrics: Optional[torch.Tensor] = None


class TrainStep:
    """A whole optimizer step (module docstring), recorded as CUDA graphs when ``record``. Made by
    :func:`default_train_step`; the native step (:mod:`sits_lora.training.native`) makes one per run.
    ``loss(model, inputs, num_items_in_batch)`` returns the loss, or (the loss, a metrics tensor)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float = 0.0,
                 nan_policy: str = "skip", loss: Optional[Callable] = None, record: bool = True, warmup: int = 2,
                 max_graphs: int = 2, assume_causal_attention: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.max_grad_norm = float(max_grad_norm)
        self.nan_policy = nan_policy
        self.loss = loss or causal_lm_loss
        if nan_policy not in ("skip", "raise", "off"):
            raise ValueError(f"TrainStep(nan_policy={nan_policy!r}) is invalid: 'skip', 'raise' or 'off'")
        self._guarded = nan_policy != "off"
        if self._guarded and not skips_updates_on_device(optimizer):
            raise ValueError(
                f"TrainStep(nan_policy={nan_policy!r}) leaves a non-finite step unapplied through the fused Adam / "
                f"AdamW kernels, and the optimizer is {type(optimizer).__name__}"
                f"{' without fused=True' if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) else ''}: "
                "build it with fused=True (torch.optim.AdamW(params, lr=..., fused=True)), or pass nan_policy='off'")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._named = named
        self.gradient_names: list = []     # the gradients of the last call, in the flags' order
        device = named[0][1].device if named else torch.device("cpu")
        # read by the fused Adam / AdamW kernels (torch's GradScaler protocol): non-zero leaves the update undone
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # modules whose per-step state the step advances itself, after the update (an fp8 base's delayed scaling):
        # their device work is recorded with the step, their host bookkeeping runs after each call
        self._advanced_in_step = [m for m in model.modules() if callable(getattr(m, "sits_advance_in_step", None))]
        self.recorded = None
        if record:
            self.recorded = graph_train_step(self._step, optimizer, model=model, warmup=warmup,
                                             max_graphs=max_graphs, assume_causal_attention=assume_causal_attention)

    def __call__(self, num_items_in_batch: Any = None, **inputs: Any) -> torch.Tensor:
        """One optimizer step on ``inputs`` (model keyword arguments, ``labels`` included); the loss."""
        return self.run(inputs, num_items_in_batch).loss

    def run(self, inputs: dict, num_items_in_batch: Any = None) -> StepOutcome:
        if isinstance(num_items_in_batch, (int, float)) and not isinstance(num_items_in_batch, bool):
            # a Python count would be a new recording per value: a 0-dim tensor is an input the replays read
            # (a fill on the device: a copy from the host would wait for the stream)
            num_items_in_batch = torch.full((), float(num_items_in_batch), device=self._found_inf.device)
        elif torch.is_tensor(num_items_in_batch) and num_items_in_batch.device != self._found_inf.device:
            # counted on the host from the batch: a CPU tensor would make the call unrecordable
            num_items_in_batch = num_items_in_batch.to(self._found_inf.device, non_blocking=True)
        step = self.recorded if self.recorded is not None else self._step
        # a plain dict: collators hand over a BatchEncoding, which a recording's signature does not describe
        outcome = StepOutcome(*step(dict(inputs), num_items_in_batch))
        for module in self._advanced_in_step:
            module.sits_note_advanced()
        return outcome

    def _step(self, inputs: dict, num_items_in_batch: Any) -> tuple:
        loss = self.loss(self.model, inputs, num_items_in_batch)
        metrics = None
        if isinstance(loss, tuple):           # (loss, metrics): an objective's (sits_lora.training.objectives)
            loss, metrics = loss
        loss.backward()
        with_grad = [(n, p.grad) for n, p in self._named if p.grad is not None]
        if not with_grad:
            raise RuntimeError("TrainStep: the loss reached no trainable parameter (every requires_grad parameter "
                               "got no gradient): check that the adapters are in the model's forward")
        # grouped by dtype (one foreach launch a group); the flags and the names follow this order
        with_grad.sort(key=lambda item: str(item[1].dtype))
        self.gradient_names = [n for n, _ in with_grad]
        groups = _by_dtype([g for _, g in with_grad])
        norms = gradient_norms(groups)                               # float32, one a gradient
        total = torch.linalg.vector_norm(norms)
        nonfinite = ~torch.isfinite(norms)
        if self.max_grad_norm > 0:
            # clip_grad_norm_'s factor without its host check; a non-finite total makes it NaN, and that update
            # is skipped below
            factor = (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0)
            for group in groups.values():
                torch._foreach_mul_(group, factor)
        if self._guarded:
            self._found_inf.copy_((~torch.isfinite(total)).float())
            self.optimizer.found_inf = self._found_inf
        try:
            self.optimizer.step()
        finally:
            if self._guarded:
                del self.optimizer.found_inf
        self.optimizer.zero_grad(set_to_none=True)
        for module in self._advanced_in_step:   # a skipped update advances them too (a NaN amax backs a scale off)
            module.sits_advance_in_step()
        return loss.detach(), total, nonfinite, None if metrics is None else metrics.detach()


def _by_dtype(tensors: list) -> dict:
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def gradient_norms(groups: dict) -> torch.Tensor:
    """Every gradient's 2-norm as one float32 vector, from {dtype: gradients} (one foreach launch a dtype), in
    the groups' order. In float32: fp16 gradients' norms overflow their own dtype while every value is finite."""
    return torch.cat([torch.stack(torch._foreach_norm(group, 2.0, dtype=torch.float32)) for group in groups.values()])


def skips_updates_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` skips its update on the device when ``found_inf`` is set: torch's fused Adam and
    AdamW (the other implementations refuse the argument)."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(
        group.get("fused") for group in optimizer.param_groups)


def default_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float = 1.0,
                       nan_policy: str = "skip", record: Optional[bool] = None, warmup: int = 2,
                       max_graphs: int = 2) -> TrainStep:
    """The step :class:`NativeLoraTrainer` runs by default, for a hand-written loop::

        step = default_train_step(model, torch.optim.AdamW(params, lr=2e-4, fused=True))
        for batch in loader:                  # fixed shapes: one recording
            loss = step(**batch)              # input_ids, attention_mask, labels on the GPU

    ``record``: record CUDA graphs (default: on CUDA). ``nan_policy``: "skip" leaves a step with a non-finite
    gradient unapplied on the GPU (torch's Adam / AdamW with ``fused=True``), "off" applies every step. The loss
    is the fused cross-entropy for the models :func:`fused_loss_support` accepts, else the model's own ``loss``. Batches must
    not pack several sequences into one row nor pad on the left (the recording makes attention causal without a
    mask, as an eager step on such batches does)."""
    validation.check_arguments(
        "default_train_step",
        nan_policy=(nan_policy, validation.choice(("skip", "off"), " (the trainer's 'raise' reads the flags itself: "
                                                                   "StepOutcome.nonfinite)")),
        max_grad_norm=(max_grad_norm, validation.non_negative_number(" (0: no clipping)")))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("default_train_step: the model has no trainable parameter (apply an adapter first)")
    if record is None:
        record = params[0].is_cuda
    supported, why = fused_loss_support(model)
    loss = causal_lm_loss if supported else _model_loss
    if not supported:
        logger.info("default_train_step: the model's own loss (the fused one does not apply: %s)", why)
    return TrainStep(model, optimizer, max_grad_norm=max_grad_norm, nan_policy=nan_policy, loss=loss, record=record,
                     warmup=warmup, max_graphs=max_graphs)


def _model_loss(model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
    kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    return model(**inputs, **kwargs).loss


__all__ = ["DECODER_INPUTS", "FUSED_LOSS_MODEL_TYPES", "StepOutcome", "TrainStep", "causal_lm", "causal_lm_loss",
           "default_train_step", "fused_loss_support", "gradient_norms", "skips_updates_on_device"]
