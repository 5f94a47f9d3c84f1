"""NativeLoraTrainer: a transformers ``Trainer`` with sits_lora's guard rails built in."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from transformers import Trainer

from .callback import SitsHardwareCallback


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
    """

    def __init__(self, *args, callbacks: Optional[list] = None, **kwargs):
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

    def sits_callback(self) -> Optional[SitsHardwareCallback]:
        """The SitsHardwareCallback this trainer runs (the Trainer may replace it when restoring callback state)."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, SitsHardwareCallback):
                return callback
        return None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
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
            logs.update(callback.log_counts())
        super().log(logs, *args, **kwargs)
