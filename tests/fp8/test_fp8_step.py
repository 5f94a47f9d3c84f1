"""The fp8 base's delayed scaling advanced by the training step itself (sits_lora.training.TrainStep), so that a
recorded step (CUDA graphs) advances it at every replay: on the CPU the eager step against update_scaling after a
hand-written step; on a GPU the recorded step against the eager one, and a refused recording."""

from __future__ import annotations

import copy
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_fp8 import fp8_model  # noqa: E402

from sits_lora.fp8 import fp8_scaling_state, update_scaling  # noqa: E402
from sits_lora.training import default_train_step  # noqa: E402
from sits_lora.training.graphs import GraphCaptureError  # noqa: E402
from sits_lora.training.step import TrainStep  # noqa: E402

STATE_BUFFERS = ("amax_history", "amax", "scale", "scale_inv", "position", "started", "saturated_steps",
                 "nonfinite_steps")


def _model_loss(model, inputs, num_items_in_batch=None):
    return model(**inputs).loss


def _batches(steps: int, device="cpu", seq: int = 16):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 97, (2, seq), generator=gen).to(device) for _ in range(steps)]


def _assert_same_state(a, b, exact: bool = True):
    assert (a.steps, a.delayed) == (b.steps, b.delayed)
    for name in STATE_BUFFERS:
        x, y = getattr(a, name), getattr(b, name)
        if exact or not x.is_floating_point():
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=2e-2, atol=0, msg=name)


def test_the_step_advances_the_scaling_as_update_scaling_after_a_hand_written_step_does():
    ours = fp8_model(fp8_layers="all", fp8_amax_history_len=3).train()
    theirs = copy.deepcopy(ours)
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    step = TrainStep(ours, torch.optim.AdamW(params(ours), lr=1e-3), nan_policy="off", loss=_model_loss,
                     record=False)
    optimizer = torch.optim.AdamW(params(theirs), lr=1e-3)
    state, reference = fp8_scaling_state(ours), fp8_scaling_state(theirs)
    for i, ids in enumerate(_batches(5)):
        loss = step.run({"input_ids": ids, "labels": ids}).loss
        assert state.steps == i + 1 and state.delayed
        update_scaling(ours)            # what SitsHardwareCallback does after each step: nothing left to do
        expected = theirs(input_ids=ids, labels=ids).loss
        expected.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_scaling(theirs)
        assert torch.equal(loss, expected.detach())
        _assert_same_state(state, reference)
    assert int(state.position) == 5 % 3 and (state.amax_history[..., 0] > 0).all()   # every input recorded
    # with no step in between, update_scaling advances the state again
    update_scaling(ours)
    assert state.steps == 6


def test_the_device_part_of_the_update_leaves_python_state_alone():
    # a recording runs it once in Python; whatever it changed there would stay changed when the recording fails
    state = fp8_scaling_state(fp8_model(fp8_layers="all"))
    state.amax.fill_(2.0)
    before = (state.steps, state.delayed, state._advanced_in_step)
    state.sits_advance_in_step()
    assert (state.steps, state.delayed, state._advanced_in_step) == before
    assert int(state.position) == 1 and bool(state.started) and state.amax.abs().sum() == 0
    torch.testing.assert_close(state.scale, torch.full_like(state.scale, 1.0) * state.fp8_max / 2.0)


def test_a_checkpoint_keeps_the_ring_buffer_position():
    state = fp8_scaling_state(fp8_model(fp8_layers="all", fp8_amax_history_len=4))
    for value in (1.0, 3.0, 2.0):
        state.amax.fill_(value)
        state.update()
    saved = state.sits_checkpoint_state()
    other = fp8_scaling_state(fp8_model(fp8_layers="all", fp8_amax_history_len=4))
    other.sits_load_checkpoint_state(saved)
    _assert_same_state(state, other)
    assert saved["position"] == 3


# ----------------------------------------------------------------------------- on a GPU


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = [pytest.mark.gpu, pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU of compute capability >= 8.9")]


def _gpu_fp8_model():
    return fp8_model(fp8_layers="all", fp8_emulate=False).to("cuda", torch.bfloat16).train()




@needs_fp8[0]
@needs_fp8[1]
def test_the_recorded_fp8_step_advances_its_scales_at_each_replay_and_equals_the_eager_step():
    eager_model = _gpu_fp8_model()
    recorded_model = copy.deepcopy(eager_model)
    steps, losses = {}, {"eager": [], "recorded": []}
    for name, model in (("eager", eager_model), ("recorded", recorded_model)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        steps[name] = default_train_step(model, optimizer, max_grad_norm=1.0, record=name == "recorded")
    history = {"eager": [], "recorded": []}
    for ids in _batches(7, "cuda"):
        for name, step in steps.items():
            losses[name].append(step(input_ids=ids, labels=ids).float().item())
            history[name].append(fp8_scaling_state(step.model).scale.clone())
    recorded = steps["recorded"].recorded
    assert (recorded.eager_calls, recorded.recordings, recorded.replays) == (2, 1, 5)
    state, reference = fp8_scaling_state(recorded_model), fp8_scaling_state(eager_model)
    assert state.steps == reference.steps == 7 and int(state.position) == 7 % state.history_len
    # each replay moved the scales as the eager step did (a replay that did not advance them would keep step 3's)
    for got, want in zip(history["recorded"], history["eager"]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
    assert any(not torch.equal(history["recorded"][2], later) for later in history["recorded"][3:])
    _assert_same_state(state, reference, exact=False)
    assert losses["recorded"] == pytest.approx(losses["eager"], rel=2e-2)


@needs_fp8[0]
@needs_fp8[1]
def test_a_refused_fp8_recording_leaves_the_scaling_state_and_the_rng_usable():
    model = _gpu_fp8_model()
    calls = [0]

    def waits_at_the_third_call(model, inputs, num_items_in_batch=None):
        calls[0] += 1
        loss = model(**inputs).loss
        if calls[0] == 3:
            loss.sum().item()      # a host sync: the recording fails
        return loss

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    step = TrainStep(model, optimizer, max_grad_norm=1.0, loss=waits_at_the_third_call, record=True)
    batches = _batches(4, "cuda")
    for ids in batches[:2]:
        step(input_ids=ids, labels=ids)
    state = fp8_scaling_state(model)
    # a snapshot of what the state holds (a deep copy would try to copy its pending CUDA event)
    before = types.SimpleNamespace(steps=state.steps, delayed=state.delayed,
                                   **{name: getattr(state, name).clone() for name in STATE_BUFFERS})
    with pytest.raises(GraphCaptureError):
        step(input_ids=batches[2], labels=batches[2])
    _assert_same_state(state, before)
    torch.randn(8, device="cuda")                  # the generator left capture mode
    eager = TrainStep(model, optimizer, max_grad_norm=1.0, loss=_model_loss, record=False)
    loss = eager(input_ids=batches[3], labels=batches[3])
    assert torch.isfinite(loss).item() and state.steps == before.steps + 1
    assert int(state.position) == (int(before.position) + 1) % state.history_len
