"""Dynamic rank on a CUDA GPU: bf16 numerics and no host-device synchronization in the routed layer."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from sits_lora import DynamicRankLinear, RankBudget, SitsLoraConfig
from sits_lora.dynamic_rank import dynamic_rank_lora_linear_reference, valid_tokens

from conftest import randomize_lora_weights, rel_err, tiny_llama

pytestmark = pytest.mark.gpu


def _model(scheduler):
    config = SitsLoraConfig(r=64, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "down_proj"],
                            use_dynamic_rank=True, rank_scheduler=scheduler, rank_buckets=[0, 16, 32, 48, 64],
                            target_mean_rank=None if scheduler == "static" else 16)  # 'static' takes no target
    model = get_peft_model(tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=4).cuda().to(torch.bfloat16), config)
    randomize_lora_weights(model)
    for m in model.modules():
        if isinstance(m, DynamicRankLinear):
            for probe in m.lora_entropy_probe.values():
                probe.fitted.fill_(True)
    return model


@pytest.mark.parametrize("scheduler", ["entropy-gated", "learned", "static"])
def test_routed_layer_step_does_not_synchronize(scheduler):
    """A sync per layer per step would stall the GPU 7 × n_layers times a step; the hot path has none."""
    model = _model(scheduler)
    budget = RankBudget(model)
    budget.lam = 0.3
    for _, layer in budget.layers:
        layer.rank_lambda["default"] = 0.3
    layer = budget.layers[0][1]
    model.train()
    x = torch.randn(4, 64, layer.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(4, 64, dtype=torch.long, device="cuda")
    mask[1, 40:] = 0
    with valid_tokens(mask):  # as inside the model's forward: the token counts and the masked λ term run too
        layer(x).float().square().mean().backward()  # warm-up: builds the per-device constants, reads the probe flag once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = layer(x)
            y.float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(y).all()
    assert int(layer.rank_counts("default")[0].sum()) == 2 * (4 * 64 - 24)


def test_bf16_reference_matches_fp64():
    g = torch.Generator().manual_seed(0)
    t, d_in, d_out, r = 300, 256, 384, 64
    x = torch.randn(t, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    a = torch.randn(r, d_in, generator=g) / d_in ** 0.5
    b = torch.randn(d_out, r, generator=g) / r ** 0.5
    ids = torch.randint(0, 5, (t,), generator=g)
    buckets = [0, 16, 32, 48, 64]
    expected = dynamic_rank_lora_linear_reference(x.double(), x.double(), w.double(), None, a.double(), b.double(), 2.0,
                                                  ids, buckets)
    got = dynamic_rank_lora_linear_reference(x.cuda().bfloat16(), x.cuda().bfloat16(), w.cuda().bfloat16(), None,
                                             a.cuda(), b.cuda(), 2.0, ids.cuda(), buckets)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.cpu(), expected) < 1e-2


def test_training_step_on_gpu_holds_finite_loss_and_counts_tokens():
    model = _model("entropy-gated")
    budget = RankBudget(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 97, (4, 32), device="cuda")
    model.train()
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = budget.step()
    assert torch.isfinite(loss) and stats["token_layer_pairs"] == 4 * 32 * len(budget.layers)


@pytest.mark.parametrize("with_router", [True, False], ids=["router", "hard"])
def test_bf16_triton_path_matches_fp64_with_every_gradient(with_router):
    """The fused dynamic-rank path in bf16 (the dtype the interpreter cannot check) against fp64."""
    from sits_lora.dynamic_rank import dynamic_rank_lora_linear

    g = torch.Generator().manual_seed(1)
    t, d_in, d_out, buckets = 1000, 512, 384, [0, 16, 32, 48, 64]
    x = torch.randn(t, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    a = torch.randn(64, d_in, generator=g) / d_in ** 0.5
    b = torch.randn(d_out, 64, generator=g) / 8
    dy = torch.randn(t, d_out, generator=g)
    ids = torch.randint(0, 5, (t,), generator=g)

    def run(kernel, dev, dtype):
        xx = x.to(dev, dtype).requires_grad_(True)
        aa = a.to(dev, torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
        bb = b.to(dev, aa.dtype).requires_grad_(True)
        ww = torch.nn.functional.one_hot(ids, 5).to(dev, aa.dtype).requires_grad_(True) if with_router else None
        y = dynamic_rank_lora_linear(xx, xx, w.to(dev, dtype), None, aa, bb, 1.5, ids.to(dev), buckets, ww,
                                     kernel=kernel)
        y.backward(dy.to(dev, dtype))
        return [v.detach().double().cpu() for v in (y, xx.grad, aa.grad, bb.grad) + ((ww.grad,) if with_router else ())]

    want = run("torch", "cpu", torch.float64)
    got = run("triton", "cuda", torch.bfloat16)
    for name, a_, b_ in zip(["y", "dx", "dA", "dB", "d bucket_weights"], got, want):
        assert rel_err(a_, b_) < 2e-2, name
