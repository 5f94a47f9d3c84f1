"""The recorded optimizer step (sits_lora.training.step) and NativeLoraTrainer's decision to record it: on the CPU,
the decision and its line for fixed, bucketed and varying shapes and each blocker; the step itself run eagerly
against a hand-written step (fused loss, clipping, the guard's skip); on a GPU, the recorded step against eager
steps and the trainer recording by itself."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from conftest import randomize_lora_weights, tiny_llama

from sits_lora import SitsLoraConfig
from sits_lora.training.recording import batch_shapes, decide_recording
from sits_lora.training.step import TrainStep, causal_lm_loss, default_train_step, fused_loss_support

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapted(dtype=torch.float32, seed=0):
    from peft import get_peft_model

    config = SitsLoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS)
    model = get_peft_model(tiny_llama(seed, dtype=dtype), config)
    randomize_lora_weights(model)
    return model.train()


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": list(range(self.lengths[i]))}


def test_batch_shapes_fixed_bucketed_varying_and_unknown():
    fixed, detail, graphs = batch_shapes(_Blocks([32] * 10), None)
    assert fixed is True and "every example 32 tokens" in detail and graphs == 2
    fixed, detail, _ = batch_shapes(_Blocks([5, 9, 31]), None)
    assert fixed is False and "vary (5-31 tokens among the first 3)" in detail and "padding='max_length'" in detail
    collator = types.SimpleNamespace(pad_to_multiple_of=16, padding=True)
    fixed, detail, graphs = batch_shapes(_Blocks([5, 9, 31, 40]), collator)
    assert fixed is True and "3 bucket(s)" in detail and graphs == 3
    fixed, detail, _ = batch_shapes(_Blocks(list(range(1, 200, 3))), types.SimpleNamespace(pad_to_multiple_of=2))
    assert fixed is False and "more than 8 recordings" in detail
    fixed, detail, _ = batch_shapes(_Blocks([5, 9]), types.SimpleNamespace(padding="max_length", max_length=64))
    assert fixed is True and "pads every batch to 64 tokens" in detail
    fixed, detail, _ = batch_shapes(iter([]), None)
    assert fixed is None and "not known ahead" in detail


def _decide(model, requested="auto", optimizer=None, nan_policy="skip", dataset=None, inputs=None, callbacks=(),
            **args):
    arguments = dict(world_size=1, gradient_accumulation_steps=1, fp16=False, gradient_checkpointing=False)
    arguments.update(args)
    optimizer = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    callback = types.SimpleNamespace(nan_policy=nan_policy, detect_nonfinite_activations=False)
    accelerator = types.SimpleNamespace(distributed_type=types.SimpleNamespace(value="NO"))
    return decide_recording(requested, model=model, args=types.SimpleNamespace(**arguments), optimizer=optimizer,
                            callback=callback, accelerator=accelerator, train_dataset=dataset or _Blocks([16] * 4),
                            data_collator=None, inputs=inputs or {"input_ids": torch.zeros(2, 16, dtype=torch.long)},
                            loss=_loss_label(model), callbacks=callbacks)


def _loss_label(model):
    supported, why = fused_loss_support(model)
    return ("the fused linear cross-entropy without host syncs", "" if supported else why)


def test_the_decision_names_each_blocker_and_its_fix(monkeypatch):
    model = _adapted()
    if not torch.cuda.is_available():
        off = _decide(model)
        assert not off.on and off.reason.startswith("off: the model is not on a CUDA GPU")
        with pytest.raises(ValueError, match=r"record_step=True\): the step cannot be recorded: the model is not on"):
            _decide(model, requested=True)
    assert _decide(model, requested=False).reason == ("off (record_step=False): eager steps; loss: the fused linear "
                                                      "cross-entropy without host syncs")
    # the rest as if on a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    on = _decide(model)
    assert on.on and "every example 16 tokens" in on.reason and "fused linear cross-entropy" in on.reason
    reason = _decide(model, gradient_accumulation_steps=4).reason
    assert "gradient_accumulation_steps=4" in reason and "per_device_train_batch_size" in reason
    plain = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert "without fused=True" in _decide(model, optimizer=plain).reason
    assert _decide(model, optimizer=plain, nan_policy="off").on      # no guard to skip with: any capturable optimizer
    assert "use 'skip'" in _decide(model, nan_policy="clamp").reason
    assert "use bf16=True" in _decide(model, fp16=True).reason
    assert "2 processes" in _decide(model, world_size=2).reason
    left = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]] * 2)}
    assert "pad on the left" in _decide(model, inputs=left).reason
    right = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0]] * 2)}
    assert _decide(model, inputs=right).on
    assert "vary" in _decide(model, dataset=_Blocks([3, 30])).reason


def test_callbacks_on_the_optimizer_step_and_gradient_hooks_are_blockers(monkeypatch):
    from transformers import TrainerCallback
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback

    class Snapshot(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            pass

    class Logs(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            pass

    model = _adapted()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert _decide(model, callbacks=[DefaultFlowCallback(), PrinterCallback(), Logs()]).on
    reason = _decide(model, callbacks=[Logs(), Snapshot()]).reason
    assert reason.startswith("off: callback Snapshot.on_pre_optimizer_step (") and "on_step_end" in reason
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    handle = param.register_hook(lambda grad: grad)
    reason = _decide(model).reason
    assert reason.startswith(f"off: gradient hooks on {name} (") and "replays" in reason
    handle.remove()
    assert _decide(model).on


def test_an_fp8_base_records_and_a_module_stepped_on_the_host_is_named(monkeypatch):
    from peft import get_peft_model

    config = SitsLoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, fp8="hybrid", fp8_emulate=True,
                            fp8_layers="all")
    model = get_peft_model(tiny_llama(0, hidden_size=64, intermediate_size=128), config).train()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert _decide(model).on        # its scaling state advances inside the step (sits_advance_in_step)

    class HostCounter(torch.nn.Module):
        def sits_after_optimizer_step(self, step, skipped):
            pass

    model.base_model.model.add_module("counter", HostCounter())
    reason = _decide(model).reason
    assert reason.startswith("off: HostCounter: a module whose per-step state is advanced on the host")
    assert "sits_advance_in_step" in reason


def test_fused_loss_support_names_what_it_does_not_cover():
    assert fused_loss_support(_adapted()) == (True, "")
    model = _adapted()
    model.get_base_model().lm_head = torch.nn.Linear(48, 97, bias=True)
    supported, why = fused_loss_support(model)
    assert not supported and "with a bias" in why
    model.get_base_model().config.model_type = "gemma2"
    assert "model type 'gemma2'" in fused_loss_support(model)[1]


def test_the_fused_loss_equals_the_model_loss():
    model = _adapted()
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels).loss
        assert torch.allclose(causal_lm_loss(model, {"input_ids": ids, "labels": labels}), expected, rtol=1e-5)
        count = (labels[:, 1:] != -100).sum()
        summed = model(input_ids=ids, labels=labels, num_items_in_batch=count).loss
        assert torch.allclose(causal_lm_loss(model, {"input_ids": ids, "labels": labels}, count), summed, rtol=1e-5)
    with pytest.raises(ValueError, match=r"inputs \['inputs_embeds'\] are not decoder inputs"):
        causal_lm_loss(model, {"inputs_embeds": ids, "labels": labels})


def _hand_written_step(model, optimizer, ids, max_norm):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def test_the_step_run_eagerly_trains_as_a_hand_written_step():
    ours = _adapted()
    theirs = copy.deepcopy(ours)
    opt_ours = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2, fused=True)
    opt_theirs = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2, fused=True)
    step = default_train_step(ours, opt_ours, max_grad_norm=0.5)
    assert step.recorded is None                                  # a CPU model: eager
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 97, (2, 9), generator=gen)
        mine = step.run({"input_ids": ids, "labels": ids})
        reference = _hand_written_step(theirs, opt_theirs, ids, 0.5)
        assert torch.allclose(mine.loss, reference, rtol=1e-5)
        assert mine.nonfinite.shape == (len(step.gradient_names),) and not mine.nonfinite.any()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert (a - b).abs().max() <= 1e-4, name      # Adam amplifies the losses' rounding differences
    assert all(p.grad is None for p in ours.parameters())


def test_a_non_finite_gradient_leaves_the_update_undone_and_is_named():
    model = _adapted()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    step = TrainStep(model, optimizer, max_grad_norm=1.0, record=False)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    step.run({"input_ids": ids, "labels": ids})                  # the optimizer's state exists
    before = [p.detach().clone() for p in params]
    counts = [optimizer.state[p]["step"].clone() for p in params]
    poisoned = dict(model.named_parameters())[step.gradient_names[0]]
    hook = poisoned.register_hook(lambda g: g * float("nan"))
    outcome = step.run({"input_ids": ids, "labels": ids})
    hook.remove()
    assert outcome.nonfinite.tolist() == [True] + [False] * (len(step.gradient_names) - 1)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(torch.equal(optimizer.state[p]["step"], c) for p, c in zip(params, counts))
    assert not hasattr(optimizer, "found_inf")                     # the Trainer's own optimizer.step() reads none
    step.run({"input_ids": ids, "labels": ids})
    assert not all(torch.equal(a, b) for a, b in zip(before, params))


def test_a_collator_s_batch_encoding_and_fp16_gradients_are_taken():
    """A BatchEncoding (what transformers' collators return) is a Mapping, not a dict: the step takes it as a dict
    (a recording's signature describes dicts). fp16 gradients' norms are taken in float32: their squares overflow
    fp16 while every value is finite."""
    from transformers import BatchEncoding

    model = _adapted()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    step = TrainStep(model, optimizer, record=False)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    assert torch.isfinite(step.run(BatchEncoding({"input_ids": ids, "labels": ids})).loss)
    from sits_lora.training.step import gradient_norms

    big = [torch.full((64,), 1000.0, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    assert torch.allclose(gradient_norms({torch.float16: big}), torch.tensor([8000.0, 3 ** 0.5]))


def test_the_step_refuses_bad_arguments():
    model = _adapted()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match=r"nan_policy='skip'\) leaves a non-finite step unapplied through the fused "
                                         r"Adam / AdamW kernels, and the optimizer is AdamW without fused=True: build"):
        default_train_step(model, optimizer)
    assert default_train_step(model, optimizer, nan_policy="off").nan_policy == "off"
    with pytest.raises(ValueError, match=r"nan_policy='clamp'\) is invalid: allowed values are 'skip', 'off' \(the trainer's 'raise'"):
        default_train_step(model, optimizer, nan_policy="clamp")
    with pytest.raises(ValueError, match=r"max_grad_norm=-1\) is invalid: it must be a number >= 0 \(0: no clipping\)"):
        default_train_step(model, optimizer, max_grad_norm=-1)
    frozen = tiny_llama().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        default_train_step(frozen, optimizer)


def test_the_trainer_says_whether_it_records(tmp_path, caplog):
    from transformers import TrainingArguments

    from sits_lora.training import NativeLoraTrainer

    with pytest.raises(ValueError, match=r"record_step='yes'\) is invalid: allowed values are 'auto'"):
        NativeLoraTrainer(model=_adapted(), record_step="yes")
    data = [{"input_ids": torch.randint(0, 97, (12,)), "labels": torch.randint(0, 97, (12,))} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none",
                             use_cpu=True, save_strategy="no", logging_steps=1)
    trainer = NativeLoraTrainer(model=_adapted(), args=args, train_dataset=data,
                                callbacks=[__import__("sits_lora").SitsHardwareCallback(report=False)])
    with caplog.at_level("WARNING", logger="sits_lora"):
        trainer.train()
    assert trainer.step_recording is not None and not trainer.step_recording.on
    assert "step recording off: the model is not on a CUDA GPU" in caplog.text
    assert caplog.text.count("step recording") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recorded_step_with_the_fused_loss_equals_eager_steps():
    eager_model = _adapted(torch.bfloat16).cuda()
    graphed_model = copy.deepcopy(eager_model)
    steps = {}
    for name, model in (("eager", eager_model), ("graphed", graphed_model)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
        steps[name] = default_train_step(model, optimizer, max_grad_norm=1.0, record=name == "graphed")
    gen = torch.Generator().manual_seed(3)
    losses = {"eager": [], "graphed": []}
    for _ in range(5):
        ids = torch.randint(0, 97, (2, 24), generator=gen).cuda()
        for name, step in steps.items():
            losses[name].append(step(input_ids=ids, labels=ids).item())
    recorded = steps["graphed"].recorded
    assert (recorded.eager_calls, recorded.recordings, recorded.replays) == (2, 1, 3)
    assert losses["graphed"] == pytest.approx(losses["eager"], rel=2e-2)
    for (name, a), (_, b) in zip(eager_model.named_parameters(), graphed_model.named_parameters()):
        if a.requires_grad:
            assert (a.float() - b.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item() + 1e-3, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_trainer_records_its_step_on_fixed_shapes(tmp_path, caplog):
    from transformers import TrainingArguments

    from sits_lora.training import NativeLoraTrainer

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 97, (16,), generator=gen)} for _ in range(32)]
    for example in data:
        example["labels"] = example["input_ids"].clone()
    losses = {}
    for record in (False, "auto"):
        model = _adapted(torch.bfloat16).cuda()
        args = TrainingArguments(output_dir=str(tmp_path / str(record)), max_steps=6, per_device_train_batch_size=4,
                                 report_to="none", save_strategy="no", logging_steps=1, bf16=True,
                                 learning_rate=1e-3, max_grad_norm=1.0)
        trainer = NativeLoraTrainer(model=model, args=args, train_dataset=data, record_step=record,
                                    callbacks=[__import__("sits_lora").SitsHardwareCallback(report=False)])
        with caplog.at_level("WARNING", logger="sits_lora"):
            trainer.train()
        losses[record] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        assert all("grad_norm" in e and e["grad_norm"] > 0 for e in trainer.state.log_history if "loss" in e)
        assert trainer.accelerator.non_blocking   # pinned batches copied without the host waiting for the GPU
        if record == "auto":
            assert trainer.step_recording.on, trainer.step_recording.reason
            assert trainer._train_step.recorded.replays == 4
    assert losses["auto"] == pytest.approx(losses[False], rel=3e-2)


def _trainer_run(tmp_path, record, nan_at=None, nan_policy="skip", steps=5, monkeypatch=None):
    """A tiny model trained by NativeLoraTrainer on the CPU; ``record``: the trainer's recorded path forced on (its
    step then runs eagerly: a CPU has no CUDA graphs, everything else is the GPU's path). ``nan_at``: the optimizer
    step (from 1) whose first trainable gradient is made NaN."""
    from transformers import TrainingArguments

    import sits_lora.training.native as trainer_module
    from sits_lora import SitsHardwareCallback
    from sits_lora.training import NativeLoraTrainer
    from sits_lora.training.recording import RecordingDecision

    if record:
        monkeypatch.setattr(trainer_module, "decide_recording",
                            lambda *args, **kwargs: RecordingDecision(True, "on: forced by the test"))
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 97, (12,), generator=gen)} for _ in range(4 * steps)]
    for example in data:
        example["labels"] = example["input_ids"].clone()
    model = _adapted()
    calls = [0]
    if nan_at is not None:
        first = next(p for p in model.parameters() if p.requires_grad)

        def poison(grad):
            calls[0] += 1
            return grad * float("nan") if calls[0] == nan_at else grad

        first.register_hook(poison)
    args = TrainingArguments(output_dir=str(tmp_path / f"run-{record}"), max_steps=steps, per_device_train_batch_size=4,
                             report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, learning_rate=1e-2,
                             max_grad_norm=1.0, optim="adamw_torch_fused", lr_scheduler_type="linear")
    trainer = NativeLoraTrainer(model=model, args=args, train_dataset=data, record_step=True if record else False,
                                callbacks=[SitsHardwareCallback(report=False, nan_policy=nan_policy)])
    trainer.train()
    return trainer, model


def _assert_trained_alike(a_model, b_model):
    """The two runs moved the adapters alike: their difference is under 2 % of how far training moved them (Adam
    turns the two losses' rounding into sign flips of near-zero gradients, so single weights can differ by a step;
    a step applied in one run and not the other moves every weight)."""
    start = dict(_adapted().named_parameters())
    moved = diff = 0.0
    for (name, a), (_, b) in zip(a_model.named_parameters(), b_model.named_parameters()):
        if a.requires_grad:
            moved += (a - start[name]).pow(2).sum().item()
            diff += (a - b).pow(2).sum().item()
    assert moved > 0 and diff ** 0.5 <= 0.02 * moved ** 0.5, (diff ** 0.5, moved ** 0.5)


def test_a_loss_of_the_trainer_s_own_keeps_the_model_s_loss(tmp_path):
    from transformers import TrainingArguments

    from sits_lora.training import NativeLoraTrainer
    from sits_lora.training.objectives import CausalLMObjective

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, label_smoothing_factor=0.1)
    trainer = NativeLoraTrainer(model=_adapted(), args=args)
    ids = torch.zeros(2, 4, dtype=torch.long)

    def why(trainer, inputs):
        return CausalLMObjective().unsupported(trainer, trainer.model, inputs)

    assert why(trainer, {"input_ids": ids, "labels": ids}) == "label_smoothing_factor=0.1"
    trainer.args.label_smoothing_factor = 0.0
    assert why(trainer, {"input_ids": ids, "labels": ids}) == ""
    assert why(trainer, {"input_ids": ids, "labels": ids, "token_type_ids": ids}) == "the batches carry token_type_ids"
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    assert why(trainer, {"input_ids": ids, "labels": ids}) == "compute_loss_func is set"
    trainer.compute_loss_func = None
    handle = trainer.model.register_forward_pre_hook(lambda module, args: None)
    assert why(trainer, {"input_ids": ids, "labels": ids}).startswith("forward hooks on the model (function)")
    handle.remove()

    class Custom(NativeLoraTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    custom = Custom(model=_adapted(), args=args)
    assert why(custom, {"input_ids": ids, "labels": ids}) == "Custom overrides compute_loss"


def test_the_trainer_s_recorded_path_trains_as_its_eager_path(tmp_path, monkeypatch):
    """The trainer's recorded path (forced on, run eagerly on the CPU): the same losses, logged gradient norms and
    learning rates, and the same adapters as the Trainer's own step."""
    eager, eager_model = _trainer_run(tmp_path, record=False)
    ours, our_model = _trainer_run(tmp_path, record=True, monkeypatch=monkeypatch)
    assert ours.step_recording.on and ours._train_step is not None and ours._train_step.recorded is None
    assert ours.args.logging_nan_inf_filter is True                 # turned off while training, then put back
    plans = {name: t.sits_callback().memory_plan for name, t in (("eager", eager), ("ours", ours))}
    assert plans["eager"].loss == plans["ours"].loss == "fused"   # the plan follows the loss that runs: the fused one
    logged = {name: [[e[k] for k in ("loss", "grad_norm", "learning_rate")] for e in t.state.log_history if "loss" in e]
              for name, t in (("eager", eager), ("ours", ours))}
    assert len(logged["ours"]) == 5
    for mine, theirs in zip(logged["ours"], logged["eager"]):
        assert mine == pytest.approx(theirs, rel=1e-3)       # the two losses round differently; Adam carries it
    _assert_trained_alike(eager_model, our_model)


def test_a_non_finite_step_under_the_recorded_path_is_skipped_and_counted_one_step_later(tmp_path, monkeypatch,
                                                                                          caplog):
    eager, eager_model = _trainer_run(tmp_path, record=False, nan_at=3)
    with caplog.at_level("WARNING", logger="sits_lora"):
        ours, our_model = _trainer_run(tmp_path, record=True, nan_at=3, monkeypatch=monkeypatch)
    assert "optimizer step 3: non-finite gradient in base_model.model.model.layers.0" in caplog.text
    assert "step skipped on the GPU" in caplog.text
    counts = [e["nonfinite_steps"] for e in ours.state.log_history if "loss" in e]
    assert counts[-1] == 1 and counts == [e["nonfinite_steps"] for e in eager.state.log_history if "loss" in e]
    _assert_trained_alike(eager_model, our_model)                 # both dropped step 3, nothing else


def test_raise_under_the_recorded_path_names_the_step_and_the_parameter(tmp_path, monkeypatch):
    from sits_lora.training import NonFiniteGradientError

    with pytest.raises(NonFiniteGradientError, match=r"optimizer step 2: the gradient of base_model\.model\.model\."
                                                     r"layers\.0\.\S+ is not finite.*step 3 ran"):
        _trainer_run(tmp_path, record=True, nan_at=2, nan_policy="raise", monkeypatch=monkeypatch)
