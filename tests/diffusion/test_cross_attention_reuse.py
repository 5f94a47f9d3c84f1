"""Cross-attention K / V kept across denoising steps (sits_lora.siblings): a pipeline's to_k / to_v read the same
text states every step, so their fused op runs once per generation and gives the same images; anything that changes
the result (the text states, a LoRA weight, a scale) makes it run again; nothing is kept with autograd on or under
inference_mode."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_diffusers_models import ATTENTION, tiny_pipeline, tiny_unet, unet_call  # noqa: E402

from sits_lora import SitsLoraConfig, ops  # noqa: E402
from sits_lora.diffusion import reuse_cross_attention_kv  # noqa: E402

pytestmark = [
    # CPU tensors on the Triton kernels: the interpreter (the GPU's runs are in test_compile_blocks / test_graphs)
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="sibling fusion on CPU tensors runs the Triton kernels: TRITON_INTERPRET=1"),
    # these tests count the sibling-group paths at sizes the decode path would take (tests/ops/test_decode.py)
    pytest.mark.usefixtures("no_decode_kernel"),
]
STEPS = 4


@pytest.fixture
def sibling_calls(monkeypatch):
    calls = []
    real = ops.lora_siblings_triton
    monkeypatch.setattr(ops, "lora_siblings_triton", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    return calls


def adapted_pipeline():
    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False,
                                    kernel="triton"))
    return tiny_pipeline(unet)


def generate(pipe, text):
    return pipe(prompt_embeds=text, negative_prompt_embeds=torch.zeros_like(text), num_inference_steps=STEPS,
                height=8, width=8, output_type="latent", generator=torch.Generator().manual_seed(5)).images


def cross_groups(unet):
    return {id(m.to_k.sibling_group): m.to_k.sibling_group for m in unet.modules()
            if getattr(m, "is_cross_attention", False) is True}


def test_a_generation_runs_cross_attention_kv_once_with_the_same_latents(sibling_calls):
    pipe = adapted_pipeline()
    groups = len(cross_groups(pipe.unet))
    assert groups == 4 and reuse_cross_attention_kv(pipe.unet, True) == groups   # down, mid, 2 up
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(4))
    kept = generate(pipe, text)
    cross_calls = sibling_calls.count(2)
    assert cross_calls == groups   # the first step only (to_q / to_k / to_v of self-attention: 3 each step)
    assert sibling_calls.count(3) == groups * STEPS

    assert reuse_cross_attention_kv(pipe.unet, False) == groups
    sibling_calls.clear()
    fresh = generate(pipe, text)
    assert sibling_calls.count(2) == groups * STEPS
    assert torch.equal(kept, fresh)


def test_what_changes_the_result_runs_it_again():
    pipe = adapted_pipeline()
    unet = pipe.unet
    reference = copy.deepcopy(unet)
    reuse_cross_attention_kv(reference, False)
    text = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(3)
    sample, t = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([10, 500])

    def both():
        with torch.no_grad():
            return (unet(sample, t, encoder_hidden_states=text).sample,
                    reference(sample, t, encoder_hidden_states=text).sample)

    ours, ref = both()
    assert torch.equal(ours, ref)
    attn2 = [m for m in unet.modules() if getattr(m, "is_cross_attention", False) is True][0]
    attn2_ref = [m for m in reference.modules() if getattr(m, "is_cross_attention", False) is True][0]
    with torch.no_grad():   # a LoRA weight changed in place (training between generations, a loaded adapter)
        for m in (attn2, attn2_ref):
            m.to_v.lora_B["default"].weight.mul_(3)
    ours, ref = both()
    assert torch.equal(ours, ref)
    for m in (attn2, attn2_ref):   # a scale (PEFT's scale_layer, diffusers' cross_attention_kwargs={"scale": ...})
        m.to_k.scale_layer(0.5)
    ours, ref = both()
    assert torch.equal(ours, ref)
    with torch.no_grad():   # the text states changed in place
        text.mul_(2)
    ours, ref = both()
    assert torch.equal(ours, ref)


def test_nothing_is_kept_with_autograd_or_under_inference_mode(sibling_calls):
    pipe = adapted_pipeline()
    unet, groups = pipe.unet, cross_groups(pipe.unet)
    text = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        unet_call(unet, torch.Generator().manual_seed(3))
    assert all(g.kept is None for g in groups.values())
    with torch.inference_mode():
        for _ in range(2):
            unet(torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), encoder_hidden_states=text)
    assert all(g.kept is None for g in groups.values())
    assert sibling_calls.count(2) == 2 * len(groups) * 2


def test_a_mode_change_turning_dropout_on_is_not_answered_from_the_kept_outputs(sibling_calls):
    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=ATTENTION,
                                    init_lora_weights=False, kernel="triton"))
    unet.eval()
    text = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(4))
    sample, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 500])
    with torch.no_grad():
        unet(sample, t, encoder_hidden_states=text)
        kept_calls = sibling_calls.count(2)
        unet.train()   # dropout on: the layers must run PEFT's way, not hand back the eval-mode outputs
        unet(sample, t, encoder_hidden_states=text)
    assert kept_calls == len(cross_groups(unet)) and sibling_calls.count(2) == kept_calls
    assert all(g.kept is None for g in cross_groups(unet).values())


@pytest.mark.parametrize("keep", [True, False], ids=["kept_under_compile", "compiled_into_the_graph"])
def test_compiled_denoiser_keeps_cross_attention_kv_without_a_graph_break(sibling_calls, keep):
    """Under torch.compile a group told to keep its outputs (compile_blocks does) runs to_k / to_v as one opaque
    operator each, whose eager group computes them once for three calls with the same text states, without breaking
    the graph; left off, they are traced into the graph and the group is not used. Both give the eager outputs."""
    pipe = adapted_pipeline()
    unet, groups = pipe.unet.eval(), cross_groups(pipe.unet)
    text = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(4))
    samples = [torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    t = torch.tensor([10, 500])
    reference = copy.deepcopy(unet)
    reuse_cross_attention_kv(reference, False)
    with torch.no_grad():
        expected = [reference(s, t, encoder_hidden_states=text).sample for s in samples]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for group in groups.values():
        group.keep_under_compile = keep
    sibling_calls.clear()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(unet, backend=backend, fullgraph=True)   # a break would raise
    with torch.no_grad():
        outputs = [compiled(s, t, encoder_hidden_states=text).sample for s in samples]
    torch._dynamo.reset()
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not dict(torch._dynamo.utils.counters["graph_break"])
    assert len(graphs) == 1   # the whole denoiser one graph, kept K / V or not
    kept_ops = [n for n in graphs[0].graph.nodes if "kept_sibling_output" in str(n.target)]
    assert len(kept_ops) == (2 * len(groups) if keep else 0)
    if keep:   # one fused call per group, on the first call; the others answered from what it kept
        assert sibling_calls == [2] * len(groups)
        assert all(g.kept is not None for g in groups.values())
    else:
        assert sibling_calls == [] and all(g.kept is None for g in groups.values())


def test_blocks_of_one_shape_share_one_compilation_with_kept_cross_attention_kv(sibling_calls):
    """Each block compiled alone, as compile_blocks does: blocks of the same shape must reuse one compiled graph
    with their K / V kept (the operator finds its layer from a graph input, not from a constant baked into each
    block's graph, which made SDXL's 70 blocks compile one each until dynamo's recompile limit ran them eagerly)."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=24, attention_head_dim=8, norm_num_groups=8)
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False,
                                    kernel="triton"))
    unet.eval()
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    # 2 down and 3 up at 32 channels (8 x 8), 1 in the mid block at 64 (4 x 4): two shapes
    assert sorted(b.norm1.normalized_shape[0] for b in blocks) == [32] * 5 + [64]
    reference = copy.deepcopy(unet)
    reuse_cross_attention_kv(reference, False)
    text = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(4))
    samples = [torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    t = torch.tensor([10, 500])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for group in cross_groups(unet).values():
        group.keep_under_compile = True
    torch._dynamo.reset()
    for block in blocks:
        block.compile(backend=backend)
    with torch.no_grad():
        expected = [reference(s, t, encoder_hidden_states=text).sample for s in samples]
        sibling_calls.clear()
        outputs = [unet(s, t, encoder_hidden_states=text).sample for s in samples]
    torch._dynamo.reset()
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 2
    assert sibling_calls == [2] * len(blocks)   # each block's group computed its K / V once, for both calls


def test_a_copied_model_keeps_its_own_cross_attention_kv_under_compile(sibling_calls):
    """The operator finds the layer a compiled graph means among the copy's layers, not the original's: a deep
    copy's groups are findable, and weights changed in the copy show in its output."""
    pipe = adapted_pipeline()
    original = pipe.unet.eval()
    unet = copy.deepcopy(original)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "attn2.to_k.lora_B" in name:
                p.mul_(3)
    text = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(4))
    sample, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([10, 500])
    reference = copy.deepcopy(unet)
    reuse_cross_attention_kv(reference, False)
    for group in cross_groups(unet).values():
        group.keep_under_compile = True
    torch._dynamo.reset()
    compiled = torch.compile(unet, backend="eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(sample, t, encoder_hidden_states=text).sample
        expected = reference(sample, t, encoder_hidden_states=text).sample
        theirs = original(sample, t, encoder_hidden_states=text).sample
    torch._dynamo.reset()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, theirs, rtol=1e-3, atol=1e-3)
