"""sits_lora's step in TRL's trainers (``native_step(SFTTrainer)``, ``native_step(DPOTrainer)``) against TRL's own:
on the CPU in fp32 on the PyTorch path, the losses, gradient norms and every metric TRL logs are bit-equal over 20
steps (DPO's logits/chosen and logits/rejected to 1e-6: TRL sums the compacted chosen tokens, here the masked
ones), for fixed-length, padded and packed SFT batches and for DPO's losses; the decision line for each trainer and
each configuration that cannot record; gradient checkpointing's plan; a user's callback still called. On a GPU:
the recorded SFT and DPO steps against the eager ones."""

from __future__ import annotations

import math
import types

import pytest
import torch
from conftest import tiny_llama

trl = pytest.importorskip("trl", reason="TRL's trainers are what these tests run")

from sits_lora import SitsLoraConfig, native_step  # noqa: E402
from sits_lora.training.recording import plan_without_checkpointing  # noqa: E402

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]
SFT_METRICS = ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens")
DPO_METRICS = ("loss", "grad_norm", "entropy", "num_tokens", "mean_token_accuracy", "rewards/chosen",
               "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture
def torch_path(monkeypatch):
    """The PyTorch path of the fused loss (the interpreter off), the path a CPU user runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the special tokens' names are no word's prefix: an added token is matched inside words ("t1" in "t15")
    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, 97)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", unk_token="<pad>")


def _sft_data(lengths, seed=0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"input_ids": [torch.randint(2, 97, (n,), generator=gen).tolist() for n in lengths]})


def _dpo_data(shapes, seed=0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)

    def words(n):
        return " ".join(f"t{i}" for i in torch.randint(2, 97, (n,), generator=gen).tolist())

    return Dataset.from_dict({"prompt": [words(p) for p, _, _ in shapes],
                              "chosen": [" " + words(c) for _, c, _ in shapes],
                              "rejected": [" " + words(r) for _, _, r in shapes]})


def _train(cls, config_cls, data, tmp_path, steps=20, callbacks=None, record_step=None, **config):
    kwargs = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
                  report_to="none", logging_steps=1, use_cpu=True, bf16=False, save_strategy="no",
                  gradient_checkpointing=False, seed=0, disable_tqdm=True)
    kwargs.update(config)
    extra = {} if record_step is None else {"record_step": record_step}
    trainer = cls(model=tiny_llama(), args=config_cls(**kwargs), train_dataset=data, processing_class=_tokenizer(),
                  peft_config=SitsLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), callbacks=callbacks,
                  **extra)
    trainer.train()
    return trainer, [e for e in trainer.state.log_history if "loss" in e]


def _assert_logged_equal(theirs, ours, exact, close=()):
    assert len(theirs) == len(ours) > 0
    for step, (a, b) in enumerate(zip(theirs, ours), 1):
        for key in exact:
            assert a[key] == b[key], (step, key, a[key], b[key])
        for key in close:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (step, key, a[key], b[key])


@pytest.mark.parametrize("lengths", [[24] * 16, [5, 23, 11, 17, 8, 24, 3, 19] * 2], ids=["fixed", "padded"])
def test_sft_losses_and_metrics_are_trl_s_bit_for_bit(lengths, tmp_path, torch_path):
    data = _sft_data(lengths)
    _, theirs = _train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path / "trl")
    trainer, ours = _train(native_step(trl.SFTTrainer), trl.SFTConfig, data, tmp_path / "ours")
    assert trainer._objective is not None and "TRL SFTTrainer's loss" in trainer.step_recording.reason
    _assert_logged_equal(theirs, ours, SFT_METRICS)
    assert theirs[-1]["loss"] < theirs[0]["loss"]     # it trained


def test_sft_packed_batches_are_trl_s_bit_for_bit(tmp_path, torch_path):
    data = _sft_data([5, 23, 11, 17, 8, 24, 3, 19, 9, 14, 21, 6] * 2)
    packed = dict(packing=True, max_length=32)
    _, theirs = _train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path / "trl", steps=6, **packed)
    trainer, ours = _train(native_step(trl.SFTTrainer), trl.SFTConfig, data, tmp_path / "ours", steps=6, **packed)
    assert trainer._objective is not None
    assert "position_ids" in trainer.step_recording.reason   # packed: each batch's shape and mask vary
    _assert_logged_equal(theirs, ours, SFT_METRICS)


def test_packed_batches_padded_to_a_fixed_budget_train_as_trl_s(tmp_path, torch_path, monkeypatch):
    """The budget path a GPU records (here eagerly, with the block-diagonal reference attention): every batch one
    shape, the same losses and metrics as TRL's own packed step to float rounding (the loss sums over the padded
    budget), the model's attention put back after train()."""
    import sits_lora.training.native as native
    from sits_lora.training.packing import ATTENTION, FixedTokenBudget

    data = _sft_data([5, 23, 11, 17, 8, 24, 3, 19, 9, 14, 21, 6] * 2)
    packed = dict(packing=True, max_length=32)
    _, theirs = _train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path / "trl", steps=6, **packed)
    monkeypatch.setattr(native, "_budget_blocker", lambda device, head_dim: "")
    shapes = []
    real_step = native.NativeStepMixin.compute_loss

    def watch(self, model, inputs, *args, **kwargs):
        shapes.append((tuple(inputs["input_ids"].shape), tuple(inputs["cu_seq_lens_q"].shape)))
        assert causal_lm_attention(model) == ATTENTION
        return real_step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(native.NativeStepMixin, "compute_loss", watch)
    trainer, ours = _train(native_step(trl.SFTTrainer), trl.SFTConfig, data, tmp_path / "ours", steps=6, **packed)
    assert isinstance(trainer._packing, type(None)) and causal_lm_attention(trainer.model) == "sdpa"
    line = trainer.step_recording.reason
    assert line.startswith("off: the model is not on a CUDA GPU") and "packed" not in line   # packing blocks nothing
    # 4 rows of at most 32 tokens, at most 4 documents a row (and one pad sequence): one shape for every batch
    assert set(shapes) == {((1, 128), (4 * (4 + 1) + 1,))}, shapes
    _assert_logged_equal(theirs, ours, ("num_tokens", "learning_rate"),
                         close=("loss", "grad_norm", "entropy", "mean_token_accuracy"))
    budget = FixedTokenBudget(lambda examples: examples[0], budget=16, max_length=8, capacity=6, pad_token_id=0)
    batch = budget([{"input_ids": torch.arange(1, 6)[None], "labels": torch.arange(1, 6)[None],
                     "position_ids": torch.tensor([[0, 1, 2, 0, 1]]), "cu_seq_lens_q": torch.tensor([0, 3, 5])}])
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 13, 16, 16, 16]      # pads: 8 + 3 tokens, then empty
    assert batch["position_ids"][0, 5:].tolist() == list(range(8)) + [0, 1, 2]
    assert batch["labels"][0, 5:].eq(-100).all() and batch["packed_tokens"].item() == 5
    with pytest.raises(ValueError, match="over the capacity of 2"):
        FixedTokenBudget(lambda examples: examples[0], 16, 8, 2, 0)(
            [{"input_ids": torch.arange(1, 6)[None], "labels": torch.arange(1, 6)[None],
              "position_ids": torch.tensor([[0, 1, 2, 0, 1]]), "cu_seq_lens_q": torch.tensor([0, 3, 5])}])


