"""FP8 frozen base on the GPU (issue 6): the fused cast against its reference bit for bit, the
torch._scaled_mm path against the emulation, one training step and generate() of a tiny model.

    python -m pytest -q -m gpu tests/fp8/test_fp8_gpu.py      # on a GPU of compute capability >= 8.9
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_fp8 import TARGETS, fp8_llama, sqnr, train_steps  # noqa: E402

import sits_lora  # noqa: E402,F401
from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.fp8 import fp8_scaling_state, frozen_weight_memory  # noqa: E402
from sits_lora.ops import fp8 as F  # noqa: E402

pytestmark = pytest.mark.gpu


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU of compute capability >= 8.9")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@needs_fp8
@pytest.mark.parametrize("dtype", [F.E4M3, F.E5M2])
@pytest.mark.parametrize("shape, strided", [((8192, 4096), False), ((5, 123), False), ((300, 64), True)])
@pytest.mark.parametrize("colscale", [False, True])
def test_fused_cast_is_bit_exact(dtype, shape, strided, colscale):
    torch.manual_seed(0)
    T, C = shape
    x = (torch.randn(T, 2 * C if strided else C, device="cuda") * 30).to(torch.bfloat16)
    if strided:
        x = x[:, ::2]
    x[0, 0] = float("inf")
    x[min(1, T - 1), -1] = float("nan")
    x[-1, 1] = 1e6  # saturates
    scale = torch.tensor([3.7], device="cuda")
    cs = torch.rand(C, device="cuda") + 0.5 if colscale else None
    amax_k, amax_r = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    got = F.fp8_cast(x, scale, amax_k, dtype, cs)
    want = F.fp8_cast_reference(x, scale, amax_r, dtype, cs)
    nan_g, nan_w = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(nan_g, nan_w)
    assert torch.equal(_bits(got)[~nan_g], _bits(want)[~nan_w])
    assert amax_k.item() == amax_r.item() == float("inf")
    x[0, 0] = x[min(1, T - 1), -1] = 0.0
    amax_k.zero_()
    F.fp8_cast(x, scale, amax_k, dtype, cs)
    want_amax = (x.float() * (cs if cs is not None else 1)).abs().max()
    assert amax_k.item() == want_amax.item() == F.fp8_amax(x, cs).item()


@needs_fp8
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("recipe", ["hybrid", "e4m3"])
@pytest.mark.parametrize("dropout", [False, True])
def test_scaled_mm_path_matches_emulation(granularity, recipe, dropout):
    torch.manual_seed(1)
    T, K, N, R = 1000, 1024, 768, 16
    x = torch.randn(4, T // 4, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(N, K, device="cuda") / 32).to(torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    A = (torch.randn(R, K, device="cuda") * 0.05).requires_grad_()
    B = (torch.randn(N, R, device="cuda") * 0.05).requires_grad_()
    w8, w_inv = F.quantize_weight(W, granularity)
    grad_dtype = F.E5M2 if recipe == "hybrid" else F.E4M3
    dy = torch.randn(4, T // 4, N, device="cuda", dtype=torch.bfloat16)
    x_lora = torch.nn.functional.dropout(x, 0.2) if dropout else None
    results = {}
    for emulate in (False, True):
        state = [torch.full((2,), s, device="cuda") for s in (0.5, 2.0)]  # delayed: scale 0.5, inverse 2
        amax = torch.zeros(2, device="cuda")
        scales = {"delayed": True, "scale": state[0], "scale_inv": state[1], "amax": amax, "margin": 0,
                  "grad_dtype": grad_dtype, "emulate": emulate}
        y = F.fp8_lora_linear(x, x_lora, A, B, w8, w_inv, bias, 2.0, scales)
        grads = torch.autograd.grad(y, (x, A, B), dy, retain_graph=True)
        results[emulate] = (y, grads, amax)
    (y, g, amax), (y_e, g_e, amax_e) = results[False], results[True]
    # the same fp8 casts on both sides; what differs: fast accumulation in forward, bf16 tensor-core
    # LoRA kernels against fp32 products (a wrong scale or layout gives about 0 dB)
    assert sqnr(y_e, y) >= 30 and sqnr(g_e[0], g[0]) >= 30
    for got, want in zip(g[1:], g_e[1:]):
        assert sqnr(want, got) >= 35
    torch.testing.assert_close(amax, amax_e)


@needs_fp8
def test_tiny_model_train_step_generate_and_memory():
    from peft import get_peft_model

    model = get_peft_model(fp8_llama().to("cuda", torch.bfloat16),
                           SitsLoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, fp8="hybrid", fp8_layers="all"))
    assert frozen_weight_memory(model)["ratio"] <= 0.55
    losses = train_steps(model, steps=3)
    assert all(l == l for l in losses) and losses[-1] < losses[0] + 0.1
    state = fp8_scaling_state(model)
    assert state.steps == 3 and torch.isfinite(state.scale).all() and state.nonfinite_steps.sum() == 0
    model.eval()
    ids = torch.randint(0, 97, (1, 6), device="cuda")
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11)
    emulated = get_peft_model(fp8_llama().to("cuda", torch.bfloat16),
                              SitsLoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, fp8="hybrid", fp8_layers="all",
                                             fp8_emulate=True))
    emulated.load_state_dict(model.state_dict(), strict=False)
    emulated.eval()
    with torch.no_grad():
        assert sqnr(emulated(input_ids=ids).logits.float(), model(input_ids=ids).logits.float()) >= 25


@pytest.mark.skipif(not torch.cuda.is_available() or _fp8_gpu(), reason="needs a GPU below compute capability 8.9")
def test_old_gpu_is_refused():
    from peft import get_peft_model

    from sits_lora.fp8 import Fp8UnsupportedError

    with pytest.raises(Fp8UnsupportedError, match="compute capability"):
        get_peft_model(fp8_llama().cuda(), SitsLoraConfig(r=8, target_modules=TARGETS, fp8="hybrid", fp8_layers="all"))
