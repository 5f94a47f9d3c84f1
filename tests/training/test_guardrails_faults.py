"""Fault injection into real (tiny) training runs: NaN / Inf gradients and activations, over-budget plans,
interrupted runs. One table of cases (FAULT_CASES) drives the tests and the fault matrix:

    python tests/training/test_guardrails_faults.py --out bench/results/fault_matrix.json

runs every case and writes what happened to each (cases x outcome) as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import randomize_lora_weights, tiny_llama  # noqa: E402

import sits_lora  # noqa: E402,F401
from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.training import (  # noqa: E402
    HardwareConstraintError,
    NativeLoraTrainer,
    NonFiniteGradientError,
    SitsHardwareCallback,
)

# Not the first trainable parameter: naming the first one would pass by chance.
TARGET = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.default.weight"
ACT_MODULE = "base_model.model.model.layers.1.mlp.down_proj"
STEPS = 6
BATCH = 4
SEQ = 16


# ----------------------------------------------------------------------------- harness


def make_model(seed: int = 0, r: int = 4, kind: str = "sits"):
    from peft import LoraConfig, get_peft_model

    config_cls = SitsLoraConfig if kind == "sits" else LoraConfig
    model = get_peft_model(tiny_llama(seed=seed), config_cls(
        r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # B starts at zero; random B makes every adapter gradient non-trivial
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def make_dataset(n: int = 64, seed: int = 0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (n, SEQ), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def make_args(out, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=5e-3,
                  lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_strategy="no", report_to="none",
                  use_cpu=True, disable_tqdm=True, seed=0, train_sampling_strategy="sequential",
                  dataloader_num_workers=0, max_grad_norm=1.0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


class GradFault:
    """Writes ``value`` into the gradient of one parameter at chosen (optimizer step, micro-batch)s.

    A tensor hook, so the fault enters during backward like a real one (before DDP, clipping and the guard).
    """

    def __init__(self, model, name: str, value: float, steps, accumulation: int = 1, micro: int = 0, count: int = 1):
        self.value, self.steps, self.accumulation, self.micro, self.count = value, set(steps), accumulation, micro, count
        self.calls = 0
        dict(model.named_parameters())[name].register_hook(self)

    def __call__(self, grad):
        step, micro = self.calls // self.accumulation + 1, self.calls % self.accumulation
        self.calls += 1
        if step in self.steps and micro == self.micro:
            grad = grad.clone()
            grad.view(-1)[: self.count] = self.value
        return grad


class ActivationFault:
    """Writes NaN into one module's forward output at chosen optimizer steps."""

    def __init__(self, model, name: str, steps):
        self.steps, self.calls = set(steps), 0
        dict(model.named_modules())[name].register_forward_hook(self)

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls in self.steps:
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output


class UndoUpdates:
    """The oracle for "skip": a callback that lets the optimizer step run, then restores the parameters and
    optimizer state from a snapshot taken just before it, at the chosen steps. A run with it never saw those
    updates, by a mechanism independent of the guard's."""

    def __init__(self, steps):
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
                if state.global_step + 1 in outer.steps:
                    outer.params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
                    outer.opt_state = copy.deepcopy(optimizer.state_dict())

            def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
                if state.global_step + 1 in outer.steps:
                    with torch.no_grad():
                        for n, p in model.named_parameters():
                            if n in outer.params:
                                p.copy_(outer.params[n])
                    optimizer.load_state_dict(outer.opt_state)

        self.steps = set(steps)
        self.callback = _Callback()


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def optimizer_tensors(trainer) -> list[torch.Tensor]:
    state = trainer.optimizer.state_dict()["state"]
    return [v for k in sorted(state) for v in state[k].values() if isinstance(v, torch.Tensor)]


def train(out, *, trainer_cls="native", callback_kwargs=None, args=None, faults=(), extra_callbacks=(),
          model=None, dataset=None, resume=None):
    from transformers import Trainer, default_data_collator

    model = model if model is not None else make_model()
    for fault in faults:
        fault(model)
    callback = None
    callbacks = []
    if callback_kwargs is not None:
        callback = SitsHardwareCallback(report=False, **callback_kwargs)
        callbacks.append(callback)
    callbacks += list(extra_callbacks)  # after the guard: a spy sees what the optimizer will see
    cls = NativeLoraTrainer if trainer_cls == "native" else Trainer
    trainer = cls(model=model, args=args or make_args(out), train_dataset=dataset or make_dataset(),
                  data_collator=default_data_collator, callbacks=callbacks)
    error = None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except Exception as e:  # the matrix records the error; the tests assert on it
        error = e
    if trainer_cls == "native" and callback is None:
        callback = trainer.sits_callback()
    return trainer, callback, error


def losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


# ----------------------------------------------------------------------------- the cases


@dataclass
class Case:
    name: str
    fault: str                      # nan | inf | -inf | activation | every-step | none
    nan_policy: str
    trainer: str = "native"         # native | plain
    accumulation: int = 1
    micro: int = 0                  # micro-batch of the fault under accumulation
    max_grad_norm: float = 1.0
    steps: tuple = (2, 4)
    expect: str = "finished"        # finished | raises:<ErrorName>
    callback: dict = field(default_factory=dict)
    bf16: bool = False              # TrainingArguments(bf16=True): the forward under bf16 autocast
    model: str = "sits"             # sits | peft (PEFT's own LoRA layers)


