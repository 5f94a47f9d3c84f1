"""recipes/train_diffusion.py on the CPU: the tiny model end to end through main(argv), its one-line errors, its
NaN / Inf stop, Ctrl-C and --resume, and the SD1.5 / SDXL shapes on the meta device (nothing allocated)."""

from __future__ import annotations

import json
import math
import os
import re
import signal

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from conftest import REPO_ROOT, rel_err  # noqa: E402

from sits_lora.layers.linear import SitsLoraLinear  # noqa: E402

RECIPE = os.path.join(REPO_ROOT, "recipes", "train_diffusion.py")
# 2 images at 32 px (latents 4x4): a step takes ~0.05 s on a 2-core CPU, a whole run ~2 s after the first
TINY = ["--num-images", "2", "--batch-size", "2", "--resolution", "32"]


@pytest.fixture(scope="module")
def recipe():
    """The recipe's module (recipes/train_diffusion.py runs its main)."""
    import sits_lora.recipe.diffusion as module

    return module


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _unet_call(unet, gen):
    sample = torch.randn(2, 4, 4, 4, generator=gen)
    text = torch.randn(2, 16, 32, generator=gen)           # the tiny text encoder: 16 tokens of width 32
    with torch.no_grad():
        return unet(sample, torch.tensor([10, 500]), encoder_hidden_states=text).sample


@pytest.mark.parametrize("adapter", ["sits", "peft"])
def test_tiny_run_end_to_end_and_its_lora_loads_in_stock_diffusers(recipe, tmp_path, adapter):
    out = tmp_path / "run"
    assert recipe.main(["--output-dir", str(out), "--steps", "3", "--adapter", adapter, *TINY]) == 0
    metrics = _metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and m["seconds"] > 0 for m in metrics)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps_done"] == 3
    assert summary["final_loss"] == metrics[-1]["loss"] and summary["steps_per_second"] > 0
    assert summary["config"]["adapter"] == adapter and summary["trainable_parameters"] > 0
    assert summary["export_check"]["ok"] and summary["export_check"]["rel_err_vs_trained_unet"] < 1e-4
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoint-3" / "training_state.pt").is_file()

    # as a diffusers user: the saved base pipeline, then the LoRA file through load_lora_weights
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(out / "base"))
    before = _unet_call(pipe.unet, torch.Generator().manual_seed(0))
    pipe.load_lora_weights(str(out / "lora"))
    after = _unet_call(pipe.unet, torch.Generator().manual_seed(0))
    assert not any(isinstance(m, SitsLoraLinear) for m in pipe.unet.modules())   # stock PEFT layers
    attentions = [m for m in pipe.unet.modules() if type(m).__name__ == "Attention"]
    assert sum(1 for n, _ in pipe.unet.named_parameters() if "lora_B" in n) == 4 * len(attentions) == 32
    assert rel_err(after, before) > 1e-4                   # the adapter changes the output


