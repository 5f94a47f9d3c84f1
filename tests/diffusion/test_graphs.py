"""CUDA graphs over the denoiser (sits_lora.diffusion.graph_denoiser): refusals and argument handling on the CPU;
on a GPU, a recorded generation equals the eager one, and what changes a call's work records it again."""

from __future__ import annotations

import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_diffusers_models import ATTENTION, tiny_pipeline, tiny_unet  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.diffusion import graph_denoiser  # noqa: E402
from sits_lora.utils.cuda_graphs import NotGraphable, copy_output  # noqa: E402


def test_a_cpu_denoiser_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"parameters on cpu; move it to a GPU first \(pipe.to\('cuda'\)\)"):
        graph_denoiser(tiny_unet())
    with pytest.raises(TypeError, match="needs a pipeline with a .unet or .transformer"):
        graph_denoiser(object())


def test_outputs_are_copied_in_their_own_types():
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    sample = torch.randn(2, 4)
    for out in (sample, (sample,), UNet2DConditionOutput(sample=sample)):
        copied = copy_output(out)
        assert type(copied) is type(out)
        tensor = copied if isinstance(copied, torch.Tensor) else copied[0]
        assert torch.equal(tensor, sample) and tensor.data_ptr() != sample.data_ptr()
    with pytest.raises(NotGraphable, match="an output of type set"):
        copy_output({1})


def _generate(pipe, text, steps=4):
    return pipe(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text), num_inference_steps=steps,
                height=16, width=16, output_type="latent", generator=torch.Generator("cuda").manual_seed(5)).images


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("adapter", ["sits", "none"])
def test_a_recorded_generation_equals_the_eager_one(adapter):
    torch.manual_seed(0)
    unet = tiny_unet()
    if adapter == "sits":
        unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    pipe = tiny_pipeline(unet.eval()).to("cuda", torch.bfloat16)
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    eager = _generate(pipe, text)
    graphs = graph_denoiser(pipe)
    recorded = _generate(pipe, text)
    assert graphs.recordings == 1 and graphs.replays == 4
    # sits_lora's cross-attention groups: steps 2-4 replay the recording that reads the K / V of step 1
    assert graphs.kept_replays == (3 if adapter == "sits" else 0)
    torch.testing.assert_close(recorded, eager, rtol=0, atol=0)
    other = text * 2   # a new prompt: the recorded step reads it (K / V are computed in the step)
    torch.testing.assert_close(_generate(pipe, other), (graphs.release(), _generate(pipe, other))[1], rtol=0, atol=0)
    assert pipe.unet.forward.__self__ is pipe.unet   # released: the module's own forward again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_denoiser_in_training_mode_runs_eagerly_and_says_so(caplog):
    torch.manual_seed(0)
    pipe = tiny_pipeline(tiny_unet().train()).to("cuda", torch.bfloat16)
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    graphs = graph_denoiser(pipe)
    with caplog.at_level("WARNING", logger="sits_lora"):
        _generate(pipe, text)
    assert graphs.recordings == 0 and graphs.replays == 0
    assert sum("training mode (call .eval()" in r.getMessage() for r in caplog.records) == 1
    graphs.release()


def _sits_pipeline():
    """(U-Net with a sits_lora adapter on its attention, its pipeline in bf16 on the GPU, text states)."""
    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    pipe = tiny_pipeline(unet.eval()).to("cuda", torch.bfloat16)
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    return unet, pipe, text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_what_changes_the_work_records_again_and_in_place_writes_are_seen():
    unet, pipe, text = _sits_pipeline()
    graphs = graph_denoiser(pipe)
    first = _generate(pipe, text)
    layer = next(m for m in unet.modules() if hasattr(m, "lora_B"))
    with torch.no_grad():
        layer.lora_B["default"].weight.mul_(5)   # in place: the recording reads it
    changed = _generate(pipe, text)
    assert graphs.recordings == 1 and not torch.equal(first, changed)
    layer.scale_layer(0.5)                       # a Python-side scale: recorded again
    _generate(pipe, text)
    assert graphs.recordings == 2
    graphs.release()
    eager = _generate(pipe, text)
    graphs = graph_denoiser(pipe)
    torch.testing.assert_close(_generate(pipe, text), eager, rtol=0, atol=0)
    graphs.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kept_k_v_are_read_only_while_the_text_states_and_weights_are_unchanged():
    unet, pipe, text = _sits_pipeline()
    graphs = graph_denoiser(pipe)
    _generate(pipe, text)
    assert graphs.kept_replays == 3
    # the pipeline concatenates the prompts into a new tensor each generation: step 1 computes K / V again
    _generate(pipe, text)
    assert graphs.kept_replays == 6 and graphs.replays == 8
    layer = next(m for m in unet.modules() if getattr(m, "is_cross_attention", False)).to_k
    with torch.no_grad():
        layer.lora_B["default"].weight.mul_(3)       # in place, between two calls with the same text states
    with torch.no_grad():
        states = torch.cat([torch.zeros_like(text), text])
        sample = torch.randn(2, 4, 16, 16, device="cuda", dtype=torch.bfloat16)
        t = torch.tensor(10, device="cuda")
        first = pipe.unet(sample, t, encoder_hidden_states=states).sample
        layer.lora_B["default"].weight.mul_(2)
        second = pipe.unet(sample, t, encoder_hidden_states=states).sample      # must see the new weight
        states.mul_(0.5)
        third = pipe.unet(sample, t, encoder_hidden_states=states).sample       # must see the new states
        kept = graphs.kept_replays
        fourth = pipe.unet(sample, t, encoder_hidden_states=states).sample      # nothing changed: reads kept K / V
        assert graphs.kept_replays == kept + 1
        graphs.release()
        eager_second = pipe.unet(sample, t, encoder_hidden_states=torch.cat([torch.zeros_like(text), text])).sample
        eager_third = pipe.unet(sample, t, encoder_hidden_states=states).sample
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, eager_second, rtol=0, atol=0)
    torch.testing.assert_close(third, eager_third, rtol=0, atol=0)
    torch.testing.assert_close(fourth, third, rtol=0, atol=0)
