"""NativeLoraTrainer: a transformers ``Trainer`` with sits_lora's guard rails built in, whose optimizer step is
recorded as CUDA graphs on a GPU when the batches' shapes are fixed (``sits_lora.training.step``)."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn
from transformers import Trainer

from ..utils.cuda_graphs import first_line
from .callback import SitsHardwareCallback
from .graphs import GraphCaptureError
from .recording import RecordingDecision, decide_recording
from .step import DECODER_INPUTS, TrainStep, causal_lm_loss, fused_loss_support

logger = logging.getLogger("sits_lora")
RECORD_STEP_VALUES = ("auto", True, False)


def copies_batches_without_blocking(args) -> bool:
    """Whether NativeLoraTrainer turns on accelerate's non-blocking batch copy for these TrainingArguments: a CUDA
    run whose DataLoader pins its batches."""
    return bool(args.dataloader_pin_memory) and torch.cuda.is_available() and not args.use_cpu


class NativeLoraTrainer(Trainer):
    """``transformers.Trainer`` plus :class:`SitsHardwareCallback` (added with its defaults when none is given).

    Takes every argument of ``Trainer``. Beyond what the callback does under a plain ``Trainer``, it
    guarantees that:

    - the NaN / Inf gradient guard runs right after the last micro-batch's backward, *before* the
      Trainer computes the gradient norm. That computation (``clip_grad_norm_``, also run with
      max_norm=inf when ``max_grad_norm=0``, to log ``grad_norm``) multiplies every gradient by
      max_norm / total_norm, so one NaN or Inf turns every gradient into NaN before any callback
      event; here "raise" names the parameter that went bad and "clamp" bounds only the bad values;
    - with ``detect_nonfinite_activations=True``, the activation flags are read after every
      micro-batch's backward and decided in the guard's reduction, before the gradient norm: the
      error names the first module that went bad in any micro-batch of that optimizer step;
    - ``nonfinite_steps`` and ``clamped_values`` are in every training log entry before any
      logging integration (TensorBoard, W&B, ...) sees it; under a plain Trainer the callback adds
      them to the printed logs and ``state.log_history`` only;
    - a model with dynamic-rank adapters (``SitsLoraConfig(use_dynamic_rank=True)``) trains under
      its rank budget: a :class:`sits_lora.DynamicRankCallback` with its defaults is added when none
      is given (without one, nothing holds the mean active rank at ``target_mean_rank``).

    Batches are copied to the GPU without blocking the host (``accelerator_config.non_blocking`` is turned on where
    ``dataloader_pin_memory`` is, the default): a blocking copy waits for the step before it to finish. To keep
    the blocking copy, set ``dataloader_pin_memory=False``.

    ``record_step`` ("auto", True, False): on one CUDA GPU, with batches of fixed shapes, one optimizer step
    per batch (``gradient_accumulation_steps=1``) and torch's fused AdamW (the default ``optim``), the whole
    optimizer step (forward with the fused cross-entropy, backward, the gradient guard, clipping, the update)
    is recorded as CUDA graphs after two eager steps and replayed (:mod:`sits_lora.training.step`): the host's
    time leaves the step. "auto" records where that holds and says in one line at the first step whether it
    records and, if not, why (``trainer.step_recording``); True raises instead of running eagerly. Under a
    recorded step the guard's host-side bookkeeping (counts, warnings, "raise") reads each step's flags one step
    later: the bad step's update was already left undone on the GPU.
    """

    def __init__(self, *args, callbacks: Optional[list] = None, record_step="auto", **kwargs):
        if record_step not in RECORD_STEP_VALUES or not isinstance(record_step, (str, bool)):
            raise ValueError(f"NativeLoraTrainer(record_step={record_step!r}) is invalid: allowed values are 'auto' "
                             "(record the optimizer step as CUDA graphs where it can be), True (always; raise where "
                             "it cannot) and False (eager steps)")
        self.record_step = record_step
        self.step_recording: Optional[RecordingDecision] = None   # decided at the first training step
        self._train_step = None
        self._recorded_grad_norm = None
        self._nan_filter_setting = None
        callbacks = list(callbacks or [])
        if not any(isinstance(c, SitsHardwareCallback) or c is SitsHardwareCallback for c in callbacks):
            callbacks.append(SitsHardwareCallback())
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, nn.Module):
            # Imported here: dynamic_rank's callback module loads only for models that use it.
            from ..dynamic_rank.budget import dynamic_rank_layers

            if dynamic_rank_layers(model):
                from ..dynamic_rank.callback import DynamicRankCallback

                if not any(isinstance(c, DynamicRankCallback) or c is DynamicRankCallback for c in callbacks):
                    callbacks.append(DynamicRankCallback())
        super().__init__(*args, callbacks=callbacks, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        # Each batch reaches the GPU without the host waiting: a blocking copy (accelerate's default) waits for every
        # kernel queued before it, so the host could not prepare the next step while the GPU runs this one (a recorded
        # step then waits once a step). The DataLoader already pins its batches (dataloader_pin_memory), which is what
        # makes a non-blocking copy safe and asynchronous; with pinning off the copy stays as the user set it.
        if copies_batches_without_blocking(self.args):
            self.args.accelerator_config.non_blocking = True
        super().create_accelerator_and_postprocess()

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._nan_filter_setting is not None:
                self.args.logging_nan_inf_filter, self._nan_filter_setting = self._nan_filter_setting, None

    def sits_callback(self) -> Optional[SitsHardwareCallback]:
        """The SitsHardwareCallback this trainer runs (the Trainer may replace it when restoring callback state)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, SitsHardwareCallback):
                return callback
        return None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)   # under accelerate's wrapper
        if self._train_step is not None and self._train_step.optimizer is not optimizer:
            self.step_recording = self._train_step = None   # another train() made another optimizer: decide again
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

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        callback = self.sits_callback()
        if callback is not None and "loss" in logs:
            callback.resolve_recorded_steps()
            logs.update(callback.log_counts())
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ the recorded optimizer step

    def _decide_recording(self, model: nn.Module, inputs: dict) -> None:
        callback = self.sits_callback()
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)   # under accelerate's wrapper
        supported, why_not_fused = fused_loss_support(model)
        if supported:
            why_not_fused = self._loss_of_its_own(inputs)
            supported = not why_not_fused
        decision = decide_recording(self.record_step, model=model, args=self.args, optimizer=optimizer,
                                    callback=callback, accelerator=self.accelerator,
                                    train_dataset=self.train_dataset, data_collator=self.data_collator,
                                    inputs=inputs, fused_loss=(supported, why_not_fused),
                                    callbacks=self.callback_handler.callbacks)
        self.step_recording = decision
        logger.warning("sits_lora: step recording %s", decision.reason)
        if not decision.on:
            return
        self._train_step = TrainStep(model, optimizer, max_grad_norm=self.args.max_grad_norm,
                                     nan_policy="off" if callback is None else callback.nan_policy,
                                     loss=self._fused_loss if supported else self._model_loss,
                                     record=any(p.is_cuda for p in model.parameters()),
                                     max_graphs=decision.max_graphs)
        if supported and callback is not None:
            callback.plan_fused_loss(model)
        # the Trainer's own check of each step's loss (logging_nan_inf_filter) waits for the GPU at every step;
        # the guard already leaves a non-finite step unapplied. Put back when train() returns.
        if self._nan_filter_setting is None:
            self._nan_filter_setting = self.args.logging_nan_inf_filter
        self.args.logging_nan_inf_filter = False

    def _loss_of_its_own(self, inputs: dict) -> str:
        """Why this trainer's loss is not the causal LM loss the fused one computes ("" when it is)."""
        if self.compute_loss_func is not None:
            return "compute_loss_func is set"
        if getattr(self.args, "label_smoothing_factor", 0):
            return f"label_smoothing_factor={self.args.label_smoothing_factor}"
        if type(self).compute_loss is not Trainer.compute_loss:
            return f"{type(self).__name__} overrides compute_loss"
        extra = sorted(set(inputs) - set(DECODER_INPUTS) - {"labels", "shift_labels"})
        if extra:
            return f"the batches carry {', '.join(extra)}"
        if "labels" not in inputs and "shift_labels" not in inputs:
            return "the batches carry no labels"
        return ""

    def _fused_loss(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        # the autocast accelerate wraps the model's forward in (mixed precision), which the decoder call skips
        with self.accelerator.autocast():
            return causal_lm_loss(model, inputs, num_items_in_batch)

    def _model_loss(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        return self.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)

    def _recorded_training_step(self, model: nn.Module, inputs: dict, num_items_in_batch) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        outcome = self._train_step.run(inputs, num_items_in_batch)
        self._recorded_grad_norm = outcome.grad_norm
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