def causal_lm_attention(model):
    from sits_lora.training.step import causal_lm

    return causal_lm(model).config._attn_implementation


@pytest.mark.parametrize("loss_type, config", [
    ("sigmoid", {}), ("ipo", {}), ("hinge", {"beta": 0.5}), ("robust", {"label_smoothing": 0.1}),
    ("sigmoid", {"precompute_ref_log_probs": True}), (["sigmoid", "bco_pair"], {"loss_weights": [1.0, 0.5]}),
], ids=["sigmoid", "ipo", "hinge", "robust", "precomputed-reference", "sigmoid+bco_pair"])
def test_dpo_losses_and_metrics_are_trl_s(loss_type, config, tmp_path, torch_path):
    data = _dpo_data([(8, 11, 11)] * 8 + [(3, 9, 5), (6, 2, 11), (9, 7, 7), (4, 11, 3)] * 2)
    settings = dict(loss_type=loss_type, **config)
    _, theirs = _train(trl.DPOTrainer, trl.DPOConfig, data, tmp_path / "trl", steps=6, **settings)
    trainer, ours = _train(native_step(trl.DPOTrainer), trl.DPOConfig, data, tmp_path / "ours", steps=6,
                           **settings)
    assert trainer._objective is not None and "TRL DPOTrainer's loss" in trainer.step_recording.reason
    _assert_logged_equal(theirs, ours, DPO_METRICS, close=("logits/chosen", "logits/rejected"))
    assert any(e["rewards/margins"] != 0 for e in ours)


def test_a_dpo_setting_not_computed_here_keeps_trl_s_loss_and_says_why(tmp_path, torch_path):
    data = _dpo_data([(8, 11, 11)] * 8)
    _, theirs = _train(trl.DPOTrainer, trl.DPOConfig, data, tmp_path / "trl", steps=2, loss_type="aot")
    trainer, ours = _train(native_step(trl.DPOTrainer), trl.DPOConfig, data, tmp_path / "ours", steps=2,
                           loss_type="aot")
    assert trainer._objective is None
    line = trainer.step_recording.reason
    assert "loss: the trainer's own (the fused one does not apply: loss_type 'aot'" in line
    assert "TRL's own compute_loss reads its metrics on the host at every step" in line
    _assert_logged_equal(theirs, ours, DPO_METRICS, close=("logits/chosen", "logits/rejected"))