def test_the_loss_falls_when_overfitting_two_images(recipe, tmp_path):
    """20 steps on 2 images at the tiny model's learning rate (1e-2): the loss on fixed noise and timesteps falls
    (1.107 -> 1.014 when written)."""
    out = tmp_path / "run"
    assert recipe.main(["--output-dir", str(out), "--steps", "20", *TINY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fixed_noise_loss_after"] < 0.97 * summary["fixed_noise_loss_before"]


def test_images_and_captions_follow_the_seed(recipe):
    pixels, captions = recipe.draw_shapes(12, 32, seed=3)
    again, same = recipe.draw_shapes(12, 32, seed=3)
    other, _ = recipe.draw_shapes(12, 32, seed=4)
    assert pixels.shape == (12, 3, 32, 32) and pixels.min() >= -1 and pixels.max() <= 1
    assert torch.equal(pixels, again) and captions == same and not torch.equal(pixels, other)
    assert len(set(captions)) == 12                        # every (color, shape) pair once before any twice
    assert all(c.startswith("a photo of sks ") and c.split()[-1] in recipe.SHAPES for c in captions)
    tokenizer = recipe.caption_tokenizer(16)
    ids = tokenizer("a photo of sks red circle").input_ids
    assert tokenizer.convert_ids_to_tokens(ids)[1:-1] == ["a</w>", "photo</w>", "of</w>", "sks</w>", "red</w>",
                                                          "circle</w>"]


# (arguments, what the one line must say): the flag, the value and the fix
BAD_ARGUMENTS = [
    (["--resolution", "40"], "--resolution 40 is invalid for --model tiny: it must be a multiple of 16 (the VAE "
                             "downsamples by 8, the U-Net by 2); use --resolution 32 or 48"),
    (["--model", "sd15", "--resolution", "500"], "--resolution 500 is invalid for --model sd15: it must be a multiple "
                                                 "of 64"),
    (["--rank", "0"], "--rank 0 is invalid: it must be a positive integer, e.g. --rank 4"),
    (["--steps", "-3"], "--steps -3 is invalid: it must be a positive integer"),
    (["--model", "sd3"], "--model 'sd3' is invalid: allowed values are 'tiny', 'sd15', 'sdxl'"),
    (["--adapter", "peft", "--kernel", "triton"], "--kernel triton applies to --adapter sits only"),
    (["--lr", "-1"], "--lr -1.0 is invalid: it must be a number >= 0, e.g. --lr 1e-4 (0: the model's default)"),
    (["--save-every", "-2"], "--save-every -2 is invalid: it must be a non-negative integer (0: three checkpoints"),
    (["--lora-alpha", "-1"], "--lora-alpha -1.0 is invalid: it must be a number >= 0 (0: the rank)"),
]


@pytest.mark.parametrize("args,message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_a_bad_option_stops_in_one_line_before_anything_is_built(recipe, tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert recipe.main(["--output-dir", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not out.exists()


def test_an_output_dir_that_cannot_be_written_is_refused(recipe, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert recipe.main(["--output-dir", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --output-dir {blocker / 'run'} is not writable") and "choose a folder" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("model", ["sd15", "sdxl"])
def test_the_real_shapes_are_refused_without_a_gpu(recipe, tmp_path, capsys, model):
    assert recipe.main(["--output-dir", str(tmp_path / "run"), "--model", model]) == 2
    assert f"--model {model} needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_cuda_graphs_are_refused_without_a_gpu(recipe, tmp_path, capsys):
    assert recipe.main(["--output-dir", str(tmp_path / "run"), "--cuda-graphs"]) == 2
    assert "--cuda-graphs true records CUDA graphs and needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_train_as_the_eager_loop_does(recipe, tmp_path):
    eager, graphed = tmp_path / "eager", tmp_path / "graphed"
    assert recipe.main(["--output-dir", str(eager), "--steps", "7", *TINY]) == 0
    assert recipe.main(["--output-dir", str(graphed), "--steps", "7", "--cuda-graphs", *TINY]) == 0
    # steps 1-2 eager, 3 recorded, 3-7 replayed; fused AdamW against the eager loop's foreach one
    assert [m["loss"] for m in _metrics(graphed)] == pytest.approx([m["loss"] for m in _metrics(eager)], rel=1e-3)
    summaries = [json.loads((out / "summary.json").read_text()) for out in (eager, graphed)]
    assert summaries[1]["fixed_noise_loss_after"] == pytest.approx(summaries[0]["fixed_noise_loss_after"], rel=1e-3)
    assert summaries[1]["export_check"]["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_nonfinite_gradient_in_a_replayed_step_is_skipped_on_the_gpu_and_named(recipe, tmp_path, monkeypatch,
                                                                                capsys):
    poison = torch.ones((), device="cuda")       # read by the recorded step: NaN from step 5 on
    add_lora, sample_batch = recipe.add_lora, recipe.sample_batch

    def poisoned(unet, options):
        params = add_lora(unet, options)
        params[0].register_hook(lambda grad: grad * poison)
        return params

    def batch_of(cache, step, *args):
        if step == 5:
            poison.fill_(float("nan"))
        return sample_batch(cache, step, *args)

    monkeypatch.setattr(recipe, "add_lora", poisoned)
    monkeypatch.setattr(recipe, "sample_batch", batch_of)
    out = tmp_path / "run"
    assert recipe.main(["--output-dir", str(out), "--steps", "8", "--save-every", "4", "--cuda-graphs", *TINY]) == 1
    err = capsys.readouterr().err
    assert re.search(r"error: step 5: the gradient of down_blocks\.0\.attentions\.0\.transformer_blocks\.0\.attn1\."
                     r"to_q\.lora_A\.default\.weight holds NaN or Inf; nothing was applied at that step", err), err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "nonfinite" and summary["steps_done"] == 4
    # the run saves its weights again after the failed step (as checkpoint-4): finite, so step 5's NaN update was
    # skipped on the GPU (applied, NaN gradients through clipping and AdamW make every weight NaN)
    saved = torch.load(out / "checkpoint-4" / "training_state.pt", map_location="cpu")["adapter"]
    assert all(torch.isfinite(v).all() for v in saved.values())


@pytest.mark.parametrize("how", ["signal", "exception"])
def test_an_interrupted_run_saves_and_resume_continues_where_it_stopped(recipe, tmp_path, monkeypatch, capsys, how):
    """Ctrl-C (SIGINT) during step 3 finishes that step and saves checkpoint-3; a KeyboardInterrupt raised before
    step 3's forward (a second Ctrl-C) saves checkpoint-2. --resume then gives the uninterrupted run's losses."""
    plain = tmp_path / "plain"
    assert recipe.main(["--output-dir", str(plain), "--steps", "5", *TINY]) == 0
    sample_batch = recipe.sample_batch

    def interrupted_at_step_3(cache, step, *args):
        if step == 3:
            if how == "signal":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise KeyboardInterrupt
        return sample_batch(cache, step, *args)

    out = tmp_path / "run"
    monkeypatch.setattr(recipe, "sample_batch", interrupted_at_step_3)
    assert recipe.main(["--output-dir", str(out), "--steps", "5", "--save-every", "10", *TINY]) == 130
    saved = 3 if how == "signal" else 2
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{saved}"]
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"
    assert "--resume true continues" in capsys.readouterr().err

    monkeypatch.setattr(recipe, "sample_batch", sample_batch)
    assert recipe.main(["--output-dir", str(out), "--steps", "5", "--resume", *TINY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from_step"] == saved
    resumed, reference = _metrics(out), _metrics(plain)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in reference], rel=1e-5)

    capsys.readouterr()
    assert recipe.main(["--output-dir", str(out), "--steps", "9", "--resume", "--rank", "8", *TINY]) == 2
    assert "the checkpoint was trained with --rank 4, this run asks for 8" in capsys.readouterr().err
    assert recipe.main(["--output-dir", str(out), "--steps", "9", *TINY]) == 2   # another run's folder
    assert "pass --resume true to continue it, --overwrite true to replace it" in capsys.readouterr().err


def _nan_gradient(recipe, monkeypatch):
    add_lora = recipe.add_lora

    def with_a_nan_gradient(unet, options):
        params = add_lora(unet, options)
        params[0].register_hook(lambda grad: grad * float("nan"))
        return params

    monkeypatch.setattr(recipe, "add_lora", with_a_nan_gradient)


@pytest.mark.parametrize("fault,args,message", [
    ("gradient", [], r"error: step 1: the gradient of down_blocks\.0\.attentions\.0\.transformer_blocks\.0\.attn1\."
                     r"to_q\.lora_A\.default\.weight holds NaN or Inf; nothing was applied at that step"),
    ("loss", ["--lr", "1e30"], r"error: step 2: the loss is nan; nothing was applied at that step\. Fix: lower --lr "
                               r"\(now 1e\+30\) and continue with --resume true from .*checkpoint-1"),
])
def test_a_nonfinite_loss_or_gradient_stops_the_run_naming_the_step(recipe, tmp_path, monkeypatch, capsys, fault, args,
                                                                    message):
    if fault == "gradient":
        _nan_gradient(recipe, monkeypatch)
    out = tmp_path / "run"
    assert recipe.main(["--output-dir", str(out), "--steps", "4", *TINY, *args]) == 1
    err = capsys.readouterr().err
    assert any(re.match(message, line) for line in err.splitlines()), err
    assert json.loads((out / "summary.json").read_text())["status"] == "nonfinite"


@pytest.mark.parametrize("model,parameters,lora_parameters", [("sd15", 859_520_964, 797_184),
                                                              ("sdxl", 2_567_463_684, 5_806_080)])
def test_sd15_and_sdxl_u_nets_have_the_real_shapes(recipe, model, parameters, lora_parameters):
    """On the meta device (shapes only, no memory): the U-Net's parameter count is the released model's, and a
    forward with the text encoders' states (SDXL: and the pooled text and time ids) gives the latents' shape."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    options = recipe.DiffusionRecipe(model=model)
    tokenizer = recipe.caption_tokenizer(recipe.TEXT_TOKENS[model])
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**recipe.unet_config(model, options.size))
        encoders = [(CLIPTextModelWithProjection if i else CLIPTextModel)(CLIPTextConfig(**kwargs))
                    for i, kwargs in enumerate(recipe.text_configs(model, len(tokenizer)))]
    assert sum(p.numel() for p in unet.parameters()) == parameters
    assert sum(p.numel() for p in recipe.add_lora(unet, options)) == lora_parameters
    assert any(isinstance(m, SitsLoraLinear) for m in unet.modules())
    text, pooled = recipe.encode_captions(recipe.Components(unet, None, tokenizer, encoders), ["a photo of sks"] * 2)
    assert text.shape == (2, 77, 768 if model == "sd15" else 2048)
    assert (pooled is None) == (model == "sd15") and (pooled is None or pooled.shape == (2, 1280))
    side = options.size // 8
    noisy = torch.empty(2, 4, side, side, device="meta")
    out = recipe.predict_noise(unet, noisy, torch.zeros(2, dtype=torch.long, device="meta"), text, pooled, options.size)
    assert out.shape == noisy.shape
