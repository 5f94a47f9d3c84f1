"""The reference LoRA linear: its written-out backward against autograd, on odd shapes."""

from __future__ import annotations

import pytest
import torch

from sits_lora.ops.reference import (
    LoraLinearReferenceFunction,
    lora_linear_torch,
    lora_linear_backward_reference,
    lora_linear_reference,
)

from conftest import rel_err


def _problem(T=37, d_in=96, d_out=80, r=5, dtype=torch.float64, lead=(), bias=True, seed=0, noncontig=False):
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, T, d_in) if lead else (T, d_in)
    if noncontig:  # a transposed view: same values, non-contiguous strides
        x = torch.randn(*shape[:-2], d_in, T, generator=g, dtype=dtype).transpose(-1, -2)
        assert not x.is_contiguous()
    else:
        x = torch.randn(*shape, generator=g, dtype=dtype)
    W = torch.randn(d_out, d_in, generator=g, dtype=dtype) / d_in**0.5
    b = torch.randn(d_out, generator=g, dtype=dtype) if bias else None
    A = torch.randn(r, d_in, generator=g, dtype=dtype) / d_in**0.5
    B = torch.randn(d_out, r, generator=g, dtype=dtype) / r**0.5
    return x, W, b, A, B


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("noncontig", [False, True], ids=["contig", "noncontig"])
def test_written_backward_equals_autograd(lead, noncontig):
    x, W, b, A, B = _problem(lead=lead, noncontig=noncontig)
    s = 1.7
    leaves = [t.clone().requires_grad_(True) for t in (x, W, b, A, B)]
    xl, Wl, bl, Al, Bl = leaves
    y = lora_linear_reference(xl, xl, Wl, bl, Al, Bl, s)
    dy = torch.randn_like(y)
    y.backward(dy)
    dx, dx_lora, dA, dB, dW, db = lora_linear_backward_reference(dy, x, x, W, A, B, s, True, True)
    torch.testing.assert_close((dx + dx_lora).reshape(x.shape), xl.grad)
    torch.testing.assert_close(dA, Al.grad)
    torch.testing.assert_close(dB, Bl.grad)
    torch.testing.assert_close(dW, Wl.grad)
    torch.testing.assert_close(db, bl.grad)


@pytest.mark.parametrize("trainable_base", [False, True], ids=["frozen-base", "trainable-base"])
@pytest.mark.parametrize("separate_lora_input", [False, True], ids=["x", "dropout-x"])
def test_function_matches_oracle_every_gradient(trainable_base, separate_lora_input):
    x, W, b, A, B = _problem(T=37, d_in=96, d_out=80, r=5, lead=(2,), dtype=torch.float32)
    s = 0.5
    mask = (torch.rand(x.shape, generator=torch.Generator().manual_seed(5)) > 0.3).float() / 0.7

    def run(fn):
        xx = x.clone().requires_grad_(True)
        WW, bb = W.clone().requires_grad_(trainable_base), b.clone().requires_grad_(trainable_base)
        AA, BB = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
        x_lora = xx * mask if separate_lora_input else xx
        y = fn(xx, x_lora, WW, bb, AA, BB, s)
        y.backward(torch.ones_like(y) * 0.01 + y.detach() * 0.1)
        grads = [xx.grad, AA.grad, BB.grad] + ([WW.grad, bb.grad] if trainable_base else [])
        return y, grads

    y_ref, g_ref = run(lora_linear_reference)
    y_fn, g_fn = run(lora_linear_torch)
    torch.testing.assert_close(y_fn, y_ref, rtol=1e-5, atol=1e-5)
    for a, e in zip(g_fn, g_ref):
        assert rel_err(a, e) < 1e-5


def test_function_saves_no_x_copy_for_frozen_base():
    x, W, b, A, B = _problem(dtype=torch.float32)
    x.requires_grad_(True)
    A.requires_grad_(True)
    B.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora_linear_torch(x, x, W, b, A, B, 1.0)
    activations = [t for t in saved if t is not None and t.shape == x.shape]
    assert len(activations) == 1  # x once (the LoRA input), not once more for the frozen base
    assert activations[0].data_ptr() == x.data_ptr()  # a reference, not a copy


def test_half_precision_adapter_fp32_base_bf16_close_to_fp64():
    x, W, b, A, B = _problem(dtype=torch.float64)
    ref = lora_linear_reference(x, x, W, b, A, B, 2.0)
    out = LoraLinearReferenceFunction.apply(x.bfloat16(), x.bfloat16(), W.bfloat16(), b.bfloat16(), A.float(), B.float(), 2.0)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2