FAULT_CASES = [
    Case("skip-nan", "nan", "skip"),
    Case("skip-inf", "inf", "skip"),
    Case("skip-nan-plain-trainer", "nan", "skip", trainer="plain"),
    Case("skip-neg-inf-accumulation", "-inf", "skip", accumulation=2, micro=0),
    Case("skip-nan-accumulation-last-micro", "nan", "skip", trainer="plain", accumulation=2, micro=1),
    # bf16 autocast on the CPU: SitsLoraLinear casts its input and weight as autocast would (layer.autocast_inputs)
    Case("skip-inf-bf16-autocast", "inf", "skip", bf16=True),
    Case("clamp-nan", "nan", "clamp"),
    Case("clamp-inf", "inf", "clamp"),
    Case("clamp-inf-no-clipping", "inf", "clamp", max_grad_norm=0.0),
    # A plain Trainer computes the gradient norm before any callback (even with max_grad_norm=0), which can make one
    # NaN or Inf NaN everywhere: "clamp" is refused, and "raise" may name the first parameter, not the one that went bad.
    Case("clamp-plain-trainer-refused", "nan", "clamp", trainer="plain", max_grad_norm=0.0,
         expect="raises:ValueError"),
    Case("raise-nan", "nan", "raise", steps=(3,), expect="raises:NonFiniteGradientError"),
    Case("raise-inf-no-clipping", "inf", "raise", steps=(3,), max_grad_norm=0.0, expect="raises:NonFiniteGradientError"),
    Case("raise-inf-plain-trainer", "inf", "raise", trainer="plain", steps=(3,), max_grad_norm=0.0,
         expect="raises:NonFiniteGradientError"),
    Case("raise-activation", "activation", "raise", steps=(3,), expect="raises:NonFiniteActivationError",
         callback={"detect_nonfinite_activations": True}),
    Case("skip-activation-named", "activation", "skip", trainer="plain", steps=(3,),
         callback={"detect_nonfinite_activations": True}),
    Case("diverged-every-step", "every-step", "skip", expect="raises:NonFiniteGradientError",
         callback={"max_consecutive_nonfinite": 3}),
    Case("off-nan-control", "nan", "off"),
]
# A skip case also trains the reference run: a few seconds each.
CASE_PARAMS = [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.nan_policy == "skip" else [])
               for c in FAULT_CASES]


def _faults(case: Case):
    if case.fault == "activation":
        return [lambda m: ActivationFault(m, ACT_MODULE, case.steps)]
    if case.fault == "none":
        return []
    value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "every-step": float("nan")}[case.fault]
    steps = range(1, STEPS + 1) if case.fault == "every-step" else case.steps
    return [lambda m: GradFault(m, TARGET, value, steps, case.accumulation, case.micro, count=3)]


def _args(out, case: Case):
    return make_args(out, gradient_accumulation_steps=case.accumulation, max_grad_norm=case.max_grad_norm,
                     bf16=case.bf16)


_REFERENCES: dict = {}


def reference_run(tmp, case: Case):
    """The same run with the same data and no fault, whose updates at case.steps are undone (see UndoUpdates)."""
    key = (case.trainer, case.accumulation, case.max_grad_norm, case.steps, case.bf16, case.model)
    if key not in _REFERENCES:
        undo = UndoUpdates(case.steps)
        trainer, _, error = train(os.path.join(tmp, "reference"), trainer_cls=case.trainer, callback_kwargs=None,
                                  args=_args(os.path.join(tmp, "reference"), case), extra_callbacks=[undo.callback],
                                  model=make_model(kind=case.model))
        assert error is None, error
        _REFERENCES[key] = (trainable_state(trainer.model), optimizer_tensors(trainer))
    return _REFERENCES[key]


