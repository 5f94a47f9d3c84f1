"""SitsLoraConfig on diffusers models (tiny random configs, CPU): a U-Net (SD1.5 / SDXL family) and the DiT
transformers of SD3 and Flux through ``add_adapter``, against PEFT's LoRA on the same model and seed: which layers
are sits_lora's, the outputs and every gradient (the PyTorch path, and the Triton kernels under the interpreter);
Conv2d targets keep PEFT's layer, with one note."""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from peft import LoraConfig  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from conftest import rel_err  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.layers.linear import SitsLoraLinear  # noqa: E402

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


def tiny_unet():
    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=8, norm_num_groups=8)


def unet_call(model, gen):
    sample = torch.randn(2, 4, 8, 8, generator=gen)
    text = torch.randn(2, 7, 24, generator=gen)                 # encoder_hidden_states: 7 text tokens
    return model(sample, torch.tensor([10, 500]), encoder_hidden_states=text).sample


def tiny_sd3():
    return diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                           attention_head_dim=8, num_attention_heads=2, joint_attention_dim=24,
                                           caption_projection_dim=16, pooled_projection_dim=12, out_channels=4,
                                           pos_embed_max_size=8)


def sd3_call(model, gen):
    return model(hidden_states=torch.randn(2, 4, 8, 8, generator=gen),
                 encoder_hidden_states=torch.randn(2, 7, 24, generator=gen),
                 pooled_projections=torch.randn(2, 12, generator=gen), timestep=torch.tensor([10, 500])).sample


def tiny_flux():
    return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=24,
                                            pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))


def flux_call(model, gen):
    tokens, text = 16, 7
    return model(hidden_states=torch.randn(2, tokens, 8, generator=gen),
                 encoder_hidden_states=torch.randn(2, text, 24, generator=gen),
                 pooled_projections=torch.randn(2, 12, generator=gen), timestep=torch.tensor([0.1, 0.7]),
                 img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3)).sample


MODELS = {
    "unet": (tiny_unet, unet_call, ATTENTION + ["proj_in", "proj_out", "ff.net.2"]),
    "sd3": (tiny_sd3, sd3_call, ATTENTION + ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]),
    "flux": (tiny_flux, flux_call, ATTENTION + ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp"]),
}


def adapted_pair(name, kernel):
    build, _, targets = MODELS[name]
    torch.manual_seed(0)
    base = build()
    ours, theirs = base, copy.deepcopy(base)
    torch.manual_seed(1)
    ours.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, kernel=kernel))
    torch.manual_seed(1)
    theirs.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    return ours, theirs


