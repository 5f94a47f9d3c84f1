"""Training guard rails: hardware report and constraints, memory plan, NaN / Inf guards.

``SitsHardwareCallback`` works with any transformers ``Trainer``; ``native_step(TrainerClass)`` gives any
``Trainer`` subclass (TRL's ``SFTTrainer`` and ``DPOTrainer`` among them) sits_lora's step: the fused loss with the
trainer's metrics on the GPU, the recorded optimizer step, the guard before gradient clipping;
``NativeLoraTrainer`` is ``native_step(Trainer)``. ``plan_memory``
predicts the peak device memory of a LoRA training step. ``graph_train_step`` records a whole training step as
a CUDA graph and replays it (the host's time to issue a step's kernels leaves the step); ``default_train_step`` is
the recorded optimizer step NativeLoraTrainer runs by default (fused cross-entropy, guard, clipping, update).
"""

from __future__ import annotations

from .callback import SitsHardwareCallback
from .constraints import HardwareConstraintError, choose_offloaded_layers
from .graphs import GraphCaptureError, GraphedTrainStep, graph_train_step
from .guards import NonFiniteActivationError, NonFiniteGradientError
from .hardware import HardwareReport, probe_hardware
from .memory import MemoryPlan, UnsupportedModelError, plan_memory
from .memory_meter import PeakMemoryMeter
from .step import StepOutcome, TrainStep, default_train_step

__all__ = [
    "GraphCaptureError",
    "GraphedTrainStep",
    "HardwareConstraintError",
    "HardwareReport",
    "MemoryPlan",
    "NativeLoraTrainer",
    "NativeStepMixin",
    "NonFiniteActivationError",
    "NonFiniteGradientError",
    "PeakMemoryMeter",
    "SitsHardwareCallback",
    "StepOutcome",
    "TrainStep",
    "UnsupportedModelError",
    "choose_offloaded_layers",
    "default_train_step",
    "graph_train_step",
    "native_step",
    "plan_memory",
    "probe_hardware",
]


def __getattr__(name: str):
    # transformers.Trainer costs ~0.4 s to import; only users of NativeLoraTrainer pay it.
    if name == "NativeLoraTrainer":
        from .trainer import NativeLoraTrainer

        return NativeLoraTrainer
    if name in ("NativeStepMixin", "native_step"):
        from . import native

        return getattr(native, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