def run_case(case: Case, tmp) -> dict:
    """Run one case; return its row of the fault matrix."""
    out = os.path.join(tmp, case.name)
    kwargs = {"nan_policy": case.nan_policy, "policy": "off", **case.callback}
    t0 = time.perf_counter()
    trainer, callback, error = train(out, trainer_cls=case.trainer, callback_kwargs=kwargs, args=_args(out, case),
                                     faults=_faults(case), model=make_model(kind=case.model))
    params = trainable_state(trainer.model)
    row = {
        "case": case.name, "fault": case.fault, "fault_steps": list(case.steps), "nan_policy": case.nan_policy,
        "trainer": "NativeLoraTrainer" if case.trainer == "native" else "transformers.Trainer + callback",
        "gradient_accumulation_steps": case.accumulation, "max_grad_norm": case.max_grad_norm,
        "bf16_autocast": case.bf16, "lora_layers": "SitsLoraLinear" if case.model == "sits" else "peft lora.Linear",
        "steps_completed": trainer.state.global_step,
        "error": None if error is None else f"{type(error).__name__}: {str(error).splitlines()[0]}",
        "nonfinite_steps": callback.nonfinite_steps if callback else None,
        "clamped_values": callback.clamped_values if callback else None,
        "first_nonfinite_module": callback.first_nonfinite_module if callback else None,
        "named_parameter": (str(error).split("the gradient of ", 1)[1].split(" ", 1)[0]
                            if isinstance(error, NonFiniteGradientError) and "the gradient of " in str(error) else None),
        "parameters_finite": all(bool(torch.isfinite(p).all()) for p in params.values()),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if case.nan_policy == "skip" and error is None and case.fault != "activation":
        ref_params, ref_opt = reference_run(tmp, case)
        row["equals_run_without_those_updates"] = (
            all(torch.equal(params[n], ref_params[n]) for n in params)
            and all(torch.equal(a, b) for a, b in zip(optimizer_tensors(trainer), ref_opt)))
    expected = case.expect
    if expected == "finished":
        row["outcome"] = "finished" if error is None and trainer.state.global_step == STEPS else "FAILED"
    else:
        wanted = expected.split(":", 1)[1]
        row["outcome"] = f"raised {wanted}" if type(error).__name__ == wanted else "FAILED"
    if case.nan_policy == "off":  # the control: what the fault does without a guard
        row["control"] = True
        row["outcome"] = "finished with NaN parameters (control, no guard)" if not row["parameters_finite"] else "FAILED"
        row["survived"] = False
    else:
        row["survived"] = row["outcome"] != "FAILED" and row["parameters_finite"]
        # Nothing lost: a skipped step is exactly a run without that update; a raise stops before applying it.
        row["nothing_lost"] = row.get("equals_run_without_those_updates", True) and (
            error is None or trainer.state.global_step < STEPS)
    row["_error"] = error
    row["_trainer"] = trainer
    return row


# ----------------------------------------------------------------------------- tests


@pytest.fixture(autouse=True)
def _quiet_sits_logs(caplog):
    caplog.set_level(logging.WARNING, logger="sits_lora")


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_fault_case(case, tmp_path, caplog):
    row = run_case(case, str(tmp_path))
    error, trainer = row["_error"], row["_trainer"]
    assert row["outcome"] != "FAILED", row
    assert row.get("nothing_lost", True), row
    n_faulty = 1 if case.fault == "activation" else len(case.steps)
    if case.nan_policy == "skip" and case.fault != "every-step":
        assert row["steps_completed"] == STEPS and row["nonfinite_steps"] == n_faulty
        assert row["parameters_finite"]
        if case.fault != "activation":
            assert row["equals_run_without_those_updates"], "skip must leave parameters and optimizer state untouched"
        logged = [e["nonfinite_steps"] for e in trainer.state.log_history if "loss" in e]
        assert logged[-1] == n_faulty and logged[0] == 0
    if case.nan_policy == "clamp" and error is None:
        assert row["parameters_finite"] and row["nonfinite_steps"] == len(case.steps)
        # 3 poisoned values per fault, plus any finite value above 1.0 in the gradients of those steps
        assert row["clamped_values"] >= 3 * len(case.steps)
    if case.name == "clamp-plain-trainer-refused":
        assert "needs sits_lora.NativeLoraTrainer" in str(error) and trainer.state.global_step == 0
    if case.nan_policy == "raise" and case.fault != "activation":
        assert f"optimizer step {case.steps[0]}" in str(error) and trainer.state.global_step == case.steps[0] - 1
        if case.trainer == "plain":
            # the Trainer's gradient norm spreads the fault to every gradient first with some transformers /
            # accelerate versions (the first trainable parameter is named), not with others (the one that went bad)
            first = next(n for n, p in trainer.model.named_parameters() if p.requires_grad)
            assert row["named_parameter"] in (first, TARGET)
            assert "not necessarily the one that went bad" in str(error)
        else:
            assert row["named_parameter"] == TARGET
    if case.fault == "activation":
        assert row["first_nonfinite_module"] == ACT_MODULE
        if case.nan_policy == "raise":
            assert ACT_MODULE in str(error) and f"optimizer step {case.steps[0]}" in str(error)
        else:
            assert ACT_MODULE in caplog.text
    if case.fault == "every-step":
        assert "3 optimizer steps in a row" in str(error) and trainer.state.global_step == 2
    if case.nan_policy == "off":
        assert not row["parameters_finite"], "control: without the guard the injected NaN reaches the parameters"


def test_clamp_acts_only_on_steps_with_a_nonfinite_gradient(tmp_path):
    """Huge but finite gradients pass untouched (max_grad_norm is the tool for them); on a step with a NaN the
    same huge values are bounded to nan_clamp_value too, and the NaN becomes 0 (seen before Trainer's clipping)."""
    from transformers import TrainerCallback

    seen: dict[int, float] = {}
    other = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"

    class Spy(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            seen[state.global_step + 1] = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)

    faults = [lambda m: GradFault(m, TARGET, 1e6, (2, 4), count=5),  # finite but huge at steps 2 and 4
              lambda m: GradFault(m, other, float("nan"), (4,), count=2)]  # and a NaN elsewhere at step 4
    trainer, callback, error = train(tmp_path, args=make_args(tmp_path, max_grad_norm=0.0),
                                     callback_kwargs={"nan_policy": "clamp", "nan_clamp_value": 0.01, "policy": "off"},
                                     faults=faults, extra_callbacks=[Spy()])
    assert error is None and trainer.state.global_step == STEPS
    assert seen[2] == 1e6  # a finite step is left exactly as it is
    assert seen[4] <= 0.01 and all(v == v for v in seen.values())
    assert callback.nonfinite_steps == 1
    assert callback.clamped_values >= 5 + 2  # the 5 huge values and the 2 NaNs of step 4
    assert [e["clamped_values"] for e in trainer.state.log_history if "loss" in e][2] == 0  # nothing before step 4


def scenario_strict_memory(tmp) -> dict:
    """A memory plan over budget under policy 'strict': raises before any step, nothing applied."""
    model = make_model()
    before = trainable_state(model)
    trainer, _, error = train(tmp, model=model, callback_kwargs={"policy": {"memory": "strict"},
                                                                "memory_budget_gib": 1e-6})
    message = str(error)
    return {
        "case": "memory-plan-over-budget-strict", "fault": "memory_budget_gib=1e-6", "policy": "strict",
        "steps_completed": trainer.state.global_step,
        "error": None if error is None else f"{type(error).__name__}: {message.splitlines()[0]}",
        "parameters_unchanged": all(torch.equal(before[n], p) for n, p in trainable_state(trainer.model).items()),
        "message_has_plan": "memory plan: batch 4 x seq 16" in message and "total at peak" in message,
        "message_has_suggestions": all(k in message for k in ("gradient checkpointing", "per_device_train_batch_size=",
                                                              "r=2")),
        "outcome": "raised HardwareConstraintError before step 1" if isinstance(error, HardwareConstraintError)
        and trainer.state.global_step == 0 else "FAILED",
        "_message": message,
    }


def test_strict_memory_plan_over_budget_raises_before_any_step(tmp_path):
    row = scenario_strict_memory(tmp_path)
    assert row["outcome"] != "FAILED" and row["parameters_unchanged"], row
    assert row["message_has_plan"] and row["message_has_suggestions"], row["_message"]
    assert "[memory] plan" in row["_message"] and "policy={'memory': 'warn'}" in row["_message"]


def test_warn_policy_logs_and_trains(tmp_path, caplog):
    trainer, callback, error = train(tmp_path, callback_kwargs={"policy": "warn", "memory_budget_gib": 1e-6})
    assert error is None and trainer.state.global_step == STEPS
    assert "memory constraint violated" in caplog.text
    assert [r.status for r in callback.results if r.name == "memory"] == ["violated"]


def test_report_printed_and_written(tmp_path, capsys):
    trainer, callback, error = train(tmp_path, trainer_cls="native", callback_kwargs=None)
    assert error is None
    printed = capsys.readouterr().out
    assert "[sits_lora] hardware" in printed and "[sits_lora] constraints" in printed and "total at peak" in printed
    report = json.loads((tmp_path / "hardware_report.json").read_text())
    assert report["hardware"]["device"] == "cpu" and report["memory_plan"]["seq_len"] == SEQ
    assert {c["name"]: c["status"] for c in report["constraints"]} == {
        "memory": "ok", "rank": "skipped", "pcie": "skipped", "int4": "skipped"}
    assert report["nan_policy"] == "skip"  # NativeLoraTrainer's default callback
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["cpu"] == report["hardware"]["name"]


def scenario_resume(tmp) -> dict:
    """Interrupted at step 4 and resumed from its checkpoint, against the uninterrupted run."""
    from pathlib import Path

    from transformers import TrainerCallback

    full_dir, part_dir = Path(tmp) / "full", Path(tmp) / "part"
    common = dict(max_steps=8, save_strategy="steps", save_steps=4, train_sampling_strategy="random")
    nan_at_2 = lambda m: GradFault(m, TARGET, float("nan"), (2,))  # noqa: E731
    full, _, error = train(full_dir, args=make_args(full_dir, **common), faults=[nan_at_2], model=_dropout_model())
    assert error is None, error

    class Interrupt(Exception):
        pass

    class StopAfter4(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.global_step == 4:
                raise Interrupt  # like a killed job: the checkpoint of step 4 is on disk, nothing after it

    _, _, error = train(part_dir, args=make_args(part_dir, **common), faults=[nan_at_2], model=_dropout_model(),
                        extra_callbacks=[StopAfter4()])
    assert isinstance(error, Interrupt), error
    resumed, callback, error = train(part_dir, args=make_args(part_dir, **common), model=_dropout_model(perturb=True),
                                     resume=str(part_dir / "checkpoint-4"))
    full_losses, resumed_losses = losses(full), losses(resumed)
    final_full, final_resumed = trainable_state(full.model), trainable_state(resumed.model)
    row = {
        "case": "interrupted-at-step-4-and-resumed", "fault": "process stopped after saving checkpoint-4",
        "policy": "resume_from_checkpoint", "steps_completed": resumed.state.global_step,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "losses_full_5_to_8": [full_losses[s] for s in range(5, 9)],
        "losses_resumed_5_to_8": [resumed_losses.get(s) for s in range(5, 9)],
        "losses_equal": all(resumed_losses.get(s) == full_losses[s] for s in range(5, 9)),
        "parameters_equal": all(torch.equal(final_full[n], final_resumed[n]) for n in final_full),
        "optimizer_state_equal": all(torch.equal(a, b) for a, b in zip(optimizer_tensors(full),
                                                                       optimizer_tensors(resumed))),
        "nonfinite_steps_carried_over": callback.nonfinite_steps,
    }
    exact = row["losses_equal"] and row["parameters_equal"] and row["optimizer_state_equal"]
    row["outcome"] = "loss curve continued exactly" if error is None and exact else "FAILED"
    return row


@pytest.mark.slow
def test_resume_continues_loss_curve_exactly(tmp_path):
    """Steps 5-8 after resuming have the uninterrupted run's losses, final parameters and optimizer state (same
    data order, same RNG: the adapters have dropout), and the guard's counter carries the NaN step of step 2."""
    row = scenario_resume(tmp_path)
    assert row["outcome"] == "loss curve continued exactly", row
    assert row["steps_completed"] == 8 and row["nonfinite_steps_carried_over"] == 1


def _dropout_model(perturb: bool = False):
    from peft import get_peft_model

    # Dropout makes the loss depend on the RNG state, which the resumed run must restore too.
    model = get_peft_model(tiny_llama(), SitsLoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]))
    if perturb:  # a resumed run must get its adapter from the checkpoint, not from its own initialisation
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(1.0)
    return model