def test_the_line_names_each_setting_that_cannot_record(tmp_path, caplog):
    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            pass

    data = _sft_data([16] * 8)
    with caplog.at_level("WARNING", logger="sits_lora"):
        trainer, _ = _train(native_step(trl.SFTTrainer), trl.SFTConfig, data, tmp_path, steps=1,
                            gradient_accumulation_steps=2, gradient_checkpointing=True, callbacks=[Snapshot()])
    line = trainer.step_recording.reason
    assert caplog.text.count("sits_lora: step recording off:") == 1 and line in caplog.text
    for expected in ("the model is not on a CUDA GPU", "gradient_accumulation_steps=2",
                     "gradient checkpointing (its recomputation is not recorded; it stays on: the model is not on a "
                     "CUDA GPU", "callback Snapshot.on_optimizer_step", "loss: TRL SFTTrainer's loss"):
        assert expected in line, expected
    with pytest.raises(ValueError, match=r"NativeSFTTrainer\(record_step=True\): the step cannot be recorded: the "
                                         r"model is not on a CUDA GPU"):
        _train(native_step(trl.SFTTrainer), trl.SFTConfig, data, tmp_path, steps=1, record_step=True)


def test_a_user_callback_is_still_called(tmp_path, torch_path):
    from transformers import TrainerCallback

    class Count(TrainerCallback):
        def __init__(self):
            self.events = {"on_step_begin": 0, "on_step_end": 0, "on_log": 0}

        def on_step_begin(self, args, state, control, **kwargs):
            self.events["on_step_begin"] += 1

        def on_step_end(self, args, state, control, **kwargs):
            self.events["on_step_end"] += 1

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.events["on_log"] += 1

    count = Count()
    _train(native_step(trl.SFTTrainer), trl.SFTConfig, _sft_data([16] * 8), tmp_path, steps=2, callbacks=[count])
    assert count.events == {"on_step_begin": 2, "on_step_end": 2, "on_log": 3}   # 2 steps and the summary


def test_native_step_of_a_class_and_of_a_built_trainer(tmp_path, torch_path):
    assert native_step(trl.SFTTrainer) is native_step(trl.SFTTrainer)
    assert native_step(trl.SFTTrainer).__name__ == "NativeSFTTrainer"
    assert issubclass(native_step(trl.SFTTrainer), trl.SFTTrainer)
    with pytest.raises(TypeError, match="not a transformers.Trainer subclass"):
        native_step(dict)
    with pytest.raises(TypeError, match="got str; pass a transformers.Trainer class or instance"):
        native_step("SFTTrainer")
    data = _sft_data([16] * 8)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none",
                         use_cpu=True, save_strategy="no", gradient_checkpointing=False, disable_tqdm=True)
    built = trl.SFTTrainer(model=tiny_llama(), args=args, train_dataset=data, processing_class=_tokenizer(),
                           peft_config=SitsLoraConfig(r=4, target_modules=TARGETS))
    with pytest.raises(ValueError, match=r"native_step\(record_step='always'\) is invalid"):
        native_step(built, record_step="always")
    assert native_step(built) is built and type(built).__name__ == "NativeSFTTrainer"
    built.train()
    assert built._objective is not None and built.sits_callback() is not None
    with pytest.raises(ValueError, match="has trained already"):
        _trained_plain(built)


def _trained_plain(native):
    """A plain trainer that trained: native_step refuses it."""
    plain = object.__new__(trl.SFTTrainer)
    plain.state = types.SimpleNamespace(global_step=native.state.global_step)
    return native_step(plain)


def test_checkpointing_is_switched_off_only_where_the_plan_fits():
    from peft import get_peft_model

    model = get_peft_model(tiny_llama(), SitsLoraConfig(r=4, target_modules=TARGETS))
    args = types.SimpleNamespace(gradient_checkpointing=False, bf16=False, fp16=False)
    batch = {"input_ids": torch.zeros(4, 32, dtype=torch.long), "attention_mask": torch.ones(4, 32)}
    assert not plan_without_checkpointing(model, args, batch).on
    model.gradient_checkpointing_enable()
    fits = plan_without_checkpointing(model, args, batch, available_bytes=2**30)
    assert fits.on and fits.swap and "planned at 0.0 GiB of 0.8 GiB available" in fits.detail
    tight = plan_without_checkpointing(model, args, batch, available_bytes=2**14)
    assert tight.on and not tight.swap and "over" in tight.detail and "85% of the GPU memory available" in tight.detail
    no_ids = plan_without_checkpointing(model, args, {"inputs_embeds": torch.zeros(4, 32, 48)}, available_bytes=2**30)
    assert no_ids.on and not no_ids.swap and "no 2-d input_ids" in no_ids.detail


