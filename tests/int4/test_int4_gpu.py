"""INT4 frozen base on a GPU, bf16: the Triton dequant-GEMMs and the LoRA op at production shapes against the
PyTorch reference, both ways of running the base products, and a whole model's loss and gradients."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from peft import get_peft_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from conftest import randomize_lora_weights, rel_err, tiny_llama  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.ops import int4_linear as Q  # noqa: E402

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2


@pytest.mark.parametrize("N,K", [(4096, 4096), (14336, 4096), (4096, 14336), (1000, 2048)])
@pytest.mark.parametrize("T", [1, 37, 2048])
def test_dequant_gemms_match_the_reference_in_bf16(N, K, T):
    torch.manual_seed(0)
    packed, scales, mins = Q.int4_pack(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02, 128)
    w = Q.int4_unpack_reference(packed, scales, mins, K, torch.float32)
    out = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
    # bf16 output: one rounding of q·scale + min (the kernel may fuse the multiply-add)
    assert rel_err(Q.int4_dequantize(packed, scales, mins, K, out), w) < 4e-3
    x, dy = torch.randn(T, K, device="cuda", dtype=torch.bfloat16), torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    assert rel_err(Q.int4_matmul(x, packed, scales, mins, K), x.float() @ w.t()) < BF16_TOL
    assert rel_err(Q.int4_matmul(dy, packed, scales, mins, K, transposed=True), dy.float() @ w) < BF16_TOL


@pytest.mark.parametrize("mode", ["fused", "dequant"])
@pytest.mark.parametrize("dropout", [False, True])
def test_lora_op_matches_the_reference_in_bf16(mode, dropout):
    torch.manual_seed(1)
    N, K, r, T = 4096, 4096, 16, 1024
    packed, scales, mins = Q.int4_pack(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02, 128)
    outs = []
    for kernel in ("torch", "triton"):
        gen = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        # the same mask in both runs: drawn from the run's own generator
        keep = torch.rand(T, K, device="cuda", generator=gen) > 0.1
        x_lora = x * keep / 0.9 if dropout else x
        A = (torch.randn(r, K, device="cuda", generator=gen) * 0.02).requires_grad_()
        B = (torch.randn(N, r, device="cuda", generator=gen) * 0.02).requires_grad_()
        y = Q.int4_lora_linear(x, x_lora, A, B, None, packed, scales, mins, K, 2.0, kernel, mode)
        y.backward(torch.randn(T, N, device="cuda", dtype=torch.bfloat16, generator=gen))
        outs.append((y.detach(), x.grad, A.grad, B.grad))
    for ref, got in zip(*outs):
        assert rel_err(got, ref) < BF16_TOL


def test_a_whole_model_trains_on_the_int4_base_like_the_reference():
    """bf16 rounds at every op, and the differences grow back through the layers: both bf16 paths are held
    to an fp32 run of the same INT4 model (the truth), the fused one no further from it than the reference."""
    base = tiny_llama(0, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4).cuda()
    ids = torch.randint(0, 97, (2, 64), device="cuda")
    results = {}
    for kernel, dtype in (("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.bfloat16)):
        model = get_peft_model(copy.deepcopy(base).to(dtype), SitsLoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", base_quant="int4", kernel=kernel))
        randomize_lora_weights(model)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[(kernel, dtype)] = (loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                                            if p.grad is not None})
    truth_loss, truth = results[("torch", torch.float32)]
    ref_loss, ref = results[("torch", torch.bfloat16)]
    loss, grads = results[("triton", torch.bfloat16)]
    assert set(grads) == set(truth)
    assert rel_err(loss, truth_loss) < BF16_TOL
    for name in grads:
        assert rel_err(grads[name], truth[name]) <= 1.5 * rel_err(ref[name], truth[name]) + 1e-2, name