def test_step_hooks_run_once_per_optimizer_step(tmp_path):
    calls, module_calls = [], []

    class Fp8StateLike(torch.nn.Module):
        def sits_after_optimizer_step(self, step, skipped):
            module_calls.append((step, skipped))

    model = make_model()
    model.base_model.model.model.fp8_state = Fp8StateLike()
    callback = SitsHardwareCallback(report=False, policy="off")
    callback.add_step_hook(lambda step, skipped: calls.append((step, skipped)))
    trainer, _, error = train(tmp_path, model=model, args=make_args(tmp_path, gradient_accumulation_steps=2),
                              extra_callbacks=[callback], faults=[lambda m: GradFault(m, TARGET, float("nan"), (3,), 2)])
    assert error is None
    expected = [(s, s == 3) for s in range(1, STEPS + 1)]
    assert calls == expected and module_calls == expected
    with pytest.raises(TypeError, match="add_step_hook expects a callable"):
        callback.add_step_hook("not callable")


def test_counts_logged_with_plain_trainer(tmp_path):
    trainer, callback, error = train(tmp_path, trainer_cls="plain", callback_kwargs={"policy": "off"},
                                     faults=[lambda m: GradFault(m, TARGET, float("inf"), (1,))])
    assert error is None
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["nonfinite_steps"] for e in entries] == [1] * STEPS and all(e["clamped_values"] == 0 for e in entries)


