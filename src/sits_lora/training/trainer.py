"""NativeLoraTrainer: ``transformers.Trainer`` with sits_lora's step (:mod:`sits_lora.training.native`): the
guard rails built in, the fused loss, and the optimizer step recorded as CUDA graphs on a GPU when the batches'
shapes are fixed."""

from __future__ import annotations

from transformers import Trainer

from .native import NativeStepMixin, copies_batches_without_blocking


class NativeLoraTrainer(NativeStepMixin, Trainer):
    """``transformers.Trainer`` plus :class:`SitsHardwareCallback` (added with its defaults when none is given), and
    the native step: ``native_step(Trainer)``, under a name of its own. Takes every argument of ``Trainer`` plus
    ``record_step`` ("auto", True, False).

    Beyond what the callback does under a plain ``Trainer``, it guarantees that:

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


__all__ = ["NativeLoraTrainer", "copies_batches_without_blocking"]