def test_dpo_example_lengths_count_the_longer_completion():
    from sits_lora.training.recording import example_lengths

    pairs = [{"prompt_ids": [1] * 5, "chosen_ids": [2] * 3, "rejected_ids": [3] * 7}]
    assert example_lengths(pairs) == [12]
    assert example_lengths([{"text": "no ids"}]) is None


# ----------------------------------------------------------------------------- on a GPU

def _gpu_train(cls, config_cls, data, tmp_path, record_step, steps=8, **config):
    # heads of 16 (48 / 4 = 12 in the CPU tests' model): the varlen flash kernel takes multiples of 8
    kwargs = dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
                  report_to="none", logging_steps=1, bf16=True, save_strategy="no", seed=0, disable_tqdm=True,
                  max_grad_norm=1.0)
    kwargs.update(config)
    model = tiny_llama(dtype=torch.bfloat16, hidden_size=64).cuda()
    trainer = native_step(cls)(model=model, args=config_cls(**kwargs), train_dataset=data,
                               processing_class=_tokenizer(), record_step=record_step,
                               peft_config=SitsLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    trainer.train()
    return trainer, [e for e in trainer.state.log_history if "loss" in e]


def _assert_close_logs(eager, recorded, keys, rel=2e-2):
    for a, b in zip(eager, recorded):
        for key in keys:
            assert math.isfinite(b[key]) and b[key] == pytest.approx(a[key], rel=rel, abs=2e-2), (key, a[key], b[key])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recorded_sft_step_equals_the_eager_one(tmp_path):
    data = _sft_data([32] * 64)
    eager, eager_logs = _gpu_train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path / "eager", False,
                                   gradient_checkpointing=False)
    recorded, logs = _gpu_train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path / "recorded", "auto")
    line = recorded.step_recording.reason
    assert recorded.step_recording.on, line
    assert "gradient checkpointing off for this run" in line   # TRL's default, switched off by the plan
    assert recorded.model.is_gradient_checkpointing            # and back on once train() returned
    assert recorded._train_step.recorded.replays == 8 - 2   # the recording call replays too
    _assert_close_logs(eager_logs, logs, ("loss", "grad_norm", "entropy", "mean_token_accuracy"))
    assert [e["num_tokens"] for e in logs] == [e["num_tokens"] for e in eager_logs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recorded_dpo_step_equals_the_eager_one(tmp_path):
    data = _dpo_data([(8, 11, 11)] * 64)
    _, eager_logs = _gpu_train(trl.DPOTrainer, trl.DPOConfig, data, tmp_path / "eager", False,
                               gradient_checkpointing=False)
    recorded, logs = _gpu_train(trl.DPOTrainer, trl.DPOConfig, data, tmp_path / "recorded", "auto",
                                gradient_checkpointing=False)
    assert recorded.step_recording.on, recorded.step_recording.reason
    assert recorded._train_step.recorded.replays == 8 - 2   # the recording call replays too
    _assert_close_logs(eager_logs, logs, ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen",
                                          "logps/rejected", "entropy"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_recorded_packed_sft_step_equals_the_eager_one(tmp_path):
    """Packed batches: recorded at a fixed budget through the varlen kernel, against eager steps on TRL's own
    packed batches (record_step=False: transformers' sdpa with the packed mask)."""
    gen = torch.Generator().manual_seed(1)
    data = _sft_data(torch.randint(3, 33, (256,), generator=gen).tolist())
    packed = dict(packing=True, max_length=32, gradient_checkpointing=False)
    _, eager_logs = _gpu_train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path / "eager", False, **packed)
    recorded, logs = _gpu_train(trl.SFTTrainer, trl.SFTConfig, data, tmp_path / "recorded", "auto", **packed)
    line = recorded.step_recording.reason
    if "varlen" in line and not recorded.step_recording.on:
        pytest.skip(line)      # this PyTorch has no varlen kernel: the line says so, and the steps ran eagerly
    assert recorded.step_recording.on and "packed into 128 tokens a batch" in line, line
    assert recorded._train_step.recorded.replays == 8 - 2   # the recording call replays too
    _assert_close_logs(eager_logs, logs, ("loss", "grad_norm", "entropy", "mean_token_accuracy"))
    assert [e["num_tokens"] for e in logs] == [e["num_tokens"] for e in eager_logs]