def test_native_trainer_adds_one_default_callback():
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    trainer = NativeLoraTrainer(model=make_model(), args=args, train_dataset=make_dataset(4))
    callbacks = [c for c in trainer.callback_handler.callbacks if isinstance(c, SitsHardwareCallback)]
    assert len(callbacks) == 1 and callbacks[0].nan_policy == "skip" and callbacks[0].policies["memory"] == "warn"
    assert not [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "DynamicRankCallback"]
    mine = SitsHardwareCallback(nan_policy="raise")
    trainer = NativeLoraTrainer(model=make_model(), args=args, train_dataset=make_dataset(4), callbacks=[mine])
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, SitsHardwareCallback)] == [mine]


def test_native_trainer_copies_batches_to_the_gpu_without_blocking(monkeypatch):
    """A CUDA run with pinned batches (the default) copies each batch with non_blocking, so the host does not wait
    for the step before; with pinning off, or on a CPU run, the user's setting stays."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    from sits_lora.training.trainer import copies_batches_without_blocking

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    trainer = NativeLoraTrainer(model=make_model(), args=args, train_dataset=make_dataset(4))
    assert trainer.accelerator.non_blocking is False and args.accelerator_config.non_blocking is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert copies_batches_without_blocking(SimpleNamespace(dataloader_pin_memory=True, use_cpu=False))
    assert not copies_batches_without_blocking(SimpleNamespace(dataloader_pin_memory=False, use_cpu=False))
    assert not copies_batches_without_blocking(SimpleNamespace(dataloader_pin_memory=True, use_cpu=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not copies_batches_without_blocking(SimpleNamespace(dataloader_pin_memory=True, use_cpu=False))


def test_native_trainer_adds_the_rank_budget_for_dynamic_rank_models(tmp_path):
    """The issue-5 snippet, NativeLoraTrainer(model=model, ...) with no callback: the rank budget is there and λ moves."""
    import warnings

    from peft import get_peft_model
    from transformers import TrainingArguments, default_data_collator

    from sits_lora import DynamicRankCallback

    def dynamic_model():
        model = get_peft_model(tiny_llama(), SitsLoraConfig(
            r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dynamic_rank=True, rank_scheduler="learned",
            rank_buckets=[2, 4, 6, 8], target_mean_rank=2))
        randomize_lora_weights(model)  # a fresh router decides the bucket below the target for every token
        return model

    model = dynamic_model()
    trainer = NativeLoraTrainer(model=model, args=make_args(tmp_path, max_steps=3), train_dataset=make_dataset(16),
                                data_collator=default_data_collator)
    (budget,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, DynamicRankCallback)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "without a rank budget" in str(w.message)]
    lambdas = [e["rank_lambda"] for e in budget.history]
    # the random routers' mean active rank (about 5) is above the target, so dual ascent raises λ each step
    assert len(lambdas) == 3 and 0 < lambdas[0] < lambdas[1] < lambdas[2]
    mine = DynamicRankCallback(write_jsonl=False)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = NativeLoraTrainer(dynamic_model(), args, train_dataset=make_dataset(4), callbacks=[mine])
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, DynamicRankCallback)] == [mine]


def test_fp16_grad_scaler_refuses_clamp_and_raise():
    class ScaledOptimizer:
        scaler = object()

    class Args:
        deepspeed = None

    for policy in ("clamp", "raise"):
        with pytest.raises(ValueError, match="GradScaler overflows on purpose"):
            SitsHardwareCallback(nan_policy=policy)._setup_guard(Args(), make_model(), ScaledOptimizer())
    callback = SitsHardwareCallback(nan_policy="skip")
    callback._setup_guard(Args(), make_model(), ScaledOptimizer())
    assert callback._scaler_mode and not callback._guard_active


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"policy": "loud"}, "policy='loud') is invalid: allowed values are 'warn', 'strict', 'off'"),
        ({"policy": {"memroy": "strict"}}, "unknown constraints ['memroy']"),
        ({"policy": {"memory": "fatal"}}, "is invalid for ['memory']"),
        ({"nan_policy": "ignore"}, "nan_policy='ignore') is invalid: allowed values are 'skip', 'clamp', 'raise', 'off'"),
        ({"nan_clamp_value": 0}, "nan_clamp_value=0) is invalid: it must be a positive number"),
        ({"nan_clamp_value": float("nan")}, "nan_clamp_value=nan) is invalid"),
        ({"detect_nonfinite_activations": "yes"}, "detect_nonfinite_activations='yes') is invalid: it must be True or False"),
        ({"max_consecutive_nonfinite": 0}, "max_consecutive_nonfinite=0) is invalid"),
        ({"rank_share": 1.5}, "rank_share=1.5) is invalid: it must be a fraction in (0, 1)"),
        ({"memory_budget_gib": -1}, "memory_budget_gib=-1) is invalid: it must be a positive number"),
        ({"seq_len": 0}, "seq_len=0) is invalid: it must be a positive integer"),
    ],
)
def test_bad_callback_arguments_are_named(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SitsHardwareCallback(**kwargs)
    assert needle in str(info.value)


def test_guard_uses_one_foreach_reduction_per_dtype_group(monkeypatch):
    from sits_lora.training.guards import GradientGuard

    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, ord: calls.append(len(ts)) or real(ts, ord))
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(6)]
    params += [torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    params[7].grad[1] = float("inf")
    guard = GradientGuard("skip")
    outcome = guard.check(5, [(f"p{i}", p) for i, p in enumerate(params)])
    assert sorted(calls) == [3, 6]
    assert outcome.skipped and outcome.bad_parameters == ["p7"] and all(p.grad is None for p in params)


def test_clamp_changes_only_the_gradients_of_a_step_with_a_nonfinite_value():
    from sits_lora.training.guards import GradientGuard

    guard = GradientGuard("clamp", clamp_value=1.0)
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([5.0, -7.0, 0.5]), torch.tensor([0.1, 0.2])
    outcome = guard.check(1, [("a", a), ("b", b)])
    assert not outcome.nonfinite and outcome.clamped_values == 0 and a.grad.tolist() == [5.0, -7.0, 0.5]
    b.grad = torch.tensor([float("nan"), float("-inf")])
    outcome = guard.check(2, [("a", a), ("b", b)])
    assert outcome.nonfinite and outcome.bad_parameters == ["b"] and outcome.clamped_values == 4
    assert a.grad.tolist() == [1.0, -1.0, 0.5] and b.grad.tolist() == [0.0, -1.0]


def test_raise_names_the_first_bad_parameter_across_dtype_groups():
    from sits_lora.training.guards import GradientGuard

    params = [torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(2, 2))]
    params[0].grad = torch.tensor([0.0, float("inf"), 1.0], dtype=torch.bfloat16)
    params[1].grad = torch.full((2, 2), float("nan"))
    with pytest.raises(NonFiniteGradientError) as info:
        GradientGuard("raise").check(9, [("first.bf16", params[0]), ("second.fp32", params[1])])
    message = str(info.value)
    assert message.startswith("optimizer step 9: the gradient of first.bf16 holds Inf (shape (3,), dtype bfloat16), "
                              "and 1 other parameter(s) too")
    assert "Nothing was applied at this step (nan_policy='raise')" in message and "nan_policy='skip'" in message


def _ddp_gradient_worker(rank: int, queue) -> None:
    from sits_lora.training.guards import GradientGuard

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    if rank == 1:
        p.grad[2] = float("nan")  # e.g. a sharded gradient: only this rank sees the fault
    outcome = GradientGuard("skip").check(7, [("w", p)])
    queue.put((rank, outcome.skipped, p.grad is None))


def _ddp_activation_worker(rank: int, queue) -> None:
    """nan_policy='raise' with the activation watch, through the callback: a NaN output on rank 1 only."""
    import types

    from sits_lora.training import NonFiniteActivationError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    callback = SitsHardwareCallback(nan_policy="raise", detect_nonfinite_activations=True, report=False, policy="off")
    callback._setup_guard(types.SimpleNamespace(deepspeed=None), model, None)
    x = torch.ones(2, 4)
    if rank == 1:
        x[0, 0] = float("nan")
    model(x).sum().backward()
    try:
        callback.after_backward(model, types.SimpleNamespace(global_step=4), None, sync=True)
        queue.put((rank, "finished", False))
    except NonFiniteActivationError as error:
        hooks_left = any(m._forward_hooks for m in model.modules())
        queue.put((rank, str(error), hooks_left))


def _ddp_worker(rank: int, world: int, port: int, queue, body) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)  # the parent's intra-op thread pool does not survive fork: a parallel op would hang
    # A rank left waiting in a collective (the bug these tests guard against) fails after 20 s, not 30 minutes.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        body(rank, queue)
    except Exception as error:  # reported, so that the parent does not wait for a result that never comes
        queue.put((rank, f"{type(error).__name__}: {error}", None))
    finally:
        dist.destroy_process_group()


def _two_ranks(body) -> list:
    """Run ``body(rank, queue)`` on two gloo ranks (forked processes); their results, sorted by rank."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # forked children reuse the imported modules: ~1 s, not ~20 s
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(rank, 2, port, queue, body)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return results


