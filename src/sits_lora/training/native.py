"""sits_lora's training step for any ``transformers.Trainer``: TRL's ``SFTTrainer`` and ``DPOTrainer``, a plain
``Trainer``, or a subclass of one of them.

    from trl import SFTTrainer
    import sits_lora
    trainer = sits_lora.native_step(SFTTrainer)(model=model, args=SFTConfig(...), train_dataset=ds,
                                                peft_config=sits_lora.SitsLoraConfig(...))

``native_step(TrainerClass)`` is ``TrainerClass`` with :class:`NativeStepMixin` in front; ``native_step(trainer)``
turns a trainer already built into one. What the mixin changes, and nothing else:

- the loss: the trainer's own (TRL's SFT or DPO loss, the causal LM loss) computed from the decoder's hidden states
  by the fused linear cross-entropy, with the metrics TRL logs kept on the GPU and handed to it at the next log
  (:mod:`sits_lora.training.objectives`); a setting the objective does not compute keeps the trainer's own loss;
- on one CUDA GPU with fixed batch shapes, the whole optimizer step recorded as CUDA graphs and replayed
  (:mod:`sits_lora.training.step`, decided by :mod:`sits_lora.training.recording`), with one line at the first
  step that says whether it records and why not (``trainer.step_recording``);
- gradient checkpointing, when the memory plan puts the step without it within the GPU's memory: switched off for
  the run (sits_lora's LoRA layers rebuild their inputs in backward instead), and said in the same line;
- packed SFT batches (``SFTConfig(packing=True)``): padded to a fixed token budget with their sequence boundaries
  as device tensors, and the model's attention read from those boundaries (:mod:`sits_lora.training.packing`),
  so that they record too;
- :class:`SitsHardwareCallback`'s guard right after the backward, before the gradient norm; batches copied to the
  GPU without blocking the host.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from ..utils.cuda_graphs import first_line
from .callback import SitsHardwareCallback
from .graphs import GraphCaptureError
from .objectives import objective_for, trl_trainer
from .packing import ATTENTION, budget_packing_support, register_varlen_attention, varlen_kernel_support
from .recording import RecordingDecision, decide_recording, plan_without_checkpointing
from .step import TrainStep, causal_lm

logger = logging.getLogger("sits_lora")
RECORD_STEP_VALUES = ("auto", True, False)


def copies_batches_without_blocking(args) -> bool:
    """Whether the native step turns on accelerate's non-blocking batch copy for these TrainingArguments: a CUDA
    run whose DataLoader pins its batches."""
    return bool(args.dataloader_pin_memory) and torch.cuda.is_available() and not args.use_cpu


def _check_record_step(record_step, owner: str) -> None:
    if record_step not in RECORD_STEP_VALUES or not isinstance(record_step, (str, bool)):
        raise ValueError(f"{owner}(record_step={record_step!r}) is invalid: allowed values are 'auto' (record the "
                         "optimizer step as CUDA graphs where it can be), True (always; raise where it cannot) and "
                         "False (eager steps)")


def _with_callbacks(callbacks: Optional[list], model: Any) -> list:
    """``callbacks`` plus a SitsHardwareCallback and, for dynamic-rank adapters, a DynamicRankCallback, each with
    its defaults where none is given."""
    callbacks = list(callbacks or [])
    if not any(isinstance(c, SitsHardwareCallback) or c is SitsHardwareCallback for c in callbacks):
        callbacks.append(SitsHardwareCallback())
    if isinstance(model, nn.Module):
        # Imported here: dynamic_rank's callback module loads only for models that use it.
        from ..dynamic_rank.budget import dynamic_rank_layers

        if dynamic_rank_layers(model):
            from ..dynamic_rank.callback import DynamicRankCallback

            if not any(isinstance(c, DynamicRankCallback) or c is DynamicRankCallback for c in callbacks):
                callbacks.append(DynamicRankCallback())
    return callbacks


def _own_loss_waits(trainer: Any) -> str:
    """Why the trainer's own loss cannot be recorded ("" where a recording may be tried): TRL's trainers read their
    metrics on the host at every step."""
    if trl_trainer(trainer):
        return "TRL's own compute_loss reads its metrics on the host at every step (.item())"
    return ""


def _budget_blocker(device: torch.device, head_dim: int) -> str:
    """Why packed batches keep TRL's own shapes on ``device`` ("" when they take a fixed budget): a budget pays only
    where the step records, on a CUDA GPU with a varlen attention kernel for heads of ``head_dim``."""
    if device.type != "cuda":
        return "the model is not on a CUDA GPU"
    return varlen_kernel_support(device, head_dim)


def _set_checkpointing(model: nn.Module, on: bool, args: Any) -> None:
    """Gradient checkpointing on (with the run's kwargs) or off, under transformers' newer name where it has it."""
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if not on:
        getattr(model, f"{prefix}_checkpointing_disable")()
        return
    kwargs = getattr(args, f"{prefix}_checkpointing_kwargs", None)
    getattr(model, f"{prefix}_checkpointing_enable")(**{f"{prefix}_checkpointing_kwargs": kwargs})


class NativeStepMixin:
    """Put in front of a ``transformers.Trainer`` subclass (``class MyTrainer(NativeStepMixin, SFTTrainer)``, or
    :func:`native_step`): the module docstring says what it changes. Takes the trainer's arguments plus
    ``record_step`` ("auto", True, False): "auto" records where it can and says why not in one line at the first
    step; True raises instead of running eagerly; False keeps eager steps.

    Beyond what :class:`SitsHardwareCallback` does under a plain Trainer, it guarantees that the NaN / Inf gradient
    guard runs right after the last micro-batch's backward, *before* the Trainer computes the gradient norm (whose
    clipping would turn every gradient into NaN first); ``nonfinite_steps`` and ``clamped_values`` are in every
    training log entry; a model with dynamic-rank adapters trains under its rank budget (a DynamicRankCallback is
    added when none is given). Under a recorded step the guard's host-side bookkeeping (counts, warnings, "raise")
    reads each step's flags one step later: the bad step's update was already left undone on the GPU.
    """

    def __init__(self, *args, callbacks: Optional[list] = None, record_step="auto", **kwargs):
        _check_record_step(record_step, type(self).__name__)
        self._native_init(record_step)
        model = kwargs.get("model", args[0] if args else None)
        super().__init__(*args, callbacks=_with_callbacks(callbacks, model), **kwargs)

    def _native_init(self, record_step) -> None:
        self.record_step = record_step
        self.step_recording: Optional[RecordingDecision] = None   # decided at the first training step
        self._objective = None              # what computes the loss (None: the trainer's own compute_loss)
        self._pending_metrics: list = []    # the objective's per-micro-batch metric vectors, on the device
        self._train_step = None
        self._recorded_grad_norm = None
        self._nan_filter_setting = None
        self._checkpointing_off = False     # switched off by the decision; back on when train() returns
        self._packing = None                # (the budget collator, the attention it replaced) for packed batches
        self._packing_why_not = ""

    def create_accelerator_and_postprocess(self) -> None:
        # Each batch reaches the GPU without the host waiting: a blocking copy (accelerate's default) waits for every
        # kernel queued before it, so the host could not prepare the next step while the GPU runs this one (a recorded
        # step then waits once a step). The DataLoader already pins its batches (dataloader_pin_memory), which is what
        # makes a non-blocking copy safe and asynchronous; with pinning off the copy stays as the user set it.
        if copies_batches_without_blocking(self.args):
            self.args.accelerator_config.non_blocking = True
        super().create_accelerator_and_postprocess()

    def train(self, *args, **kwargs):
        self.step_recording = self._train_step = self._objective = None   # decided again at this run's first step
        self._pending_metrics = []
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._packing is not None:
                causal_lm(self.model).set_attn_implementation(self._packing[1])
                self._packing = None
            if self._nan_filter_setting is not None:
                self.args.logging_nan_inf_filter, self._nan_filter_setting = self._nan_filter_setting, None
            if self._checkpointing_off:
                self._checkpointing_off = False
                _set_checkpointing(self.model, True, self.args)

    def get_train_dataloader(self):
        # Packed batches that can be recorded are padded to a fixed budget from the first batch on: the decision at
        # the first step then sees batches of one shape (sits_lora.training.packing)
        self._packing_why_not, budget = self._budget_packing()
        if budget is None:
            return super().get_train_dataloader()
        register_varlen_attention()
        lm = causal_lm(self.model)
        self._packing = (budget, lm.config._attn_implementation)
        lm.set_attn_implementation(ATTENTION)
        collator, self.data_collator = self.data_collator, budget
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    def _budget_packing(self) -> tuple:
        """(why packed batches keep TRL's own shapes, "" when they take a fixed budget; the budget collator)."""
        if self.record_step is False or not trl_trainer(self, "SFTTrainer"):
            return "", None
        why, budget = budget_packing_support(self)
        if budget is None:
            return why, None
        config = causal_lm(self.model).config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        why = _budget_blocker(next((p.device for p in self.model.parameters()), torch.device("cpu")), head_dim)
        return (why, None) if why else ("", budget)

    def sits_callback(self) -> Optional[SitsHardwareCallback]:
        """The SitsHardwareCallback this trainer runs (the Trainer may replace it when restoring callback state)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, SitsHardwareCallback):
                return callback
        return None

    # ------------------------------------------------------------------ the step

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)   # under accelerate's wrapper
        if self._train_step is not None and self._train_step.optimizer is not optimizer:
            self.step_recording = self._train_step = None   # another optimizer (a new train()): decide again
        if self.step_recording is None:
            self._decide_recording(model, inputs)
        if self._train_step is not None:
            try:
                return self._recorded_training_step(model, inputs, num_items_in_batch)
            except GraphCaptureError as error:
                # nothing of this step was applied: it runs eagerly below, and so do the next ones
                self._train_step = None
                self.step_recording = RecordingDecision(False, f"off: the step could not be recorded "
                                                               f"({first_line(error)}); eager steps from here")
                logger.warning("sits_lora: step recording %s\n%s", self.step_recording.reason, error)
        loss = super().training_step(model, inputs, num_items_in_batch)
        callback = self.sits_callback()
        if callback is not None:
            # The Trainer sets sync_gradients before each micro-batch: True on the last one of an
            # optimizer step, the one after which it clips and steps.
            callback.after_backward(self.model, self.state, self.args, sync=bool(self.accelerator.sync_gradients))
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._objective is None or return_outputs or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        loss, metrics = self._objective_loss(model, inputs, num_items_in_batch)
        if metrics is not None:
            self._pending_metrics.append(metrics.detach())
        return loss

    def _objective_loss(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> tuple:
        # the autocast accelerate wraps the model's forward in (mixed precision), which the decoder call skips
        with self.accelerator.autocast():
            return self._objective(model, dict(inputs), num_items_in_batch)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._pending_metrics:
            # one read of every micro-batch's metrics since the last log: the Trainer reads the loss here anyway
            pending, self._pending_metrics = self._pending_metrics, []
            self._objective.publish(self, torch.stack(pending).tolist())
        callback = self.sits_callback()
        if callback is not None and "loss" in logs:
            callback.resolve_recorded_steps()
            logs.update(callback.log_counts())
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ the decision

    def _decide_recording(self, model: nn.Module, inputs: dict) -> None:
        callback = self.sits_callback()
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)   # under accelerate's wrapper
        objective = objective_for(self)
        why_not = objective.unsupported(self, model, inputs) if objective is not None else \
            f"{type(self).__name__}'s own loss (no objective for this trainer)"
        self._objective = objective if not why_not else None
        checkpointing = None
        if self._objective is not None and self.record_step is not False:
            checkpointing = plan_without_checkpointing(model, self.args, inputs)
        packed = self._packing[0] if self._packing is not None else None
        decision = decide_recording(self.record_step, model=model, args=self.args, optimizer=optimizer,
                                    callback=callback, accelerator=self.accelerator,
                                    train_dataset=self.train_dataset, data_collator=self.data_collator,
                                    inputs=inputs, loss=(self._objective.label if self._objective else "", why_not),
                                    callbacks=self.callback_handler.callbacks, checkpointing=checkpointing,
                                    owner=type(self).__name__, packed=(packed, self._packing_why_not),
                                    own_loss_waits=_own_loss_waits(self))
        self.step_recording = decision
        logger.warning("sits_lora: step recording %s", decision.reason)
        if decision.checkpointing_off:
            _set_checkpointing(model, False, self.args)
            self._checkpointing_off = True
        if self._objective is not None and callback is not None:
            callback.plan_fused_loss(model, recorded=decision.on)
        if not decision.on:
            return
        self._train_step = TrainStep(model, optimizer, max_grad_norm=self.args.max_grad_norm,
                                     nan_policy="off" if callback is None else callback.nan_policy,
                                     loss=self._objective_loss if self._objective else self._model_loss,
                                     record=any(p.is_cuda for p in model.parameters()),
                                     max_graphs=decision.max_graphs)
        # the Trainer's own check of each step's loss (logging_nan_inf_filter) waits for the GPU at every step;
        # the guard already leaves a non-finite step unapplied. Put back when train() returns.
        if self._nan_filter_setting is None:
            self._nan_filter_setting = self.args.logging_nan_inf_filter
        self.args.logging_nan_inf_filter = False

    def _model_loss(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        return self.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)

    def _recorded_training_step(self, model: nn.Module, inputs: dict, num_items_in_batch) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        outcome = self._train_step.run(inputs, num_items_in_batch)
        self._recorded_grad_norm = outcome.grad_norm
        if outcome.metrics is not None:
            self._pending_metrics.append(outcome.metrics)
        callback = self.sits_callback()
        if callback is not None:
            callback.after_recorded_step(self.state, outcome.nonfinite, self._train_step.gradient_names)
        return outcome.loss

    # The Trainer's clipping and norm after a recorded step: the step clipped and updated already (its gradients
    # are gone); the norm it measured before clipping is what the Trainer logs.
    def _clip_grad_norm(self, model):
        if self._recorded_grad_norm is not None:
            return self._recorded_grad_norm
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._recorded_grad_norm is not None:
            grad_norm, self._recorded_grad_norm = self._recorded_grad_norm, None
            return grad_norm
        return super()._get_grad_norm(model, grad_norm)

    def _get_learning_rate(self):
        # The Trainer reads the rate every step; under a recorded step the optimizer holds it as a GPU tensor (the
        # replays read it there), and reading that back would wait for the GPU. The Trainer's schedules are
        # LambdaLR, whose rate is a closed form of the step count.
        scheduler = getattr(self, "lr_scheduler", None)
        if self._train_step is not None and type(scheduler) is torch.optim.lr_scheduler.LambdaLR:
            return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](scheduler.last_epoch)
        return super()._get_learning_rate()


_NATIVE_CLASSES: dict = {}


def native_step(trainer, record_step="auto"):
    """sits_lora's step for a ``transformers.Trainer`` class or instance (module docstring).

    A class: ``TrainerClass`` with :class:`NativeStepMixin` in front (the same class for the same argument), to be
    built with the trainer's own arguments plus ``record_step``. An instance: the trainer itself, changed in place
    to that class and returned (``record_step`` applies then), with a SitsHardwareCallback added where it has none.
    """
    from transformers import Trainer

    if isinstance(trainer, type):
        if not issubclass(trainer, Trainer):
            raise TypeError(f"native_step: {trainer.__name__} is not a transformers.Trainer subclass; pass "
                            "Trainer, trl.SFTTrainer, trl.DPOTrainer or a subclass of one of them")
        if issubclass(trainer, NativeStepMixin):
            return trainer
        if trainer not in _NATIVE_CLASSES:
            _NATIVE_CLASSES[trainer] = type(f"Native{trainer.__name__}", (NativeStepMixin, trainer),
                                            {"__module__": trainer.__module__, "__doc__": trainer.__doc__})
        return _NATIVE_CLASSES[trainer]
    if not isinstance(trainer, Trainer):
        raise TypeError(f"native_step: got {type(trainer).__name__}; pass a transformers.Trainer class or instance")
    _check_record_step(record_step, "native_step")
    if isinstance(trainer, NativeStepMixin):
        trainer.record_step = record_step
        return trainer
    if getattr(trainer.state, "global_step", 0):
        raise ValueError("native_step: this trainer has trained already; apply native_step before train()")
    trainer.__class__ = native_step(type(trainer))
    trainer._native_init(record_step)
    for callback in _with_callbacks(trainer.callback_handler.callbacks, trainer.model):
        if callback not in trainer.callback_handler.callbacks:
            trainer.add_callback(callback)
    if copies_batches_without_blocking(trainer.args):
        trainer.accelerator.dataloader_config.non_blocking = True
        trainer.args.accelerator_config.non_blocking = True
    return trainer


__all__ = ["NativeStepMixin", "copies_batches_without_blocking", "native_step"]
