"""SitsHardwareCallback: hardware report and constraints before the first step, NaN / Inf guards at every step."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .constraints import ConstraintResult, apply_policies, check_pcie, resolve_policies
from .guards import (
    NAN_POLICIES,
    ActivationWatch,
    GradientGuard,
    GuardOutcome,
    NonFiniteActivationError,
    NonFiniteGradientError,
    activation_message,
)
from .hardware import HardwareReport, probe_hardware
from ..utils import validation
from .memory import MemoryPlan, plan_memory
from .preflight import RunCheck, check_run, write_report

logger = logging.getLogger("sits_lora")

# per checkpoint: the training state of model modules with sits_checkpoint_state (fp8 scaling)
MODULE_STATE_FILE = "sits_lora_state.pt"

StepHook = Callable[[int, bool], None]
# The step after which the PCIe check is run again with the measured step time (the first steps
# include compilation and allocator warm-up).
_PCIE_RECHECK_STEP = 3


# The arguments' checks (sits_lora.utils.validation), run before anything else in __init__.
_ARGUMENT_CHECKS: dict[str, validation.Check] = {
    "nan_policy": validation.choice(NAN_POLICIES),
    "nan_clamp_value": validation.positive_number(", e.g. nan_clamp_value=1.0"),
    "detect_nonfinite_activations": validation.boolean,
    "max_consecutive_nonfinite": validation.positive_int(", e.g. 10, or None to never stop", allow_none=True),
    "rank_share": validation.fraction(", e.g. rank_share=0.1 for 10 % of a layer's time"),
    "memory_budget_gib": validation.positive_number(", e.g. memory_budget_gib=70, or None", allow_none=True),
    "seq_len": validation.positive_int(" (tokens per sequence), or None to read it from the dataset",
                                       allow_none=True),
}


class SitsHardwareCallback(TrainerCallback, ExportableState):
    """Guard rails for a transformers ``Trainer``: hardware report and constraints, NaN / Inf guards.

    At train begin it measures the device (cached per device, see :func:`probe_hardware`), prints a
    short table, writes ``output_dir/hardware_report.json``, and checks four constraints computed from
    the model and arguments being trained: ``memory`` (:func:`plan_memory` against free device
    memory), ``rank`` (each adapted layer's rank against its roofline ceiling), ``pcie`` (host<->device
    bytes per step against the step time) and ``int4`` (bitsandbytes 4-bit layers aligned and
    block-shaped). At every optimizer step it checks the trainable gradients for NaN / Inf in one
    fused reduction.

    Args:
        policy: "warn" (log violations and train), "strict" (raise :class:`HardwareConstraintError`
            before the first step, listing the plan and what to change), "off" (skip the checks); or a
            dict per constraint, e.g. ``{"memory": "strict", "rank": "warn"}`` (missing ones: "warn").
        nan_policy: what a non-finite gradient does: "skip" drops that optimizer step (parameters and
            optimizer state untouched; step counter, data and learning-rate schedule move on); "clamp"
            acts only on the steps where the fused check found a NaN or Inf (on any rank): in that
            step's gradients it sets NaN to 0 and bounds ±Inf and every value beyond
            ``nan_clamp_value`` to ±``nan_clamp_value``, then the step runs; steps whose gradients are
            all finite are left untouched, however large their values (``max_grad_norm`` is the tool
            for those). ``clamped_values`` counts the values it changed. "raise" stops with
            :class:`NonFiniteGradientError` naming the first bad parameter and the step; "off".
        nan_clamp_value: the bound of "clamp" on its steps.
        detect_nonfinite_activations: watch every module's forward output and name the first that is
            not finite (one small reduction per module call: a debugging aid). Under "raise" it stops
            with :class:`NonFiniteActivationError` at the end of that optimizer step's backward; the
            flag travels in the gradient guard's one all-reduce, so under DDP every rank stops together.
        max_consecutive_nonfinite: under "skip" / "clamp", raise once this many optimizer steps in a
            row had non-finite gradients (the run has diverged); None never raises.
        rank_share: the share of a layer's time its LoRA branch may take in the rank check.
        memory_budget_gib: the memory the plan must fit in; default the device's free memory (plus
            what this process's allocator already holds).
        seq_len: tokens per sequence for the plans; default the longest of the first 64 training
            examples' ``input_ids``.
        report: print the tables and write ``hardware_report.json``.
        hardware_cache_dir: where measurements are cached (default ``$SITS_LORA_CACHE/hardware``).

    Only :class:`NativeLoraTrainer` runs the gradient guard before the Trainer computes the gradient
    norm. A plain ``Trainer`` computes it (``clip_grad_norm_``, with max_norm=inf when
    ``max_grad_norm=0``) before ``on_pre_optimizer_step``, the first callback event after backward,
    and one NaN or Inf there makes every gradient NaN. So with a plain ``Trainer``: "skip" and
    "off" behave exactly as under NativeLoraTrainer; "raise" stops at the right step but names the
    first trainable parameter; "clamp" is refused (nothing would be left to clamp).

    Per-step hooks (for state advanced once per optimizer step, such as FP8 scaling): a callable
    ``hook(step: int, skipped: bool)`` given to :meth:`add_step_hook`, and any module of the model
    with a method ``sits_after_optimizer_step(step, skipped)``, is called after every optimizer step;
    ``step`` counts from 1 and ``skipped`` is True when the guard dropped that step. A module that
    also has ``sits_checkpoint_state()`` / ``sits_load_checkpoint_state(dict)`` has that state written
    into every checkpoint (``sits_lora_state.pt``) and restored when training resumes from one.
    """

    def __init__(
        self,
        policy="warn",
        nan_policy: str = "skip",
        nan_clamp_value: float = 1.0,
        detect_nonfinite_activations: bool = False,
        max_consecutive_nonfinite: Optional[int] = 10,
        rank_share: float = 0.10,
        memory_budget_gib: Optional[float] = None,
        seq_len: Optional[int] = None,
        report: bool = True,
        hardware_cache_dir: Optional[str] = None,
    ):
        self.policies = resolve_policies(policy)
        given = {"nan_policy": nan_policy, "nan_clamp_value": nan_clamp_value, "seq_len": seq_len,
                 "detect_nonfinite_activations": detect_nonfinite_activations, "rank_share": rank_share,
                 "max_consecutive_nonfinite": max_consecutive_nonfinite, "memory_budget_gib": memory_budget_gib}
        validation.check_arguments("SitsHardwareCallback",
                                   **{name: (given[name], check) for name, check in _ARGUMENT_CHECKS.items()})
        self._init_args = {
            "policy": policy, "nan_policy": nan_policy, "nan_clamp_value": float(nan_clamp_value),
            "detect_nonfinite_activations": detect_nonfinite_activations,
            "max_consecutive_nonfinite": max_consecutive_nonfinite, "rank_share": float(rank_share),
            "memory_budget_gib": memory_budget_gib, "seq_len": seq_len, "report": bool(report),
            "hardware_cache_dir": hardware_cache_dir,
        }
        self.nan_policy = nan_policy
        self.nan_clamp_value = float(nan_clamp_value)
        self.detect_nonfinite_activations = detect_nonfinite_activations
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.rank_share = float(rank_share)
        self.memory_budget_gib = memory_budget_gib
        self.seq_len = seq_len
        self.report = bool(report)
        self.hardware_cache_dir = hardware_cache_dir

        self.nonfinite_steps = 0
        self.clamped_values = 0
        self.consecutive_nonfinite = 0
        self.first_nonfinite_module: Optional[str] = None
        self.hardware: Optional[HardwareReport] = None
        self.memory_plan: Optional[MemoryPlan] = None
        self._plan_inputs: Optional[tuple] = None   # (batch, seq_len, plan_memory kwargs) of the plan at train begin
        self.results: list[ConstraintResult] = []
        self._guard = GradientGuard(nan_policy, self.nan_clamp_value)
        self._watch: Optional[ActivationWatch] = None
        self._pending_activation: Optional[str] = None
        self._step_hooks: list[StepHook] = []
        self._module_hooks: list[StepHook] = []
        self._stateful_modules: dict = {}
        self._guarded_step: Optional[int] = None
        self._last_outcome: Optional[GuardOutcome] = None
        self._scaler_mode = False
        self._guard_active = True
        self._driven_by_native = False
        self._step_started: Optional[float] = None
        self._step_times: list[float] = []
        self._pcie_parts: Optional[dict] = None
        self._unread_step: Optional[tuple] = None   # a recorded step whose guard flags are not read yet

    # ------------------------------------------------------------------ public helpers

    def add_step_hook(self, hook: StepHook) -> None:
        """Call ``hook(step, skipped)`` after every optimizer step (see the class docstring).

        Hooks are not saved in checkpoints: with ``restore_callback_states_from_checkpoint=True`` the
        Trainer rebuilds this callback from its arguments, without them. State that belongs to the
        model (FP8 scales) should live in a module with ``sits_after_optimizer_step``, found anew at
        every train begin.
        """
        if not callable(hook):
            raise TypeError(f"add_step_hook expects a callable hook(step, skipped), got {type(hook).__name__}.")
        self._step_hooks.append(hook)

    def log_counts(self) -> dict:
        """The guard's counters as they go into the Trainer logs."""
        return {"nonfinite_steps": self.nonfinite_steps, "clamped_values": self.clamped_values}

    def state(self) -> dict:
        self.resolve_recorded_steps()   # the counts a checkpoint keeps include the last recorded step
        return {"args": dict(self._init_args),
                "attributes": {"nonfinite_steps": self.nonfinite_steps, "clamped_values": self.clamped_values}}

    # ------------------------------------------------------------------ train begin

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        if model is None:
            return
        self._restore_counts(state)
        self._setup_guard(args, model, optimizer)
        self._stateful_modules = {name: m for name, m in model.named_modules()
                                  if callable(getattr(m, "sits_checkpoint_state", None))}
        if state.global_step > 0 and self._stateful_modules:
            self._restore_module_states(args, state)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.hardware = probe_hardware(device, cache_dir=self.hardware_cache_dir)
        check = RunCheck()
        if any(p != "off" for p in self.policies.values()):
            check = check_run(args, model, train_dataloader, self.hardware, self.policies, seq_len=self.seq_len,
                              rank_share=self.rank_share, memory_budget_gib=self.memory_budget_gib)
        self.results, self.memory_plan = check.results, check.memory_plan
        self._plan_inputs, self._pcie_parts = check.plan_inputs, check.pcie_parts
        if self.report:
            write_report(args, state, self.hardware, check, self.policies, self.nan_policy)
        apply_policies(self.results, self.policies, self.memory_plan)

    def _restore_counts(self, state) -> None:
        saved = (state.stateful_callbacks or {}).get(type(self).__name__) if state.global_step > 0 else None
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if isinstance(saved, dict):
            attributes = saved.get("attributes", {})
            self.nonfinite_steps = int(attributes.get("nonfinite_steps", self.nonfinite_steps))
            self.clamped_values = int(attributes.get("clamped_values", self.clamped_values))

    def _setup_guard(self, args, model, optimizer) -> None:
        self._scaler_mode = getattr(optimizer, "scaler", None) is not None
        if self._scaler_mode and self.nan_policy in ("clamp", "raise"):
            raise ValueError(
                f"SitsHardwareCallback(nan_policy={self.nan_policy!r}) cannot run under fp16 mixed precision: its "
                f"GradScaler overflows on purpose and skips those steps itself. Use nan_policy='skip' (the scaler's "
                f"skipped steps are counted in nonfinite_steps), or bf16=True instead of fp16=True."
            )
        self._guard_active = not getattr(args, "deepspeed", None) and not self._scaler_mode
        if getattr(args, "deepspeed", None) and self.nan_policy != "off":
            logger.warning("sits_lora: the NaN/Inf gradient guard is off under DeepSpeed, whose engine owns the "
                           "gradients; DeepSpeed's own overflow checks apply.")
        self._guard.bind(model)
        self._module_hooks = [m.sits_after_optimizer_step for m in model.modules()
                              if callable(getattr(m, "sits_after_optimizer_step", None))]
        self._release_watch()  # a run that stopped with an error never reached on_train_end
        self._pending_activation = None
        if self.detect_nonfinite_activations:
            self._watch = ActivationWatch()
            self._watch.attach(model)

    # ------------------------------------------------------------------ per step

    def after_backward(self, model: nn.Module, state, args, sync: bool) -> None:
        """Called by NativeLoraTrainer after each micro-batch's backward, before gradient clipping."""
        self._driven_by_native = True
        self._check_activations(state)
        if sync:
            self._guard_step(state)

    def plan_fused_loss(self, model: nn.Module, recorded: bool = True) -> None:
        """Called by the native step when it computes the loss with the fused linear cross-entropy: ``memory_plan``
        becomes that step's (the fused loss and, when ``recorded``, what the recording holds). The check at train
        begin planned the model's own loss, the larger, and the model's gradient checkpointing as it was then."""
        if self._plan_inputs is None or self.memory_plan is None:
            return
        batch, seq_len, plan_kwargs = self._plan_inputs
        try:
            self.memory_plan = plan_memory(model, batch, seq_len, **plan_kwargs, fused_loss=True, recorded=recorded)
        except Exception as error:  # a plan must never stop training by itself
            logger.warning("sits_lora: plan_memory failed for the fused loss (%s: %s); the plan keeps the model's "
                           "loss", type(error).__name__, error)

    def after_recorded_step(self, state, nonfinite: torch.Tensor, names: list) -> None:
        """Called by NativeLoraTrainer after a recorded optimizer step (sits_lora.training.step), which guarded its
        gradients on the GPU (a non-finite one left the update undone there): its per-gradient flags are copied
        back without waiting, and the step before this one is accounted for now, when the GPU has long passed it
        (reading this step's flags at once would make the host wait for the GPU at every step)."""
        self._driven_by_native = True
        self._guarded_step = state.global_step
        self.resolve_recorded_steps()
        if self.nan_policy == "off":
            return
        done = None
        if nonfinite.is_cuda:
            flags = torch.empty(nonfinite.shape, dtype=nonfinite.dtype, pin_memory=True)
            flags.copy_(nonfinite, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            flags = nonfinite.clone()
        self._unread_step = (state.global_step + 1, flags, done, names)

    def resolve_recorded_steps(self) -> None:
        """Account for the recorded step whose flags are not read yet (waits for it to finish)."""
        unread, self._unread_step = self._unread_step, None
        if unread is None:
            return
        step, flags, done, names = unread
        if done is not None:
            done.synchronize()
        bad = [name for name, flag in zip(names, flags.tolist()) if flag]
        outcome = GuardOutcome(step=step, nonfinite=bool(bad), skipped=bool(bad), bad_parameters=bad)
        self._last_outcome = outcome
        if bad and self.nan_policy == "raise":
            self.nonfinite_steps += 1
            raise NonFiniteGradientError(
                f"optimizer step {step}: the gradient of {bad[0]} is not finite"
                f"{f', and {len(bad) - 1} other parameter(s) too' if len(bad) > 1 else ''}. Its update was left "
                f"undone on the GPU (nan_policy='raise' under a recorded step: the host reads each step's flags one "
                f"step later, so step {step + 1} ran). Fix: lower learning_rate, set max_grad_norm, check this step's "
                f"batch, or use nan_policy='skip' to drop such steps and keep training.")
        self._count(outcome, "step skipped on the GPU")

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()

    def on_substep_end(self, args, state, control, **kwargs):
        if not self._driven_by_native:
            self._check_activations(state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._guarded_step == state.global_step:
            return  # NativeLoraTrainer already ran the guard, before clipping
        if self.nan_policy == "clamp" and self._guard_active:
            raise ValueError(
                "SitsHardwareCallback(nan_policy='clamp') needs sits_lora.NativeLoraTrainer: a plain transformers.Trainer "
                "computes the gradient norm (clip_grad_norm_, with max_norm=inf even when max_grad_norm=0) before any "
                "callback runs, and one NaN or Inf there turns every gradient into NaN, leaving nothing to clamp. Use "
                "NativeLoraTrainer (same arguments), or nan_policy='skip'."
            )
        self._check_activations(state)
        self._guard_step(state)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        step = state.global_step + 1
        skipped = bool(self._last_outcome is not None and self._last_outcome.step == step and self._last_outcome.skipped)
        if self._scaler_mode and getattr(optimizer, "step_was_skipped", False):
            skipped = True
            self.nonfinite_steps += 1
        for hook in self._module_hooks + self._step_hooks:
            hook(step, skipped)

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_started is not None:
            self._step_times.append(time.perf_counter() - self._step_started)
        if (state.global_step == _PCIE_RECHECK_STEP and self._pcie_parts is not None and self.hardware is not None
                and self.policies.get("pcie") != "off" and self._step_times):
            measured = sorted(self._step_times[1:] or self._step_times)[0]
            result = check_pcie(self._pcie_parts, self.hardware, measured, "measured")
            if result.status == "violated":
                logger.warning("sits_lora pcie constraint violated with the measured step time: %s", result.summary)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or "nonfinite_steps" in logs:
            return
        counts = self.log_counts()
        logs.update(counts)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(counts)

    def on_train_end(self, args, state, control, **kwargs):
        self._release_watch()
        self.resolve_recorded_steps()

    def on_save(self, args, state, control, **kwargs):
        modules = self._stateful_modules
        if not modules or not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            torch.save({name: m.sits_checkpoint_state() for name, m in modules.items()},
                       os.path.join(folder, MODULE_STATE_FILE))

    def _restore_module_states(self, args, state) -> None:
        # the Trainer does not tell callbacks which checkpoint it resumed from; it is the one of this step
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", MODULE_STATE_FILE)
        if not os.path.exists(path):
            logger.warning("sits_lora: resuming at step %d without %s (saved without SitsHardwareCallback, or outside "
                           "output_dir): the state of %s starts afresh (fp8 scaling: one step of current scaling, then "
                           "a new amax history).", state.global_step, path, ", ".join(self._stateful_modules))
            return
        saved = torch.load(path, map_location="cpu", weights_only=True)
        for name, module in self._stateful_modules.items():
            if name in saved:
                module.sits_load_checkpoint_state(saved[name])
            else:
                logger.warning("sits_lora: %s has no saved state for module %r; it starts afresh.", path, name)

    # ------------------------------------------------------------------ guard internals

    def _release_watch(self) -> None:
        if self._watch is not None:
            self._watch.detach()
            self._watch = None

    def _check_activations(self, state) -> None:
        """Read this micro-batch's activation flags (local); the decision waits for the step's guard reduction."""
        if self._watch is None:
            return
        name = self._watch.first_nonfinite()
        if name is None:
            return
        self.first_nonfinite_module = name
        if self._pending_activation is None:
            self._pending_activation = name
        if self.nan_policy != "raise":
            logger.warning("sits_lora: %s", activation_message(state.global_step + 1, name))

    def _guard_step(self, state) -> None:
        step = state.global_step + 1
        self._guarded_step = state.global_step
        activation, self._pending_activation = self._pending_activation, None
        if not self._guard_active:
            if self._watch is not None and self.nan_policy == "raise":
                # DeepSpeed owns the gradients; the ranks still decide on the activation flag together.
                self._run_guard(step, activation, names_and_params=[])
            return
        outcome = self._run_guard(step, activation)
        self._last_outcome = outcome
        if outcome.clamped_values:
            self.clamped_values += outcome.clamped_values
        self._count(outcome, "step skipped" if outcome.skipped else f"{outcome.clamped_values} values clamped")

    def _count(self, outcome: GuardOutcome, action: str) -> None:
        """Count a guarded step (eager or recorded): a non-finite one is warned about, and the run stops after
        ``max_consecutive_nonfinite`` of them in a row."""
        if not outcome.nonfinite:
            self.consecutive_nonfinite = 0
            return
        step = outcome.step
        self.nonfinite_steps += 1
        self.consecutive_nonfinite += 1
        first = outcome.bad_parameters[0] if outcome.bad_parameters else "a parameter on another rank"
        logger.warning("sits_lora: optimizer step %d: non-finite gradient in %s (%d parameter(s)); %s "
                       "(nan_policy=%r, %d such steps so far).", step, first, len(outcome.bad_parameters), action,
                       self.nan_policy, self.nonfinite_steps)
        if self.max_consecutive_nonfinite is not None and self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
            self._release_watch()
            raise NonFiniteGradientError(
                f"optimizer step {step}: {self.consecutive_nonfinite} optimizer steps in a row had non-finite "
                f"gradients (last: {first}); the run has diverged. Fix: lower learning_rate, set max_grad_norm, check "
                f"the data, or resume from an earlier checkpoint. SitsHardwareCallback(max_consecutive_nonfinite=None) "
                f"never stops."
            )

    def _run_guard(self, step: int, activation: Optional[str], names_and_params=None) -> GuardOutcome:
        """The guard's one reduction; on an error the watch's hooks come off the model before it propagates."""
        try:
            return self._guard.check(step, names_and_params, activation=activation)
        except NonFiniteActivationError:
            self._release_watch()
            raise
        except NonFiniteGradientError as error:
            self._release_watch()
            if self._driven_by_native:
                raise
            raise NonFiniteGradientError(
                f"{error} With a plain transformers.Trainer the gradient norm is computed before any callback, which "
                f"can spread one NaN or Inf to every gradient (it does with some transformers / accelerate versions): "
                f"the parameter named is then the first trainable one, not necessarily the one that went bad. "
                f"sits_lora.NativeLoraTrainer checks before that and names it."
            ) from None