def scenario_ranks_agree() -> dict:
    """A fault on one of two ranks (gloo, forked processes): every rank skips, the flag is all-reduced."""
    results = _two_ranks(_ddp_gradient_worker)
    agree = results == [(0, True, True), (1, True, True)]
    return {"case": "nan-on-one-of-two-ranks", "fault": "nan in rank 1's gradient only", "policy": "skip",
            "ranks_skipped": [r[1] for r in results], "outcome": "both ranks skipped" if agree else "FAILED"}


def scenario_activation_ranks_agree() -> dict:
    """A NaN forward output on one of two ranks under nan_policy='raise': every rank raises at once (a rank
    that raised alone would leave the other waiting in the guard's all-reduce until the timeout)."""
    results = _two_ranks(_ddp_activation_worker)
    messages = [r[1] for r in results]
    agree = (len(results) == 2 and "optimizer step 5: the first module whose forward output is not finite is 0."
             in messages[1] and "optimizer step 5" in messages[0] and "was on another rank" in messages[0]
             and not any(r[2] for r in results))
    return {"case": "nan-activation-on-one-of-two-ranks", "fault": "nan in rank 1's first layer output only",
            "policy": "raise", "messages": messages,
            "outcome": "both ranks raised NonFiniteActivationError" if agree else "FAILED"}


