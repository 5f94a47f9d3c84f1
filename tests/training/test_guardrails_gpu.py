"""The guard rails on a CUDA device: real measurements, the memory plan against the allocator's peak, and a
fault-injection run in bf16. Skipped without CUDA; run on the GPU with `python -m pytest -m gpu tests/training/test_guardrails_gpu.py`."""

from __future__ import annotations

import gc as python_gc

import pytest
import torch

import sits_lora
from sits_lora.training import NativeLoraTrainer, SitsHardwareCallback, probe_hardware

from test_guardrails_faults import GradFault, UndoUpdates, optimizer_tensors, trainable_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(seed=0, attention="sdpa"):
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
                         attn_implementation=attention, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    return get_peft_model(model, sits_lora.SitsLoraConfig(r=16, lora_alpha=32, target_modules=PROJ))


def _dataset(n=24, seq=512):
    ids = torch.randint(0, 32000, (n, seq), generator=torch.Generator().manual_seed(0)).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]  # the GPU image has no `datasets`


def _args(out, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, bf16=True,
                  optim="adamw_torch_fused", logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                  train_sampling_strategy="sequential", dataloader_num_workers=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def test_hardware_is_measured_and_cached(tmp_path):
    first = probe_hardware(cache_dir=tmp_path)
    assert first.is_cuda and not first.from_cache
    assert first.hbm_bandwidth > 1e11 and first.matmul_flops > 1e13 and first.pinned_bandwidth > 1e9
    second = probe_hardware(cache_dir=tmp_path)
    assert second.from_cache and second.hbm_bandwidth == first.hbm_bandwidth
    print("\n" + first.table())


@pytest.mark.parametrize("gc, record_step", [
    (False, False),
    # The recording warms up and captures on two side streams; each stream's first cuBLAS GEMM allocates that stream's
    # workspace, which the allocator counts and never frees: the plan counts two (plan_memory(recorded=True)), so that
    # the recorded step is within the bound alone in a process as after other tests
    (False, "auto"),
    (True, "auto")], ids=["eager", "recorded", "gc"])
def test_plan_within_15_percent_of_cuda_peak(tmp_path, gc, record_step):
    from transformers import TrainerCallback

    peaks = []

    class Peak(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())

    # The allocator's peak counts every live tensor of the process: what earlier tests left (a recorded graph's
    # pool, a cached buffer) is not this model's and is taken out.
    python_gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    callback = SitsHardwareCallback(report=False)
    trainer = NativeLoraTrainer(model=_model(), args=_args(tmp_path, max_steps=3, gradient_checkpointing=gc),
                                train_dataset=_dataset(), callbacks=[callback, Peak()], record_step=record_step)
    trainer.train()
    # with checkpointing on, the memory plan of this small step lets the trainer switch it off and record
    assert trainer.step_recording.on == (record_step == "auto")
    assert ("gradient checkpointing off for this run" in trainer.step_recording.reason) == (gc and record_step == "auto")
    plan = callback.memory_plan                  # every step's loss is the fused one (eager too), and so is its plan
    assert plan.loss == "fused"
    peak = max(peaks) - before
    # each step's peak so far, less what was held before: where a miss happens (warm-up steps, the recording, the
    # replays) shows which part of the plan is off
    step_peaks = [round((p - before) / 2**30, 3) for p in peaks]
    assert abs(plan.total / peak - 1) < 0.15, (plan.table(), peak / 2**30, before / 2**30, step_peaks)
    rank = next(r for r in callback.results if r.name == "rank")
    assert rank.status != "skipped" and all(row["fused"] and row["ceiling"] > 0 for row in rank.details["layers"])
    print("\n" + plan.table() + f"\nmeasured peak {peak / 2**30:.2f} GiB ({before / 2**30:.2f} GiB held before it); "
          "rank ceilings "
          + ", ".join(f"{row['example'].rsplit('.', 1)[-1]} {row['ceiling']}" for row in rank.details["layers"]))


def test_a_recorded_step_with_a_non_finite_loss_is_left_unapplied(tmp_path):
    """The recorded step's guard: a NaN that enters on the GPU during a replay (a device tensor the recording reads,
    set between steps) leaves that step's update undone on the device, and is counted."""
    from transformers import TrainerCallback

    model = _model()
    fault = torch.zeros((), device="cuda", dtype=torch.bfloat16)
    model.base_model.model.model.layers[3].mlp.register_forward_hook(lambda module, args, output: output + fault)
    snapshots = []

    class Faults(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            fault.fill_(float("nan") if state.global_step + 1 == 4 else 0.0)   # step 4: a replay

        def on_step_end(self, args, state, control, model=None, **kw):
            snapshots.append(trainable_state(model))

    callback = SitsHardwareCallback(report=False, nan_policy="skip")
    trainer = NativeLoraTrainer(model=model, args=_args(tmp_path, max_steps=5), train_dataset=_dataset(),
                                callbacks=[callback, Faults()])
    trainer.train()
    assert trainer.step_recording.on and trainer._train_step.recorded.replays >= 2
    assert trainer.state.global_step == 5 and callback.nonfinite_steps == 1
    names = list(snapshots[0])
    for name in names:
        assert all(torch.isfinite(s[name]).all() for s in snapshots), name
        assert torch.equal(snapshots[3][name], snapshots[2][name]), name           # step 4 applied nothing
    assert any(not torch.equal(snapshots[4][n], snapshots[3][n]) for n in names)   # step 5 did
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert {int(state["step"]) for state in optimizer.state.values()} == {4}


def test_skip_on_device_equals_run_without_those_updates(tmp_path):
    fault_steps = (2,)
    undo = UndoUpdates(fault_steps)
    # eager attention: SDPA's flash backward accumulates dQ with atomics, so two runs differ by bf16 noise, which
    # Adam's first steps turn into updates of about lr wherever a gradient is near zero (below); the sits_lora
    # kernels use no atomics in their sums
    reference = NativeLoraTrainer(model=_model(attention="eager"), args=_args(tmp_path / "ref"),
                                  train_dataset=_dataset(),
                                  callbacks=[SitsHardwareCallback(report=False, nan_policy="off"), undo.callback])
    reference.train()
    model = _model(attention="eager")
    GradFault(model, "base_model.model.model.layers.3.mlp.down_proj.lora_B.default.weight", float("nan"), fault_steps)
    callback = SitsHardwareCallback(report=False, nan_policy="skip")
    trainer = NativeLoraTrainer(model=model, args=_args(tmp_path / "run"), train_dataset=_dataset(), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 4 and callback.nonfinite_steps == 1
    ours, ref = trainable_state(trainer.model), trainable_state(reference.model)
    # Under SDPA the runs differed by noise that Adam's early steps amplify: a value whose near-zero gradient's sign
    # the noise flips moves by about lr the other way (on an H100, from 0.1 % to 2.1 % of layer 0's q_proj lora_A
    # values more than lr/2 apart, run to run). Whatever noise is left stays as small: few values (0.5 % of a
    # tensor) off by half of lr, none by more than the two steps since the fault can move it, and the tensor as a
    # whole far closer than one step; a step applied by mistake moves every value by about lr.
    lr = trainer.args.learning_rate
    for name in ours:
        diff = (ours[name].float() - ref[name].float())
        assert (diff.abs() > 0.5 * lr).float().mean() <= 0.005, name
        assert diff.abs().max() <= 2 * lr, name
        assert diff.norm() <= 0.05 * lr * diff.numel() ** 0.5, name
    # Adam's moments carry the same bf16 noise (measured: 12 % of exp_avg values off by up to 3.7e-6);
    # a skipped step that still advanced them would change them by their own size.
    for a, b in zip(optimizer_tensors(trainer), optimizer_tensors(reference)):
        assert (a.float() - b.float()).norm() <= 0.05 * b.float().norm() + 1e-12
