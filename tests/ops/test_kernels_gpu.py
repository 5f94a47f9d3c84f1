"""bf16 / fp16 numerics and whole-model equality on a CUDA GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from sits_lora import SitsLoraConfig, ops
from sits_lora.ops.choice import GEMM_BACKENDS
from sits_lora.ops.reference import lora_linear_reference

from conftest import assert_autocast_step_like_peft, randomize_lora_weights, rel_err, tiny_llama

pytestmark = pytest.mark.gpu

SHAPES = [
    # T, K, N, r: odd shapes, then production shapes
    (37, 96, 80, 5),
    (1000, 200, 328, 17),
    (8192, 4096, 4096, 16),
    (8192, 4096, 14336, 64),
    (8192, 14336, 4096, 16),
]


def _run(fn, x, W, b, A, B, s, x_lora_mask=None):
    x = x.detach().clone().requires_grad_(True)
    A = A.detach().clone().requires_grad_(True)
    B = B.detach().clone().requires_grad_(True)
    xl = x * x_lora_mask if x_lora_mask is not None else x
    y = fn(x, xl, W, b, A, B, s)
    dy = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(1), device=y.device).to(y.dtype)
    y.backward(dy)
    return [y, x.grad, A.grad, B.grad]


@pytest.mark.parametrize("gemm", GEMM_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T,K,N,r", SHAPES, ids=[f"T{t}_{k}x{n}_r{r}" for t, k, n, r in SHAPES])
def test_fused_vs_fp64_reference(gemm, dtype, T, K, N, r):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, K, device="cuda", generator=g).to(dtype)
    W = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    A = torch.randn(r, K, device="cuda", generator=g) / K**0.5
    B = torch.randn(N, r, device="cuda", generator=g) / r**0.5
    got = _run(lambda x, xl, W, b, A, B, s: ops.lora_linear_triton(x, None, W, b, A, B, s, gemm), x, W, b, A, B, 2.0)
    f64 = [t.double() for t in (x, W, b, A, B)]
    want = _run(lora_linear_reference, *f64, 2.0)
    for name, a, e in zip(("y", "dx", "dA", "dB"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, e) < 1e-2, (name, rel_err(a, e))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tiny_llama_on_gpu_matches_peft(dtype):
    kwargs = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    sits = get_peft_model(tiny_llama(dtype=dtype).cuda(), SitsLoraConfig(**kwargs))
    peft = get_peft_model(tiny_llama(dtype=dtype).cuda(), LoraConfig(**kwargs))
    randomize_lora_weights(sits)
    peft.load_state_dict(sits.state_dict())
    ids = torch.randint(0, 97, (4, 33), device="cuda")
    out_s = sits(input_ids=ids, labels=ids)
    out_p = peft(input_ids=ids, labels=ids)
    assert rel_err(out_s.logits, out_p.logits) < 2e-2
    out_s.loss.backward()
    out_p.loss.backward()
    pp = dict(peft.named_parameters())
    for n, p in sits.named_parameters():
        if p.requires_grad:
            assert rel_err(p.grad, pp[n].grad) < 5e-2, n


def test_auto_selects_triton_on_gpu():
    assert ops.resolve_kernel("auto", torch.zeros(2, 2, device="cuda", dtype=torch.bfloat16)) == "triton"
    assert ops.resolve_kernel("auto", torch.zeros(2, 2, device="cuda")) == "torch"


@pytest.mark.parametrize("T,K", [(1000, 328), (8192, 8192)], ids=["odd", "1B down_proj"])
def test_x_pass_on_liger_swiglu_factors_is_bit_identical_to_its_output(T, K):
    """down_proj's x pass reading Liger's kept (gate, up) forms the very x Liger's SiLU·mul wrote: the same dA and
    dx, bit for bit, as the pass over that x (and likewise for gate·up, the multiply transformers' MLP runs)."""
    liger_swiglu = pytest.importorskip("liger_kernel.ops.swiglu")
    from sits_lora.ops.fused import lora_x_pass_parts
    from sits_lora.ops.reference import ProductInput

    gen = torch.Generator(device="cuda").manual_seed(4)
    gate, up = (torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    A = torch.randn(16, K, device="cuda", generator=gen) / K**0.5
    g_parts = torch.randn(3, T, 16, device="cuda", generator=gen)
    for product, x in ((ProductInput(gate, up, True), liger_swiglu.swiglu_forward(gate, up)[2]),
                       (ProductInput(gate, up, False), gate * up)):
        # torch's SiLU and the kernels' x·sigmoid(x) may part in fp32's last bit, now and then one bf16 step apart
        torch.testing.assert_close(product.value(), x, rtol=1e-2, atol=1e-2)
        da_p, dx_p = lora_x_pass_parts(product, A, g_parts, 2.0, write_dx=True)
        da_x, dx_x = lora_x_pass_parts(x, A, g_parts, 2.0, write_dx=True)
        assert torch.equal(da_p, da_x) and torch.equal(dx_p, dx_x)


def test_an_fp32_model_under_bf16_autocast_leaves_the_reference_and_trains_like_peft():
    """kernel="auto" with fp32 weights and activations under bf16 autocast: the fused op computes in bf16, so the plan
    names the fused path's kernels (at this tiny size the ATen one), not the reference, and the loss and every LoRA
    gradient match PEFT's under the same autocast."""
    from sits_lora.layers.forward_plan import plan_forward

    kwargs = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])
    sits = get_peft_model(tiny_llama().cuda(), SitsLoraConfig(**kwargs)).train()
    peft = get_peft_model(tiny_llama().cuda(), LoraConfig(**kwargs)).train()
    randomize_lora_weights(sits)
    peft.load_state_dict(sits.state_dict())
    layer = sits.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 9, layer.in_features, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert plan_forward(layer, x).kernel in ("triton", "aten")
    assert plan_forward(layer, x).kernel == "torch"   # without autocast: fp32, the reference
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    assert_autocast_step_like_peft(sits, peft, ids, "cuda", torch.bfloat16)
