"""compile_blocks: every block of a tiny U-Net (with a sits_lora adapter) and the VAE's decoder compiled alone give
the eager pipeline's image; what it compiles, and its refusals."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, os.path.dirname(__file__))
from test_diffusers_models import ATTENTION, tiny_pipeline, tiny_unet  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.diffusion import compile_blocks  # noqa: E402


def _image(pipe, seed=5):
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return pipe(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text), num_inference_steps=2,
                    height=16, width=16, output_type="pt", generator=torch.Generator().manual_seed(seed)).images


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_compiled_blocks_give_the_eager_image(channels_last):
    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    eager = tiny_pipeline(unet.eval())
    compiled = copy.deepcopy(eager)
    names = compile_blocks(compiled, channels_last=channels_last)
    kinds = {type(compiled.unet.get_submodule(n)).__name__ for n in names if n != "vae.decoder"}
    assert "vae.decoder" in names and {"ResnetBlock2D", "BasicTransformerBlock"} <= kinds
    assert not any(a.startswith(b + ".") for a in names for b in names)      # no block inside a compiled one
    torch.testing.assert_close(_image(compiled), _image(eager), rtol=1e-4, atol=1e-4)


def test_compiled_blocks_compile_once_while_a_graph_wrapper_watches_the_model():
    # graph_denoiser's AdapterState sets a module-registration hook; the VAE decoder's mid block slices its resnets
    # every call, and the hook, traced into the compiled decoder, made it compile again at every image (an SDXL
    # image took ~3 s instead of ~1 on an H200)
    from torch._dynamo.utils import counters

    from sits_lora.utils.cuda_graphs import AdapterState

    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    pipe = tiny_pipeline(unet.eval())
    compile_blocks(pipe)
    AdapterState(pipe.unet)()
    _image(pipe)
    compiled = counters["stats"]["unique_graphs"]
    _image(pipe)
    _image(pipe)
    assert counters["stats"]["unique_graphs"] == compiled


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="graph_denoiser"):
        compile_blocks(tiny_unet(), mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"torch.compile\(model\)"):
        compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=".unet or .transformer"):
        compile_blocks(object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_inference_traces_small_calls_as_matmuls():
    """Under torch.compile with nothing to differentiate, a LoRA call as small as a tiny U-Net's (every one here)
    is traced as plain matmuls, not the fused custom op, and gives the eager output."""
    torch.manual_seed(0)
    unet = tiny_unet().to("cuda", torch.bfloat16).eval()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    block = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(2, 64, 32, device="cuda", dtype=torch.bfloat16)
    text = torch.randn(2, 77, 24, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = block(x, encoder_hidden_states=text)
        compiled = torch.compile(block, backend=backend, fullgraph=True)(x, encoder_hidden_states=text)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert graphs and not any("sits_lora" in t for t in targets), sorted(targets)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


def _compiled_gpu_unet():
    """A tiny bf16 U-Net with a sits adapter on the GPU, its blocks compiled, and an eager copy made before."""
    torch.manual_seed(0)
    unet = tiny_unet().to("cuda", torch.bfloat16).eval()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    eager = copy.deepcopy(unet)
    compile_blocks(unet, vae=False)
    return unet, eager


def _guided_calls(unet, eager, calls: int) -> torch.Tensor:
    """``calls`` denoiser calls with one text-state tensor, each checked against the eager copy; the text states."""
    text = torch.randn(2, 7, 24, device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([10, 500], device="cuda")
    with torch.no_grad():
        for seed in range(calls):
            sample = torch.randn(2, 4, 8, 8, device="cuda", dtype=torch.bfloat16,
                                 generator=torch.Generator("cuda").manual_seed(seed))
            out = unet(sample.contiguous(memory_format=torch.channels_last), t, encoder_hidden_states=text).sample
            torch.testing.assert_close(out, eager(sample, t, encoder_hidden_states=text).sample, rtol=2e-2, atol=2e-2)
    return text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_blocks_keep_cross_attention_kv_across_calls():
    """compile_blocks leaves the cross-attention to_k / to_v outside the compiled graphs: a generation's calls with
    the same text states compute them once (the groups keep them) and give the eager outputs."""
    from sits_lora.diffusion.reuse import cross_attention_groups

    unet, eager = _compiled_gpu_unet()
    groups = cross_attention_groups(unet)
    assert groups and all(g.keep_under_compile for g in groups)
    text = _guided_calls(unet, eager, 3)
    assert all(g.kept is not None and g.kept[0] is text for g in groups)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_blocks_under_graph_denoiser_replay_the_kept_k_v():
    """compile_blocks then graph_denoiser: the warm-up compiles the variant the recordings run (K / V reuse on), so
    nothing compiles inside a recording; later steps replay the recording that reads the kept K / V and give the
    eager outputs."""
    from sits_lora.diffusion import graph_denoiser

    unet, eager = _compiled_gpu_unet()
    graphs = graph_denoiser(unet)
    _guided_calls(unet, eager, 4)
    assert graphs.recordings == 1 and graphs.replays == 4 and graphs.kept_replays == 3
