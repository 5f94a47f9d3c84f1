# what differs between the skip run and its oracle (tests/training/test_guardrails_gpu.py::test_skip_on_device_...)
import os, sys, tempfile
sys.path[:0] = ["tests", "tests/training"]
import torch
import test_guardrails_gpu as T
from test_guardrails_faults import GradFault, UndoUpdates, trainable_state, optimizer_tensors
from sits_lora.training import NativeLoraTrainer, SitsHardwareCallback
tmp = tempfile.mkdtemp()
undo = UndoUpdates((2,))
ref = NativeLoraTrainer(model=T._model(), args=T._args(tmp + "/ref"), train_dataset=T._dataset(),
                        callbacks=[SitsHardwareCallback(report=False, nan_policy="off"), undo.callback])
ref.train()
model = T._model()
GradFault(model, "base_model.model.model.layers.3.mlp.down_proj.lora_B.default.weight", float("nan"), (2,))
cb = SitsHardwareCallback(report=False, nan_policy="skip")
run = NativeLoraTrainer(model=model, args=T._args(tmp + "/run"), train_dataset=T._dataset(), callbacks=[cb])
run.train()
for name, t in (("ref", ref), ("run", run)):
    s = t._train_step
    rec = getattr(s, "recorded", None)
    print(name, "recording on:", t.step_recording.on, "recorded:", None if rec is None else
          {k: getattr(rec, k, None) for k in ("replays", "eager_calls", "recordings")}, "nonfinite:", getattr(cb, "nonfinite_steps", None) if name == "run" else "-")
lr = run.args.learning_rate
ours, theirs = trainable_state(run.model), trainable_state(ref.model)
worst = []
for n in ours:
    d = (ours[n].float() - theirs[n].float())
    big = int((d.abs() > 0.5 * lr).sum())
    worst.append((d.abs().max().item(), n, big, d.numel(), (d.norm() / (lr * d.numel() ** 0.5)).item()))
worst.sort(reverse=True)
print("tensors with a value > lr/2 apart:", sum(1 for w in worst if w[2]), "of", len(worst))
for w in worst[:8]:
    print(f"max {w[0]:.2e} {w[1]} values>lr/2 {w[2]} of {w[3]} norm/(lr sqrt n) {w[4]:.4f}")
print("largest norm ratio", max(w[4] for w in worst))
ot = [(a.float() - b.float()).norm().item() / (b.float().norm().item() + 1e-12) for a, b in zip(optimizer_tensors(run), optimizer_tensors(ref))]
print("optimizer tensors: largest relative difference", max(ot))
