"""The few-matmul ATen path (sits_lora.ops.aten) against the reference, on odd shapes and every gradient, and the
rule that sends small calls to it (sits_lora.ops.choice.small_call)."""

from __future__ import annotations

import pytest
import torch

from sits_lora import ops
from sits_lora.ops.aten import lora_linear_aten
from sits_lora.ops.reference import lora_linear_reference

from conftest import rel_err


def _problem(lead=(37,), d_in=96, d_out=80, r=5, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=g, dtype=dtype)
    W = torch.randn(d_out, d_in, generator=g, dtype=dtype) / d_in**0.5
    b = torch.randn(d_out, generator=g, dtype=dtype) if bias else None
    A = torch.randn(r, d_in, generator=g, dtype=dtype) / d_in**0.5
    B = torch.randn(d_out, r, generator=g, dtype=dtype) / r**0.5
    return x, W, b, A, B


def _grads(fn, x, x_lora, W, b, A, B, s, dy):
    """(y, dx, dx_lora, dA, dB) of fn, W and b frozen; x_lora None: the LoRA input is x."""
    xg = x.clone().requires_grad_(True)
    xlg = None if x_lora is None else x_lora.clone().requires_grad_(True)
    Ag, Bg = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
    y = fn(xg, xg if xlg is None else xlg, W, b, Ag, Bg, s)
    y.backward(dy)
    return y.detach(), xg.grad, None if xlg is None else xlg.grad, Ag.grad, Bg.grad


@pytest.mark.parametrize("lead", [(37,), (3, 7), (2, 1, 5)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dropout", [False, True], ids=["same-input", "dropout-input"])
def test_aten_path_equals_the_reference_with_every_gradient(lead, bias, dropout):
    x, W, b, A, B = _problem(lead=lead, bias=bias)
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(9)) > 0.3
    x_lora = x * keep / 0.7 if dropout else None   # a dropout mask's output: the LoRA input differs from x
    dy = torch.randn(*lead, W.shape[0], dtype=x.dtype)
    ours = _grads(lora_linear_aten, x, x_lora, W, b, A, B, 1.7, dy)
    ref = _grads(lora_linear_reference, x, x_lora, W, b, A, B, 1.7, dy)
    for name, a, e in zip(("y", "dx", "dx_lora", "dA", "dB"), ours, ref):
        if e is None:
            assert a is None, name
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, name
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("lead", [(37,), (3, 7)], ids=["2d", "3d"])
@pytest.mark.parametrize("dropout", [False, True], ids=["same-input", "dropout-input"])
def test_without_gradients_the_same_output_and_no_autograd_node(lead, dropout):
    x, W, b, A, B = _problem(lead=lead)
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype) > 0.3
    x_lora = x * mask / 0.7 if dropout else x       # a dropped-out LoRA input: another tensor than x
    want = lora_linear_reference(x, x_lora, W, b, A, B, 1.7)
    with torch.no_grad():
        got = lora_linear_aten(x, x_lora, W, b, A.requires_grad_(True), B.requires_grad_(True), 1.7)
    assert got.grad_fn is None and got.shape == want.shape
    assert rel_err(got, want) < 1e-12
    # gradients off on every input (a frozen adapter, an eval forward outside no_grad): no node either
    got = lora_linear_aten(x, x_lora, W, b, A.detach(), B.detach(), 1.7)
    assert got.grad_fn is None and rel_err(got, want) < 1e-12


def test_no_input_gradient_is_computed_when_none_is_asked():
    x, W, b, A, B = _problem()
    Ag, Bg = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
    y = lora_linear_aten(x, x, W, b, Ag, Bg, 0.5)   # x without grad: the first layer of a frozen model
    y.square().sum().backward()
    ref_A, ref_B = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
    lora_linear_reference(x, x, W, b, ref_A, ref_B, 0.5).square().sum().backward()
    torch.testing.assert_close(Ag.grad, ref_A.grad)
    torch.testing.assert_close(Bg.grad, ref_B.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_adapters_over_a_half_model_compute_in_its_dtype_and_return_fp32_gradients(dtype):
    x, W, b, A, B = _problem(lead=(2, 33), d_in=64, d_out=48, r=8, dtype=torch.float32)
    dy = torch.randn(2, 33, 48)
    y, dx, _, dA, dB = _grads(lora_linear_aten, x.to(dtype), None, W.to(dtype), b.to(dtype), A, B, 2.0, dy.to(dtype))
    assert y.dtype == dtype and dx.dtype == dtype and dA.dtype == torch.float32 and dB.dtype == torch.float32
    ry, rdx, _, rdA, rdB = _grads(lora_linear_reference, x, None, W, b, A, B, 2.0, dy)
    for a, e in ((y, ry), (dx, rdx), (dA, rdA), (dB, rdB)):
        assert rel_err(a, e) < 2e-2   # half-precision rounding of the inputs, h and g


def test_small_call_rule(monkeypatch):
    x = torch.empty(2, 77, 320, device="meta")
    before = ops.aten_below_flops()
    try:
        ops.set_aten_below_flops(2.0 * 154 * 320 * 640 + 1)
        assert ops.small_call("auto", x, 320, 640)
        assert not ops.small_call("auto", x, 320, 641)           # one feature more: at or above the threshold
        assert not ops.small_call("triton", x, 320, 640)         # an explicit kernel is honoured
        # while torch.compile traces: a training call keeps the fused op, an inference call takes the matmuls
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not ops.small_call("auto", x, 320, 640)
        with torch.no_grad():
            assert ops.small_call("auto", x, 320, 640)
        monkeypatch.undo()
        ops.set_aten_below_flops(0)
        assert not ops.small_call("auto", x, 320, 1)
        with pytest.raises(ValueError, match="threshold must be >= 0, got -1"):
            ops.set_aten_below_flops(-1)
    finally:
        ops.set_aten_below_flops(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_aten_path_and_the_fused_one_agree_in_bf16():
    x, W, b, A, B = (t.cuda() for t in _problem(lead=(3, 77), d_in=320, d_out=640, r=16, dtype=torch.float32))
    dy = torch.randn(3, 77, 640, device="cuda")
    ref = _grads(lora_linear_reference, x, None, W, b, A, B, 2.0, dy)
    half = [t.bfloat16() for t in (x, W, b, A, B, dy)]
    for kernel in ("aten", "triton"):
        fn = lambda *a, k=kernel: ops.lora_linear(*a, kernel=k)   # noqa: E731
        got = _grads(fn, half[0], None, *half[1:5], 2.0, half[5])
        for name, a, e in zip(("y", "dx", "dx_lora", "dA", "dB"), got, ref):
            if e is not None:
                assert rel_err(a, e) < 1e-2, (kernel, name)