def test_ranks_agree_on_skipping():
    row = scenario_ranks_agree()
    assert row["outcome"] == "both ranks skipped", row


def test_ranks_agree_on_a_nonfinite_activation():
    row = scenario_activation_ranks_agree()
    assert row["outcome"] == "both ranks raised NonFiniteActivationError", row


def test_activation_watch_is_replaced_not_stacked(tmp_path):
    """A run stopped by the activation error never reaches on_train_end; the next train() must not add a second
    set of hooks (each would check every output again), and the error leaves none behind."""
    from sits_lora.activations.recompute import remember_norm_io

    callback = SitsHardwareCallback(nan_policy="raise", detect_nonfinite_activations=True, report=False, policy="off")
    model = make_model()
    trainer, _, error = train(tmp_path, model=model, extra_callbacks=[callback],
                              faults=[lambda m: ActivationFault(m, ACT_MODULE, (2,))])
    assert type(error).__name__ == "NonFiniteActivationError" and trainer.state.global_step == 1

    def watch_hooks():
        # the model's own hooks stay: the fault's, and the norms' of sits_lora.activations (recompute_lora_inputs)
        return [h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
                if not isinstance(h, ActivationFault) and h is not remember_norm_io]

    assert watch_hooks() == []

    class Args:
        deepspeed = None

    callback._setup_guard(Args(), model, None)
    first = len(watch_hooks())
    callback._setup_guard(Args(), model, None)
    assert first > 0 and len(watch_hooks()) == first


def scenario_int4() -> list[dict]:
    """A misaligned and an odd-shaped bitsandbytes 4-bit layer: each is named with its shape and fix."""
    import bitsandbytes as bnb

    from sits_lora.training.constraints import check_int4

    def layer(k, n):
        return bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")

    misaligned = torch.nn.Sequential(layer(128, 64))
    packed = misaligned[0].weight.data
    view = torch.empty(packed.numel() + 1, dtype=torch.uint8)[1:].view(packed.shape)
    view.copy_(packed)
    misaligned[0].weight.data = view
    rows = []
    for name, model, needle in (("int4-misaligned-packed-weight", misaligned, "not 32-byte aligned"),
                                ("int4-odd-shaped-layer", torch.nn.Sequential(layer(100, 48)), "in_features=100")):
        result = check_int4(model)
        named = result.status == "violated" and any(needle in s for s in result.suggestions)
        rows.append({"case": name, "fault": needle, "policy": "int4 check", "message": result.suggestions,
                     "outcome": "named with shape and fix" if named else "FAILED"})
    return rows


