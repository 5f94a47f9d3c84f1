"""FP8 frozen base (issue 6) on the CPU: emulated numerics, delayed scaling, overflow, save / load, config errors.

The emulation (fp8_emulate=True) runs the same casts and scales as the GPU path in plain PyTorch; the
GPU path's own kernels and torch._scaled_mm are compared with it in test_fp8_gpu.py. Under the Triton
interpreter the GPU path's plumbing runs here too (the interpreter's fp8 rounding is not faithful, so
those checks use a loose SQNR: a wrong scale or layout gives about 0 dB).
"""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import randomize_lora_weights  # noqa: E402

import sits_lora  # noqa: E402,F401
from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.fp8 import (  # noqa: E402
    Fp8BaseLinear,
    Fp8ScalingState,
    Fp8UnsupportedError,
    fp8_scaling_state,
    frozen_weight_memory,
    update_scaling,
    without_fp8,
)
from sits_lora.ops import fp8 as F  # noqa: E402
from sits_lora.ops.reference import lora_linear_reference  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return (10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean().clamp_min(1e-300))).item()


def fp8_llama(seed: int = 0):
    """A tiny random Llama whose projections are multiples of 16 (torch._scaled_mm's rule)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def fp8_model(seed: int = 0, **config):
    from peft import get_peft_model

    kwargs = dict(r=8, lora_alpha=16, target_modules=TARGETS, fp8="hybrid", fp8_emulate=True)
    kwargs.update(config)
    model = get_peft_model(fp8_llama(seed), SitsLoraConfig(**kwargs))
    randomize_lora_weights(model, seed=seed + 1)
    return model


def train_steps(model, steps: int = 3, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 16), generator=gen).to(next(model.parameters()).device)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        update_scaling(model)
        losses.append(loss.item())
    return losses


def scales(delayed=False, amax=None, grad_dtype=F.E5M2, margin=0, emulate=True, state=None):
    return {"delayed": delayed, "scale": None if state is None else state[0], "scale_inv": None if state is None
            else state[1], "amax": amax, "margin": margin, "grad_dtype": grad_dtype, "emulate": emulate}


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_fp8_gemm_sqnr_against_fp32(granularity):
    torch.manual_seed(0)
    T, K, N = 37, 64, 48
    x, W, dy = torch.randn(T, K), torch.randn(N, K) / 8, torch.randn(T, N)
    w8, w_inv = F.quantize_weight(W, granularity)
    assert w8.dtype == F.E4M3 and w_inv.shape == ((1,) if granularity == "tensor" else (N,))
    x_scale, x_inv = F.current_scale(x, F.E4M3, 0, emulate=True)
    y, h = F.fp8_linear_forward(x, None, w8, w_inv, None, None, None, 0.0, x_scale, x_inv, None, emulate=True)
    assert h is None and sqnr(x @ W.t(), y) >= 25  # e4m3 forward (measured 28.4 dB)
    for grad_dtype, floor in ((F.E4M3, 25), (F.E5M2, 21)):  # measured 28.4 and 24.3 dB
        colscale = w_inv if granularity == "row" else None
        dy_scale, dy_inv = F.current_scale(dy, grad_dtype, 0, True, colscale)
        dx, _, _, _ = F.fp8_linear_backward(dy, x, None, w8, w_inv, None, None, None, 0.0, dy_scale, dy_inv, None,
                                            grad_dtype, emulate=True, need_dx=True)
        assert sqnr(dy @ W, dx) >= floor, grad_dtype


@pytest.mark.parametrize("dropout", [False, True])
def test_function_outputs_and_every_gradient(dropout):
    """Base through fp8, LoRA exact: dA, dB match the bf16 reference; y, dx by SQNR; odd leading dims."""
    torch.manual_seed(1)
    K, N, R = 64, 32, 4
    x = torch.randn(3, 5, K, requires_grad=True)
    x_lora = (torch.nn.functional.dropout(x, 0.3) if dropout else x)
    W, b = torch.randn(N, K) / 8, torch.randn(N)
    A = (torch.randn(R, K) * 0.1).requires_grad_()
    B = (torch.randn(N, R) * 0.1).requires_grad_()
    w8, w_inv = F.quantize_weight(W, "tensor")
    y = F.fp8_lora_linear(x, x_lora if dropout else None, A, B, w8, w_inv, b, 2.0, scales())
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, A, B), dy, retain_graph=True)
    y_ref = lora_linear_reference(x, x_lora, W, b, A, B, 2.0)
    ref = torch.autograd.grad(y_ref, (x, A, B), dy)
    assert y.shape == (3, 5, N) and sqnr(y_ref, y) >= 25
    assert sqnr(ref[0], grads[0]) >= 21
    for got, want in zip(grads[1:], ref[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_trainable_bias_gets_its_gradient():
    torch.manual_seed(2)
    x = torch.randn(6, 32)
    b = torch.randn(16, requires_grad=True)
    w8, w_inv = F.quantize_weight(torch.randn(16, 32), "tensor")
    y = F.fp8_lora_linear(x, None, None, None, w8, w_inv, b, 0.0, scales())
    (db,) = torch.autograd.grad(y, b, torch.ones_like(y))
    torch.testing.assert_close(db, torch.full_like(b, 6.0))


def test_cast_saturates_and_maps_nonfinite_to_nan():
    x = torch.tensor([[1.0, -1000.0, float("inf"), float("nan"), 0.5, 3.0]])
    amax = torch.zeros(1)
    for dtype, fmax in ((F.E4M3, 448.0), (F.E5M2, 57344.0)):
        q = F.fp8_cast_reference(x, torch.tensor([fmax / 100]), amax, dtype).float()
        assert q[0, 1] == -fmax and torch.isnan(q[0, 2]) and torch.isnan(q[0, 3])
        assert q[0, 0] == pytest.approx(fmax / 100, rel=0.125)
    assert amax.item() == float("inf")


def test_cast_kernel_records_amax_under_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter runs only without a GPU")
    torch.manual_seed(3)
    x = torch.randn(45, 70) * 7
    colscale = torch.rand(70) + 0.5
    amax = torch.zeros(1)
    out = F.fp8_cast(x, torch.tensor([2.0]), amax, F.E4M3, colscale)
    assert out.dtype == F.E4M3 and out.shape == x.shape and out.is_contiguous()
    assert amax.item() == pytest.approx((x * colscale).abs().max().item(), rel=1e-6)
    assert F.fp8_amax(x).item() == pytest.approx(x.abs().max().item(), rel=1e-6)
    x[3, 4] = float("nan")
    assert F.fp8_amax(x).item() == float("inf")


@pytest.mark.parametrize("shape", [(37, 50), (64, 64), (130, 17), (1, 200)])
@pytest.mark.parametrize("dtype", [F.E4M3, F.E5M2])
def test_weight_transpose_kernel_is_bit_exact_under_interpreter(shape, dtype):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter runs only without a GPU")
    torch.manual_seed(6)
    w8 = (torch.randn(*shape) * 40).to(dtype)
    out = F.transpose_fp8(w8)
    assert out.dtype == dtype and out.shape == (shape[1], shape[0]) and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), w8.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("direction", ["forward", "dX"])
def test_triton_fp8_matmul_equals_the_fp32_product_under_interpreter(direction):
    """The Triton fp8 GEMM candidate: forward x8 W8ᵀ (W8 read K-major) and dX = dy8 W8 (W8 read as stored, no
    transpose), odd sizes, against the fp32 product of the same fp8 values and scales."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter runs only without a GPU")
    torch.manual_seed(7)
    w8, w_inv = F.quantize_weight(torch.randn(40, 72), "tensor")                       # (N, K)
    if direction == "forward":
        a8, b8 = (torch.randn(37, 72) * 20).to(F.E4M3), w8.t()
    else:
        a8, b8 = (torch.randn(37, 40) * 20).to(F.E5M2), w8
    a_inv = torch.tensor([0.05])
    out = F.triton_fp8_matmul(a8, b8, a_inv, w_inv, out_dtype=torch.float32)
    want = (a8.float() @ b8.float()) * a_inv * w_inv
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        F.triton_fp8_matmul(a8, b8[:5], a_inv, w_inv)


