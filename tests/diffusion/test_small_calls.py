"""Small calls on the ATen path inside diffusers models: a U-Net's LoRA layers are too small for the fused kernels'
launches to pay, so kernel="auto" runs them as ATen matmuls (sits_lora.ops.aten). Here "auto" is made to resolve as
on a GPU (ops.resolve_kernel answers "triton"), so the CPU takes the GPU's choice: outputs and gradients equal
PEFT's, no fused op runs, and the cross-attention K / V are still kept across denoising steps."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_diffusers_models import ATTENTION, MODELS, adapted_pair, step, tiny_pipeline, tiny_unet  # noqa: E402

from conftest import rel_err  # noqa: E402
from sits_lora import SitsLoraConfig, ops  # noqa: E402
from sits_lora.diffusion import reuse_cross_attention_kv  # noqa: E402

# these tests count the sibling-group / ATen paths at sizes the decode path would take (tests/ops/test_decode.py)
pytestmark = pytest.mark.usefixtures("no_decode_kernel")


@pytest.fixture
def gpu_choice(monkeypatch):
    """"auto" resolves as on a GPU; counts the calls of each path."""
    calls = {"aten": 0, "fused": 0}
    real_aten = ops.lora_linear_aten

    def aten(*args, **kwargs):
        calls["aten"] += 1
        return real_aten(*args, **kwargs)

    def fused(*args, **kwargs):
        calls["fused"] += 1
        raise AssertionError("a small call reached the fused kernels")

    monkeypatch.setattr(ops, "resolve_kernel", lambda requested, x, out_features=0, dtype=None: "triton")
    monkeypatch.setattr(ops, "lora_linear_aten", aten)
    monkeypatch.setattr("sits_lora.ops.linear.lora_linear_aten", aten)
    monkeypatch.setattr(ops, "lora_siblings_triton", fused)
    monkeypatch.setattr("sits_lora.ops.linear.lora_linear_triton", fused)
    return calls


@pytest.mark.parametrize("name", sorted(MODELS))
def test_small_calls_train_like_peft_without_the_fused_kernels(name, gpu_choice):
    ours, theirs = adapted_pair(name, "auto")
    out, grads = step(ours, MODELS[name][1])
    ref_out, ref_grads = step(theirs, MODELS[name][1])
    assert gpu_choice["aten"] > 0 and gpu_choice["fused"] == 0
    assert rel_err(out, ref_out) < 1e-5
    assert set(grads) == set(ref_grads) and any("lora_B" in n for n in grads)
    for n in grads:
        assert rel_err(grads[n], ref_grads[n]) < 1e-4, n


def test_small_cross_attention_calls_are_still_kept_across_denoising_steps(gpu_choice):
    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    pipe, fresh = tiny_pipeline(unet), tiny_pipeline(copy.deepcopy(unet))
    reuse_cross_attention_kv(fresh.unet, False)
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(4))

    def generate(p):
        gpu_choice["aten"] = 0
        latents = p(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text), num_inference_steps=4,
                    height=8, width=8, output_type="latent", generator=torch.Generator().manual_seed(5)).images
        return latents, gpu_choice["aten"]

    kept, kept_calls = generate(pipe)
    every_step, all_calls = generate(fresh)
    assert torch.equal(kept, every_step)
    cross_kv = 2 * sum(getattr(m, "is_cross_attention", False) is True for m in unet.modules())
    assert all_calls - kept_calls == cross_kv * 3   # to_k / to_v of cross-attention: the first of 4 steps only