def test_int4_cases_of_the_matrix():
    pytest.importorskip("bitsandbytes")
    rows = scenario_int4()
    assert [r["outcome"] for r in rows] == ["named with shape and fix"] * 2, rows


# ----------------------------------------------------------------------------- the matrix as JSON


def main(argv=None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description="Run every fault-injection case and write the matrix as JSON.")
    parser.add_argument("--out", default=os.path.join("bench", "results", "fault_matrix.json"), help="JSON file to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        found = [run_case(case, tmp) for case in FAULT_CASES]
        found.append(scenario_strict_memory(os.path.join(tmp, "strict")))
        found.append(scenario_resume(os.path.join(tmp, "resume")))
        found.append(scenario_ranks_agree())
        found.append(scenario_activation_ranks_agree())
        try:
            found.extend(scenario_int4())
        except ImportError:
            print("bitsandbytes is not installed: the INT4 cases are left out")
    for row in found:
        row = {k: v for k, v in row.items() if not k.startswith("_")}
        row.setdefault("survived", row["outcome"] != "FAILED")
        row.setdefault("nothing_lost", row["survived"])
        rows.append(row)
        print(f"{row['case']:38s} {row['outcome']:50s} survived={row['survived']}", flush=True)
    guarded = [r for r in rows if not r.get("control")]
    summary = {"cases": len(guarded), "survived": sum(r["survived"] for r in guarded),
               "nothing_lost": sum(bool(r["nothing_lost"]) for r in guarded),
               "controls": [r["case"] for r in rows if r.get("control")]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "transformers": _version("transformers"), "sits_lora": sits_lora.__version__,
                   "command": "python tests/training/test_guardrails_faults.py --out " + args.out, "summary": summary,
                   "cases": rows}, f, indent=2)
    print(f"wrote {args.out}: {summary['survived']}/{summary['cases']} guarded cases survived, "
          f"{summary['nothing_lost']} lost nothing; control: {', '.join(summary['controls'])}")
    return 0 if summary["survived"] == summary["cases"] == summary["nothing_lost"] else 1


def _version(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


if __name__ == "__main__":
    sys.exit(main())


@pytest.mark.slow
def test_fp8_scaling_state_survives_an_interrupted_run(tmp_path):
    """fp8 (emulated): the amax history and scales are in each checkpoint; a run resumed from step 4 ends with the
    uninterrupted run's scaling state, losses and adapter weights."""
    from peft import get_peft_model
    from transformers import TrainerCallback

    from sits_lora.fp8 import fp8_scaling_state
    from sits_lora.training.callback import MODULE_STATE_FILE

    def fp8_model(perturb=False):
        model = get_peft_model(tiny_llama(), SitsLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                           fp8="hybrid", fp8_emulate=True, fp8_amax_history_len=3))
        if perturb:
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(1.0)
        return model

    class Interrupt(Exception):
        pass

    class StopAfter4(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 4:  # killed after every on_save of checkpoint-4 ran, before step 5
                raise Interrupt

    common = dict(max_steps=7, save_strategy="steps", save_steps=4)
    full, _, error = train(tmp_path / "full", args=make_args(tmp_path / "full", **common), model=fp8_model())
    assert error is None, error
    _, _, error = train(tmp_path / "part", args=make_args(tmp_path / "part", **common), model=fp8_model(),
                        extra_callbacks=[StopAfter4()])
    assert isinstance(error, Interrupt), error
    assert (tmp_path / "part" / "checkpoint-4" / MODULE_STATE_FILE).exists()
    resumed, _, error = train(tmp_path / "part", args=make_args(tmp_path / "part", **common),
                              model=fp8_model(perturb=True), resume=str(tmp_path / "part" / "checkpoint-4"))
    assert error is None, error
    a, b = fp8_scaling_state(full.model), fp8_scaling_state(resumed.model)
    assert a.steps == b.steps == 7 and int(a.position) == int(b.position)
    for name in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    full_losses, resumed_losses = losses(full), losses(resumed)
    assert all(resumed_losses[s] == full_losses[s] for s in range(5, 8))
    final_full, final_resumed = trainable_state(full.model), trainable_state(resumed.model)
    assert all(torch.equal(final_full[n], final_resumed[n]) for n in final_full)


def test_fp8_scaling_state_refuses_a_checkpoint_of_other_layers():
    from peft import get_peft_model

    from sits_lora.fp8 import fp8_scaling_state

    def state(targets, history):
        model = get_peft_model(tiny_llama(), SitsLoraConfig(r=2, target_modules=targets, fp8="hybrid",
                                                           fp8_emulate=True, fp8_amax_history_len=history))
        return fp8_scaling_state(model)

    saved = state(["q_proj"], 4).sits_checkpoint_state()
    with pytest.raises(ValueError, match=r"saved for 2 layers, fp8='hybrid', fp8_amax_history_len=4; this model has "
                                         r"4 layers.*Resume with the SitsLoraConfig the checkpoint was trained with"):
        state(["q_proj", "down_proj"], 4).sits_load_checkpoint_state(saved)