def test_expand_add_kernel_under_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter runs only without a GPU")
    torch.manual_seed(4)
    c, h, B, bias = torch.randn(37, 48), torch.randn(37, 5), torch.randn(48, 5), torch.randn(48)
    want = c + 1.5 * h @ B.t() + bias
    F.lora_expand_add_(c, h, B, 1.5, bias)
    torch.testing.assert_close(c, want, rtol=1e-5, atol=1e-5)
    A = torch.randn(5, 40)  # dX's use: c (T, K) += s·g A, B given as the strided view Aᵀ
    c2 = torch.zeros(37, 40)
    F.lora_expand_add_(c2, h, A.t(), 2.0, None)
    torch.testing.assert_close(c2, 2.0 * h @ A, rtol=1e-5, atol=1e-5)


def test_gpu_path_plumbing_under_interpreter():
    """The non-emulated path (Triton cast, torch._scaled_mm, fused LoRA kernels) on CPU tensors."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter runs only without a GPU")
    torch.manual_seed(5)
    T, K, N, R = 33, 64, 48, 8
    x, dy = torch.randn(T, K), torch.randn(T, N)
    W, A, B = torch.randn(N, K) / 8, torch.randn(R, K) * 0.1, torch.randn(N, R) * 0.1
    for granularity in ("tensor", "row"):
        w8, w_inv = F.quantize_weight(W, granularity)
        xs = F.current_scale(x, F.E4M3, 0, True)
        amax = torch.zeros(2)
        y, h = F.fp8_linear_forward(x, None, w8, w_inv, None, A, B, 2.0, *xs, amax[0:1], emulate=False)
        assert sqnr(x @ W.t() + 2.0 * (x @ A.t()) @ B.t(), y) >= 12, granularity
        colscale = w_inv if granularity == "row" else None
        ds = F.current_scale(dy, F.E5M2, 0, True, colscale)
        dx, _, dA, dB = F.fp8_linear_backward(dy, x, None, w8, w_inv, A, B, h, 2.0, *ds, amax[1:2], F.E5M2,
                                              emulate=False, need_dx=True)
        assert sqnr(dy @ W + 2.0 * (dy @ B) @ A, dx) >= 12, granularity
        torch.testing.assert_close(dA, 2.0 * (dy @ B).t() @ x, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dB, 2.0 * dy.t() @ (x @ A.t()), rtol=1e-4, atol=1e-4)
        assert amax[0].item() == pytest.approx(x.abs().max().item())
        assert amax[1].item() == pytest.approx((dy * (colscale if colscale is not None else 1)).abs().max().item())


# ----------------------------------------------------------------------------- delayed scaling


def _state(**kw):
    args = dict(names=["a"], recipe="hybrid", history_len=3, algo="max", margin=0, emulate=True)
    args.update(kw)
    return Fp8ScalingState(**args)


@pytest.mark.parametrize("algo, expected", [("max", [1, 4, 4, 4, 2]), ("most_recent", [1, 4, 2, 0.5, 0.25])])
@pytest.mark.parametrize("margin", [0, 2])
def test_history_and_margin_follow_transformer_engine(algo, expected, margin):
    state = _state(algo=algo, margin=margin)
    assert not state.scales_for(0, training=True)["delayed"]  # first step: each tensor's own amax
    for amax, use in zip([1, 4, 2, 0.5, 0.25], expected):
        state.amax[0] = torch.tensor([amax, amax * 100])
        state.update()
        torch.testing.assert_close(state.scale[0], torch.tensor([448 / use, 57344 / (use * 100)]) / 2**margin)
        torch.testing.assert_close(state.scale_inv[0], 1 / state.scale[0])
        assert state.amax.abs().sum() == 0  # the running amax restarts each step
    view = state.scales_for(0, training=True)
    assert view["delayed"] and view["amax"] is not None
    assert not state.scales_for(0, training=False)["delayed"] and state.scales_for(0, training=False)["amax"] is None


def test_zero_amax_keeps_the_scale():
    state = _state(algo="most_recent")
    state.amax[0] = torch.tensor([2.0, 2.0])
    state.update()
    before = state.scale.clone()
    state.update()  # a layer that did not run: amax 0
    torch.testing.assert_close(state.scale, before)


def test_overflow_backs_the_scale_off_and_is_counted(caplog):
    state = _state(names=["a", "b"], history_len=4)
    state.amax[:] = 1.0
    state.update()
    scale = state.scale.clone()
    state.amax[0, 0] = float("inf")      # non-finite input of layer a
    state.amax[1, 1] = 3.0               # layer b's gradient beyond the range at the scale in use
    state.amax[0, 1] = state.amax[1, 0] = 1.0
    with caplog.at_level(logging.INFO, logger="sits_lora"):
        state.update()
        state.update()                   # the counts reach the log one step later (no host sync)
    assert state.scale[0, 0] <= scale[0, 0] / 2 and torch.isfinite(state.scale).all()
    torch.testing.assert_close(state.scale[1, 1], scale[1, 1] / 3)
    assert state.nonfinite_steps.tolist() == [[1, 0], [0, 0]]
    assert state.saturated_steps.tolist() == [[0, 0], [0, 1]]
    assert state.log_counts() == {"fp8_saturated": 1, "fp8_nonfinite": 1}
    assert any("NaN/Inf" in r.message for r in caplog.records)


def test_nonfinite_activation_gives_nan_output_and_backs_off():
    model = fp8_model()
    train_steps(model, steps=1)
    state = fp8_scaling_state(model)
    before = state.scale.clone()
    norm = model.base_model.model.model.layers[1].input_layernorm
    handle = norm.register_forward_hook(lambda m, i, out: out.index_fill(1, torch.tensor([3]), float("inf")))
    ids = torch.randint(0, 97, (2, 16))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    handle.remove()
    assert not torch.isfinite(loss)      # the NaN/Inf policy of the Trainer callback sees this step
    update_scaling(model)
    q = state.names.index("model.layers.1.self_attn.q_proj")
    assert state.nonfinite_steps[q, 0] == 1 and state.scale[q, 0] <= before[q, 0] / 2


@pytest.mark.slow
def test_trainer_callback_advances_scales_and_skips_the_bad_step(tmp_path):
    from datasets import Dataset
    from transformers import TrainingArguments, default_data_collator

    from sits_lora.training import NativeLoraTrainer, SitsHardwareCallback

    model = fp8_model()
    calls = {"n": 0}

    def poison(module, inputs, out):
        calls["n"] += 1
        return out.index_fill(1, torch.tensor([2]), float("nan")) if calls["n"] == 2 else out

    model.base_model.model.model.layers[0].post_attention_layernorm.register_forward_hook(poison)
    ids = torch.randint(0, 97, (16, 16), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
    callback = SitsHardwareCallback(report=False, policy="off", nan_policy="skip")
    trainer = NativeLoraTrainer(model=model, args=args,
                                train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                                data_collator=default_data_collator, callbacks=[callback])
    trainer.train()
    state = fp8_scaling_state(model)
    assert state.steps == 4 and callback.nonfinite_steps == 1
    assert state.nonfinite_steps.sum() > 0 and torch.isfinite(state.scale).all()
    assert all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_compiled_layers_match_eager_and_record_both_amaxes():
    """Under torch.compile the fp8 layers are custom ops; the dy amax is recorded in the compiled backward."""
    from peft import get_peft_model

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 32)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    eager = get_peft_model(Two(), SitsLoraConfig(r=8, target_modules=["a", "b"], fp8="hybrid", fp8_emulate=True))
    randomize_lora_weights(eager)
    other = copy.deepcopy(eager)
    compiled = torch.compile(other)
    eager.train()
    other.train()
    for _ in range(3):  # current scaling, then delayed twice (one recompile for the switch, none after)
        x = torch.randn(8, 64, requires_grad=True)
        y1 = eager(x)
        (g1,) = torch.autograd.grad(y1.sum(), x)
        y2 = compiled(x)
        (g2,) = torch.autograd.grad(y2.sum(), x)
        torch.testing.assert_close(y2, y1, rtol=0, atol=0)
        torch.testing.assert_close(g2, g1, rtol=0, atol=0)
        s1, s2 = fp8_scaling_state(eager), fp8_scaling_state(other)
        assert (s2.amax > 0).all()
        torch.testing.assert_close(s2.amax, s1.amax, rtol=0, atol=0)
        update_scaling(eager)
        update_scaling(other)


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("storage", [torch.uint8, F.E4M3], ids=["bytes", "float8"])
def test_weights_quantized_once_memory_and_dtype_casts(storage, monkeypatch):
    """The codes are stored as their bytes where FSDP2 shards integer parameters (what casts floating-point
    parameters, FSDP2's policy included, skips them), else as float8; either way a cast of the model moves them and
    keeps their scale fp32, and the layer reads e4m3 without a copy."""
    import sits_lora.bases.fp8 as fp8_base

    monkeypatch.setattr(fp8_base, "codes_storage_dtype", lambda: storage)
    model = fp8_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base = layer.base_layer
    assert isinstance(base, Fp8BaseLinear) and base.weight.dtype == storage and base.codes.dtype == F.E4M3
    assert not base.weight.requires_grad and base.codes.data_ptr() == base.weight.data_ptr()
    report = frozen_weight_memory(model)
    assert report["layers"] == 14 and report["ratio"] <= 0.55
    codes = base.weight.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m._apply(lambda t: t.float())):
        cast(model)   # must move, never cast, the codes (a cast would drop their scale), and keep the scale fp32
        assert base.weight.dtype == storage and torch.equal(base.weight.view(torch.uint8), codes.view(torch.uint8))
        assert base.weight_scale_inv.dtype == torch.float32
    kept = fp8_model(fp8_keep_bf16_weight=True)
    assert frozen_weight_memory(kept)["ratio"] > 1.0


@pytest.mark.parametrize("storage", [torch.uint8, F.E4M3], ids=["bytes", "float8"])
def test_ddp_leaves_out_the_codes_and_the_scaling_state_once_each(storage, monkeypatch):
    """DistributedDataParallel reads the names to skip from the wrapped module: every rank built the same codes
    (no broadcast at start-up; gloo cannot send float8) and keeps its own running amax."""
    import sits_lora.bases.fp8 as fp8_base

    monkeypatch.setattr(fp8_base, "codes_storage_dtype", lambda: storage)
    model = fp8_model()
    ignored = model._ddp_params_and_buffers_to_ignore
    assert len(ignored) == len(set(ignored))
    codes = [name for name, m in model.named_modules() if isinstance(m, Fp8BaseLinear)]
    assert len(codes) == 14 and all(f"{name}.weight" in ignored for name in codes)
    assert {"sits_fp8.amax", "base_model.sits_fp8.amax"} <= set(ignored)   # under the tuner's root and PeftModel's
    assert not [name for name in ignored if "lora_" in name]


def _shard_a_byte_parameter(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = nn.Linear(4, 4)
    module.weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.uint8), requires_grad=False)
    fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
    return "sharded"


def test_this_torch_stores_the_codes_as_fsdp2_allows():
    """Bytes where fully_shard takes a frozen uint8 parameter (torch 2.13), float8 where it stops on one (torch 2.11:
    "only Tensors of floating point dtype can require gradients"): the source check agrees with fully_shard itself."""
    from conftest import on_gloo_ranks

    from sits_lora.bases.fp8 import codes_storage_dtype
    from sits_lora.utils.distributed import fsdp2_shards_integer_parameters

    (outcome,) = on_gloo_ranks(_shard_a_byte_parameter, world=1)
    if "NotImplementedError" in outcome:
        pytest.skip(f"FSDP2 on the CPU is not supported by this torch: {outcome[:200]}")
    assert fsdp2_shards_integer_parameters() == (outcome == "sharded"), outcome
    assert codes_storage_dtype() == (torch.uint8 if outcome == "sharded" else F.E4M3)


@pytest.mark.parametrize("saved_as,loaded_as", [(F.E4M3, torch.uint8), (torch.uint8, F.E4M3)],
                         ids=["float8-into-bytes", "bytes-into-float8"])
def test_codes_saved_in_the_other_storage_load_bit_for_bit(saved_as, loaded_as, monkeypatch):
    """A state dict written under one storage of the codes (another torch, or another tool's float8 codes) loads
    into the other bit for bit: a copy across uint8 and float8 would convert values."""
    import sits_lora.bases.fp8 as fp8_base

    monkeypatch.setattr(fp8_base, "codes_storage_dtype", lambda: saved_as)
    model = fp8_model(seed=0)
    monkeypatch.setattr(fp8_base, "codes_storage_dtype", lambda: loaded_as)
    other = fp8_model(seed=1)
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    loaded = other.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert base.weight.dtype == saved_as and loaded.weight.dtype == loaded_as
    assert not torch.equal(loaded.codes.view(torch.uint8), base.codes.view(torch.uint8))   # the seeds differ
    other.load_state_dict(model.state_dict())
    assert loaded.weight.dtype == loaded_as
    assert torch.equal(loaded.codes.view(torch.uint8), base.codes.view(torch.uint8))


def test_the_memory_plan_probes_the_fp8_layers_and_leaves_their_scaling_state_as_it_was():
    """plan_memory runs each distinct adapted layer once in training mode, which records amax into the fp8 scaling
    state: the probe puts the state back (a resumed run planned at its start kept a probe's amax in its next
    step's scales); the layers are probed in the dtype they receive (the weight's before quantization)."""
    from sits_lora.training import plan_memory

    model = fp8_model()
    train_steps(model, steps=2)
    state = fp8_scaling_state(model)
    state.amax.add_(0.25)    # a step in progress: its running amax must survive the plan too
    before = {name: buffer.clone() for name, buffer in state.named_buffers()}
    plan = plan_memory(model, 2, 16)
    assert not [note for note in plan.notes if "probed" in note], plan.notes
    assert plan.activation_dtype == "float32"   # fp8_llama is fp32: the codes' byte is not the residual stream's
    for name, buffer in state.named_buffers():
        assert torch.equal(buffer, before[name]), name


def test_state_is_one_stacked_module_found_by_the_callback():
    model = fp8_model()
    state = fp8_scaling_state(model)
    hooks = [m for m in model.modules() if callable(getattr(m, "sits_after_optimizer_step", None))]
    assert hooks == [state] and state.amax.shape == (14, 2) and state.amax_history.shape == (1024, 14, 2)
    assert "sits_fp8" not in str(list(model.state_dict()))  # not saved with the model
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.sibling_group is not None and q.sibling_group._plan(torch.randn(2, 64)) is None


def test_training_runs_and_first_step_uses_current_scaling():
    model = fp8_model()
    state = fp8_scaling_state(model)
    losses = train_steps(model, steps=3)
    assert all(torch.isfinite(torch.tensor(losses))) and state.steps == 3
    assert (state.scale[:, 0] != 1).all()      # every layer's input scale came from recorded amaxes
    assert state.nonfinite_steps.sum() == 0


def test_fp8_training_tracks_bf16_training():
    from peft import get_peft_model

    fp8 = fp8_model()
    bf16 = get_peft_model(fp8_llama(), SitsLoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, kernel="torch"))
    randomize_lora_weights(bf16, seed=1)
    a, b = train_steps(fp8, steps=3), train_steps(bf16, steps=3)
    assert abs(a[-1] - b[-1]) / b[-1] < 0.01


def test_merge_and_unload_dequantize():
    model = fp8_model()
    train_steps(model, steps=2)
    model.eval()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        fp8_logits = model(input_ids=ids).logits
    merged = copy.deepcopy(model).merge_and_unload()
    q = merged.model.layers[0].self_attn.q_proj
    assert type(q) is nn.Linear and q.weight.dtype == torch.float32
    with torch.no_grad():
        assert sqnr(fp8_logits, merged(input_ids=ids).logits) >= 20   # only the activation casts differ
    plain = copy.deepcopy(model)
    plain.merge_adapter()
    assert plain.base_model.model.model.layers[0].self_attn.q_proj.merged
    with torch.no_grad():
        assert sqnr(fp8_logits, plain(input_ids=ids).logits) >= 20
    assert not any(isinstance(m, Fp8ScalingState) for m in plain.modules())


def _frozen_bases(model) -> dict:
    """{layer name: (base module class, frozen base class, its scaling state or None)} of every SitsLoraLinear."""
    from sits_lora import SitsLoraLinear

    return {name: (type(m.base_layer).__name__, type(m.frozen_base).__name__, getattr(m.frozen_base, "state", None))
            for name, m in model.named_modules() if isinstance(m, SitsLoraLinear)}


def test_each_layer_runs_the_fused_path_of_the_base_it_holds():
    """A layer whose base is an Fp8BaseLinear has an Fp8Base pointing at the model's own scaling state, every
    other layer the bf16 base; this holds after a second adapter, a deletion, a deep copy and a merge."""
    from peft import get_peft_model

    model = get_peft_model(fp8_llama(), SitsLoraConfig(r=8, target_modules=["q_proj", "down_proj"], fp8="hybrid",
                                                       fp8_emulate=True))

    def check(m, fp8_layers: int):
        bases = _frozen_bases(m)
        state = next((x for x in m.modules() if isinstance(x, Fp8ScalingState)), None)
        fp8 = [n for n, (module, base, owner) in bases.items() if module == "Fp8BaseLinear"]
        assert len(fp8) == fp8_layers
        for name, (module, base, owner) in bases.items():
            assert (module, base) in (("Fp8BaseLinear", "Fp8Base"), ("Linear", "Bf16Base")), name
            assert owner is (state if module == "Fp8BaseLinear" else None), name

    check(model, 4)
    model.add_adapter("second", SitsLoraConfig(r=4, target_modules=["q_proj", "down_proj"], fp8="hybrid",
                                               fp8_emulate=True))
    check(model, 4)
    model.delete_adapter("second")
    check(model, 4)
    twin = copy.deepcopy(model)
    check(twin, 4)  # the copy's layers read the copy's scaling state, not the original's
    twin.merge_adapter()
    check(twin, 0)
    check(model, 4)


def test_keep_bf16_weight_merges_exactly():
    base = fp8_llama()
    original = base.model.layers[0].mlp.down_proj.weight.detach().clone()
    from peft import get_peft_model

    model = get_peft_model(base, SitsLoraConfig(r=8, target_modules=TARGETS, fp8="hybrid", fp8_emulate=True,
                                                fp8_keep_bf16_weight=True))
    unloaded = model.unload()    # lora_B is zero: the original weight must come back bit for bit
    assert torch.equal(unloaded.model.layers[0].mlp.down_proj.weight, original)


def test_save_load_into_bf16_base_and_into_fp8_base(tmp_path):
    from peft import PeftModel

    model = fp8_model()
    train_steps(model, steps=2)
    model.eval()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k}

    again = PeftModel.from_pretrained(fp8_llama(), tmp_path)          # fp8 base, quantized the same way
    assert isinstance(again.base_model.model.model.layers[0].self_attn.q_proj.base_layer, Fp8BaseLinear)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=0, atol=0)

    config = without_fp8(SitsLoraConfig.from_pretrained(tmp_path))
    assert config.fp8 == "off" and not config.fp8_emulate and config.r == 8
    plain = PeftModel.from_pretrained(fp8_llama(), tmp_path, config=config)   # bf16 base
    assert type(plain.base_model.model.model.layers[0].self_attn.q_proj.base_layer) is nn.Linear
    for k, v in plain.state_dict().items():
        if "lora_" in k:
            torch.testing.assert_close(v, trained[k], rtol=0, atol=0)
    with torch.no_grad():
        assert sqnr(want, plain(input_ids=ids).logits) >= 20

    path = sits_lora.export_peft_lora(model, tmp_path / "plain")
    import json

    saved = json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and not any(k.startswith("fp8") for k in saved)
    assert os.path.exists(os.path.join(path, "adapter_model.safetensors"))


def test_generate_and_disabled_adapter_on_cpu():
    model = fp8_model()
    model.eval()
    ids = torch.randint(0, 97, (1, 5))
    out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)
    with model.disable_adapter(), torch.no_grad():   # PEFT's path: Fp8BaseLinear's own forward
        base_logits = model(input_ids=ids).logits
    assert torch.isfinite(base_logits).all()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, needle", [
    (dict(fp8="fp8"), "SitsLoraConfig.fp8='fp8' is invalid: allowed values are 'off', 'hybrid', 'e4m3'"),
    (dict(fp8="hybrid", fp8_amax_history_len=0), "fp8_amax_history_len=0 is invalid: it must be a positive integer"),
    (dict(fp8="hybrid", fp8_amax_history_len=2.5), "fp8_amax_history_len=2.5 is invalid"),
    (dict(fp8="hybrid", fp8_amax_compute_algo="mean"),
     "fp8_amax_compute_algo='mean' is invalid: allowed values are 'max'"),
    (dict(fp8="hybrid", fp8_margin=-1), "fp8_margin=-1 is invalid: it must be a non-negative integer"),
    (dict(fp8="hybrid", fp8_margin=0.5), "fp8_margin=0.5 is invalid"),
    (dict(fp8="hybrid", fp8_weight_scale="block"),
     "fp8_weight_scale='block' is invalid: allowed values are 'tensor', 'row'"),
    (dict(fp8="hybrid", fp8_keep_bf16_weight="yes"), "fp8_keep_bf16_weight='yes' is invalid: it must be True or False"),
    (dict(fp8="hybrid", fp8_emulate=1), "fp8_emulate=1 is invalid: it must be True or False"),
    (dict(fp8_margin=2), "fp8_margin=2 only apply with fp8 on, but fp8='off'"),
    (dict(fp8_emulate=True), "fp8_emulate=True only apply with fp8 on"),
    (dict(fp8="hybrid", use_dora=True), "cannot be combined with use_dora=True"),
    (dict(fp8="hybrid", use_dynamic_rank=True, r=32, rank_scheduler="static"),
     "cannot be combined with use_dynamic_rank=True"),
    (dict(fp8="hybrid", fp8_emulate=True, kernel="triton"), "kernel='triton' asks for the Triton kernels"),
    (dict(fp8="e4m3", kernel="torch"), "kernel='torch' asks for the plain PyTorch reference"),
])
def test_bad_config_is_named(kwargs, needle):
    kwargs = {"r": 8, **kwargs}
    with pytest.raises(ValueError) as info:
        SitsLoraConfig(target_modules=["q_proj"], **kwargs)
    assert needle in str(info.value)


def _has_lora(model) -> bool:
    return any("lora_" in n for n, _ in model.named_parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_no_gpu_without_emulation_is_refused_before_injection():
    from peft import get_peft_model

    base = fp8_llama()
    with pytest.raises(Fp8UnsupportedError, match="compute capability 8.9 or newer.*no CUDA GPU.*fp8_emulate=True"):
        get_peft_model(base, SitsLoraConfig(r=8, target_modules=TARGETS, fp8="hybrid"))
    assert not _has_lora(base)


def test_emulated_layer_moved_to_cpu_input_runs_and_gpu_path_refuses_cpu_input():
    model = fp8_model()
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    base.fp8_emulate = False
    with pytest.raises(Fp8UnsupportedError, match="the input is on cpu"):
        base(torch.randn(2, 64))


def test_odd_shapes_and_non_linear_targets_are_refused_before_injection():
    from peft import get_peft_model

    from conftest import tiny_llama, tiny_mlp

    base = tiny_llama()   # k_proj / v_proj write 24 features
    with pytest.raises(ValueError, match=r"multiples of 16.*k_proj \(48 x 24\).*exclude_modules"):
        get_peft_model(base, SitsLoraConfig(r=4, target_modules=["k_proj", "q_proj"], fp8="hybrid", fp8_emulate=True))
    assert not _has_lora(base)
    mlp = tiny_mlp()
    with pytest.raises(ValueError, match="multiples of 16"):
        get_peft_model(mlp, SitsLoraConfig(r=4, target_modules=["lin0"], fp8="hybrid", fp8_emulate=True))
    emb = fp8_llama()
    with pytest.raises(ValueError, match=r"quantizes torch.nn.Linear base layers only.*embed_tokens \(Embedding\)"):
        get_peft_model(emb, SitsLoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], fp8="hybrid",
                                           fp8_emulate=True))
    assert not _has_lora(emb)


def test_adapters_must_agree_on_the_fp8_base():
    model = fp8_model()
    with pytest.raises(ValueError, match=r"disagree on the fp8 base \(fp8: 'hybrid' vs 'off'"):
        model.add_adapter("second", SitsLoraConfig(r=4, target_modules=["q_proj"]))
    assert "second" not in model.peft_config and not any(".second." in n for n, _ in model.named_parameters())


def test_scales_handed_to_cublas_are_16_byte_aligned():
    """cuBLAS under CUDA 13 refuses fp8 GEMMs with a scale at a 4- or 8-byte offset (H200, measured):
    a layer's row of the batched (L, 2) state is copied, an aligned scale is passed as it is."""
    from sits_lora.ops.fp8 import _cublas_scale

    state = torch.arange(1.0, 9.0).reshape(4, 2)
    for row in range(4):
        for slot in range(2):
            view = state[row][slot:slot + 1]
            got = _cublas_scale(view)
            assert got.data_ptr() % 16 == 0 and float(got) == float(view)
            assert (got is view) == (view.data_ptr() % 16 == 0)


def test_every_layer_scale_of_the_state_is_16_byte_aligned_without_a_copy():
    state = _state(names=[f"l{i}" for i in range(5)])
    state.amax.copy_(torch.rand(5, 2) + 0.5)
    state.update()
    for index in range(5):
        scale_inv = state.scales_for(index, training=True)["scale_inv"]
        for slot in range(2):
            view = scale_inv[slot:slot + 1]
            assert view.data_ptr() % 16 == 0
            assert float(view) == pytest.approx(1.0 / float(state.scale[index, slot]))
    moved = copy.deepcopy(state).to(torch.float32)  # a moved module keeps the layout (the property views its buffer)
    assert moved.scale_inv.stride() == (8, 4) and torch.equal(moved.scale_inv, state.scale_inv)


def test_backward_op_outputs_never_alias_each_other():
    """Without dx and dx_lora both were the same empty tensor, which torch.compile rejects."""
    from sits_lora.ops.fp8 import _fp8_lora_linear_backward_op, quantize_weight

    T, K, N, R = 6, 32, 16, 4
    w8, w_inv = quantize_weight(torch.randn(N, K), "tensor")
    out = _fp8_lora_linear_backward_op(
        torch.randn(T, N), torch.randn(T, K), None, torch.randn(R, K), torch.randn(N, R), w8, w_inv,
        torch.randn(T, R), 1.0, torch.ones(2), torch.ones(2), False, 0, True, True, False)
    dx, dx_lora, dA, dB, seen = out
    assert dx.numel() == 0 and dx_lora.numel() == 0 and dA.shape == (R, K) and dB.shape == (N, R)
    assert len({t.untyped_storage().data_ptr() for t in out if t.numel()}) == 3
    assert dx is not dx_lora


def test_fp8_summary_reports_failed_arms_next_to_measured_ones(tmp_path, capsys):
    """bench/fp8_summary.py on the files of a run where the fp8 arms failed (as the first H200 run's did)."""
    import json

    from conftest import bench_module

    fp8_summary = bench_module("fp8_summary")

    layer = [{"d_in": 64, "d_out": 96, "r": 16, "arm": "frozen", "full_ms": 1.0, "vs_frozen": 1.0},
             {"d_in": 64, "d_out": 96, "r": 16, "arm": "sits:fp8",
              "error": "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"}]
    model = [{"arm": "frozen", "step_s": 0.57}, {"arm": "frozen+compile", "step_s": 0.52},
             {"arm": "sits+fp8", "step_s": 0.40}, {"arm": "sits+fp8+compile", "error": "RuntimeError: alias"},
             {"arm": "frozen+liger", "step_s": 0.45}, {"arm": "sits+fp8+liger", "step_s": 0.38}]
    for name, rows in (("layer.json", layer), ("model_8b.json", model)):
        (tmp_path / name).write_text(json.dumps({"rows": rows}))
    summary = fp8_summary.summarize(str(tmp_path))
    assert summary["layers"][0]["sits:fp8_error"].startswith("RuntimeError")
    assert summary["model"]["floor"] == {"arm": "frozen+compile", "step_s": 0.52}
    assert summary["model"]["sits+fp8"]["vs_floor"] == pytest.approx(0.40 / 0.52)
    assert summary["model"]["sits+fp8"]["meets_0.80"] is True
    assert summary["model"]["sits+fp8+compile"] == {"error": "RuntimeError: alias"}
    # frozen+liger is reported, not taken as the floor; the Liger fp8 arm is given against both
    assert summary["model"]["frozen+liger"]["vs_floor"] == pytest.approx(0.45 / 0.52)
    assert summary["model"]["sits+fp8+liger"]["vs_floor"] == pytest.approx(0.38 / 0.52)
    assert summary["model"]["sits+fp8+liger"]["vs_liger_floor"] == pytest.approx(0.38 / 0.45)
    assert "vs_liger_floor" not in summary["model"]["sits+fp8"]
    assert fp8_summary.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "sits:fp8 FAILED: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED" in printed
    assert "8B sits+fp8: 400.0 ms/step = 0.769x the floor (target <= 0.8: met)" in printed
    assert "8B frozen+liger (not the issue's floor): 450.0 ms/step = 0.865x" in printed
    assert "0.844x the frozen model with Liger" in printed
    assert json.loads((tmp_path / "fp8_summary.json").read_text()) == json.loads(json.dumps(summary))


@pytest.mark.slow
def test_fp8_gemms_bench_script_runs_and_its_triton_candidate_agrees(tmp_path):
    """bench/fp8_gemms.py --smoke on the CPU (interpreter): every row, and the Triton fp8 GEMM equal to
    torch._scaled_mm within bf16 rounding in both directions."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the smoke run uses the interpreter; the GPU run is bench/fp8_gemms.py itself")
    import json

    from conftest import bench_module

    # the script's main in this process (TRITON_INTERPRET=1 here, as the script asks): no python of its own to start
    assert bench_module("fp8_gemms").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fp8_gemms_smoke.json").read_text())["rows"]
    ops = {(r["direction"], r["op"]) for r in rows}
    assert ("dX", "fp8 e5m2 Triton, W8 as stored") in ops and ("dX", "transpose W8 (Triton)") in ops
    checked = [r["max_rel_diff_vs_scaled_mm"] for r in rows if r["max_rel_diff_vs_scaled_mm"] is not None]
    assert len(checked) == 4 and all(d < 1e-2 for d in checked)


@pytest.mark.slow
def test_profile_host_smoke_times_every_arm_and_writes_its_profiles(tmp_path, monkeypatch):
    """bench/profile_host.py --smoke on the CPU: a host time per layer arm and a cProfile table for each (its main
    in this process, with the command line it records)."""
    import json

    from conftest import bench_module

    argv = ["--smoke", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["bench/profile_host.py", *argv])
    assert bench_module("profile_host").main(argv) == 0
    report = json.loads((tmp_path / "host.json").read_text())
    assert set(report["layer_step_host_us"]) == {"frozen", "sits:cublas", "sits:fp8"}
    assert all(us > 0 for us in report["layer_step_host_us"].values())
    assert "launcher_host_us" not in report  # the launchers need a GPU
    table = (tmp_path / "host_profile.txt").read_text()
    assert all(f"== {arm}:" in table for arm in report["layer_step_host_us"]) and "tottime" in table