def step(model, call):
    out = call(model, torch.Generator().manual_seed(2))
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_adapted_diffusers_model_matches_peft(name, kernel):
    if kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on a CPU need TRITON_INTERPRET=1")
    ours, theirs = adapted_pair(name, kernel)
    linear_targets = [m for m in theirs.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    assert len([m for m in ours.modules() if isinstance(m, SitsLoraLinear)]) == len(linear_targets) > 0
    out, grads = step(ours, MODELS[name][1])
    ref_out, ref_grads = step(theirs, MODELS[name][1])
    assert rel_err(out, ref_out) < 1e-5
    assert set(grads) == set(ref_grads) and any("lora_A" in n for n in grads)
    for n in grads:
        assert rel_err(grads[n], ref_grads[n]) < 1e-4, n


def test_conv2d_targets_keep_peft_layers_with_one_note(caplog):
    """The U-Net's resnet convolutions (and proj_in / proj_out where a config makes them Conv2d) get PEFT's own
    LoRA layer; sits_lora says so once per layer type, naming a target."""
    torch.manual_seed(0)
    unet = tiny_unet()
    with caplog.at_level(logging.WARNING, logger="sits_lora"):
        unet.add_adapter(SitsLoraConfig(r=4, target_modules=["to_k", "conv1"]))
    convs = [m for m in unet.modules() if type(m).__name__ == "Conv2d" and hasattr(m, "lora_A")]
    assert convs and all(not isinstance(m, SitsLoraLinear) for m in convs)
    notes = [r.getMessage() for r in caplog.records if "Conv2d" in r.getMessage()]
    assert len(notes) == 1 and "PEFT's own LoRA layer" in notes[0] and "conv1'" in notes[0]


def test_siblings_group_what_reads_one_tensor():
    """Self-attention fuses to_q / to_k / to_v; cross-attention only to_k / to_v (they read the text states);
    SD3's joint attention also add_q / add_k / add_v_proj."""
    ours, _ = adapted_pair("unet", "triton")
    attentions = [m for m in ours.modules() if type(m).__name__ == "Attention"]
    for attn in attentions:
        group = attn.to_k.sibling_group
        expected = [attn.to_k, attn.to_v] if attn.is_cross_attention else [attn.to_q, attn.to_k, attn.to_v]
        assert group is not None and group.layers == expected
    assert {a.is_cross_attention for a in attentions} == {True, False}
    step(ours, MODELS["unet"][1])
    assert all(a.to_k.sibling_group.enabled for a in attentions)  # each group saw one tensor: it ran fused
    sd3, _ = adapted_pair("sd3", "triton")
    joint = [m for m in sd3.modules() if type(m).__name__ == "Attention" and hasattr(m, "add_k_proj")]
    assert joint and all(a.add_k_proj.sibling_group.layers == [a.add_q_proj, a.add_k_proj, a.add_v_proj]
                         for a in joint if a.add_q_proj is not None and hasattr(a.add_q_proj, "lora_A"))



@pytest.mark.parametrize("name", sorted(MODELS))
def test_diffusers_format_export_loads_with_diffusers_and_gives_the_same_outputs(name, tmp_path):
    """export_diffusers_lora writes the pipeline's LoRA file; diffusers' own loader (no sits_lora layers) on the
    same base model gives the adapted model's outputs, alpha included."""
    from sits_lora import export_diffusers_lora

    build, call, targets = MODELS[name]
    torch.manual_seed(0)
    ours = build()
    plain = copy.deepcopy(ours)
    ours.add_adapter(SitsLoraConfig(r=4, lora_alpha=12, target_modules=targets, init_lora_weights=False))
    export_diffusers_lora(ours, tmp_path)
    pipeline = {"unet": diffusers.StableDiffusionPipeline, "sd3": diffusers.StableDiffusion3Pipeline,
                "flux": diffusers.FluxPipeline}[name]
    loaded = pipeline.lora_state_dict(str(tmp_path), return_lora_metadata=True)   # (state, [alphas,] metadata)
    state, metadata = loaded[0], loaded[-1]
    plain.load_lora_adapter(state, prefix="unet" if name == "unet" else "transformer", metadata=metadata)
    assert not any(isinstance(m, SitsLoraLinear) for m in plain.modules())
    with torch.no_grad():
        ref, out = call(plain, torch.Generator().manual_seed(3)), call(ours, torch.Generator().manual_seed(3))
    assert rel_err(out, ref) < 1e-5


def test_diffusers_export_names_what_it_cannot_write(tmp_path):
    from sits_lora import export_diffusers_lora

    with pytest.raises(TypeError, match="a Linear is not a model this export knows"):
        export_diffusers_lora(torch.nn.Linear(2, 2), tmp_path)
    with pytest.raises(ValueError, match=r"adapter_name='default' does not exist; the model has \[\]"):
        export_diffusers_lora(tiny_unet(), tmp_path)


def test_diffusers_export_without_diffusers_says_what_to_install(tmp_path, monkeypatch):
    from sits_lora import export_diffusers_lora

    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, target_modules=["to_k"]))
    monkeypatch.setitem(sys.modules, "diffusers", None)   # as if it were not installed
    with pytest.raises(ImportError, match=r"needs diffusers: pip install 'sits-lora\[diffusion\]'"):
        export_diffusers_lora(unet, tmp_path)


def tiny_pipeline(unet):
    """A StableDiffusionPipeline around ``unet`` (no tokenizer: prompts go in as embeddings)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    vae = diffusers.AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                                  up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8)
    text_encoder = CLIPTextModel(CLIPTextConfig(hidden_size=24, intermediate_size=32, num_attention_heads=2,
                                                num_hidden_layers=1, vocab_size=64, max_position_embeddings=16))
    return diffusers.StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=None, unet=unet,
                                             scheduler=diffusers.DDIMScheduler(clip_sample=False), safety_checker=None,
                                             feature_extractor=None, requires_safety_checker=False)


def test_a_pipeline_loads_the_export_with_load_lora_weights(tmp_path):
    """The U-Net's export through StableDiffusionPipeline.load_lora_weights, as a user of diffusers loads a LoRA."""
    from sits_lora import export_diffusers_lora

    torch.manual_seed(0)
    ours = tiny_unet()
    pipe = tiny_pipeline(copy.deepcopy(ours))
    ours.add_adapter(SitsLoraConfig(r=4, lora_alpha=12, target_modules=ATTENTION, init_lora_weights=False))
    pipe.load_lora_weights(export_diffusers_lora(ours, tmp_path))
    with torch.no_grad():
        ref, out = unet_call(pipe.unet, torch.Generator().manual_seed(3)), unet_call(ours, torch.Generator().manual_seed(3))
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("watch_modules", [False, True])
def test_latent_guard_names_the_step_and_the_module(watch_modules):
    from sits_lora.diffusion import LatentGuard, NonFiniteLatentsError

    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, target_modules=ATTENTION, init_lora_weights=False))
    pipe = tiny_pipeline(unet)
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(4))
    run = dict(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text), num_inference_steps=3, height=8,
               width=8, output_type="latent")
    guard = LatentGuard(pipe, watch_modules=watch_modules)
    assert torch.isfinite(pipe(**run, callback_on_step_end=guard).images).all()   # a healthy run passes
    with torch.no_grad():
        unet.up_blocks[1].attentions[0].transformer_blocks[0].attn2.to_v.lora_B["default"].weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteLatentsError, match=r"denoising step 0 \(timestep \d+\): the latents hold NaN or Inf") as error:
        pipe(**run, callback_on_step_end=guard)
    if watch_modules:
        assert "first module whose output was not finite: up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_v" \
            in str(error.value)
    else:
        assert "LatentGuard(pipe, watch_modules=True) names the first module" in str(error.value)
    guard.detach()

