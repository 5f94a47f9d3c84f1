"""INT4 frozen base on the CPU: the packed format, the Triton dequant-GEMMs under the interpreter against the
PyTorch reference (fp32 / fp16, odd shapes, every gradient), the model-level feature (quantize at injection,
fused path against the reference, merge / unload / export / save / load) and the config errors."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from peft import PeftModel, get_peft_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from conftest import randomize_lora_weights, rel_err, tiny_llama  # noqa: E402

from sits_lora import SitsLoraConfig, export_peft_lora  # noqa: E402
from sits_lora.activations import input_recompute_report  # noqa: E402
from sits_lora.bases.int4 import Int4BaseLinear  # noqa: E402
from sits_lora.int4 import int4_weight_memory  # noqa: E402
from sits_lora.ops import int4_linear as Q  # noqa: E402
from sits_lora.training import plan_memory  # noqa: E402
from sits_lora.training.constraints import check_int4  # noqa: E402

# (out_features, in_features, group size): odd row counts, a padded row (96 features: 48 bytes -> 64), groups
# of 32 / 64 / 128
SHAPES = [(40, 96, 32), (17, 256, 64), (33, 128, 128)]


def _llama(seed=0):
    # in_features 64 and 96: multiples of the group size 32
    return tiny_llama(seed, hidden_size=64, intermediate_size=96)


def _int4_config(**kw):
    kw.setdefault("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    kw.setdefault("int4_group_size", 32)
    return SitsLoraConfig(r=8, lora_alpha=16, base_quant="int4", **kw)


# ----------------------------------------------------------------------------- the format


@pytest.mark.parametrize("N,K,G", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trip_error_is_at_most_half_a_step(N, K, G, dtype):
    torch.manual_seed(0)
    w = torch.randn(N, K).to(dtype)
    packed, scales, mins = Q.int4_pack(w, G)
    assert scales.dtype == dtype and mins.dtype == dtype
    back = Q.int4_unpack_reference(packed, scales, mins, K, torch.float32)
    step = scales.float().repeat_interleave(G, dim=1)[:, :K]
    # round to nearest code: half a step, plus the rounding of the stored scale / min (bf16: 2**-8 relative)
    slack = 1e-6 if dtype == torch.float32 else 2**-7 * (w.float().abs() + 16 * step)
    assert ((back - w.float()).abs() <= step / 2 + slack).all()


def test_a_constant_group_decodes_exactly_and_codes_use_the_full_range():
    w = torch.full((4, 64), 0.75)
    w[1] = torch.linspace(-1, 2, 64)
    packed, scales, mins = Q.int4_pack(w, 32, torch.float32)
    back = Q.int4_unpack_reference(packed, scales, mins, 64)
    assert torch.equal(back[0], w[0]) and scales[0].eq(0).all()
    codes = torch.stack((packed[1] & 0xF, packed[1] >> 4), dim=-1).reshape(-1)
    assert codes.min() == 0 and codes.max() == 15


@pytest.mark.parametrize("K", [64, 96, 160, 4096])
def test_every_packed_row_is_32_byte_aligned(K):
    packed, _, _ = Q.int4_pack(torch.randn(3, K), 32)
    row_bytes = packed.stride(0) * packed.element_size()
    assert row_bytes % Q.ROW_ALIGN_BYTES == 0 and row_bytes >= K // 2
    assert all((packed[i].data_ptr() - packed.data_ptr()) % 32 == 0 for i in range(3))
    assert packed.data_ptr() % 32 == 0


def test_pack_refuses_a_group_size_that_does_not_divide_the_row():
    with pytest.raises(ValueError, match="in_features=96 is not a multiple of the group size 64"):
        Q.int4_pack(torch.randn(4, 96), 64)
    with pytest.raises(ValueError, match="power of two"):
        Q.int4_pack(torch.randn(4, 96), 48)


# ----------------------------------------------------------------------------- the kernels (interpreter)


@pytest.mark.parametrize("N,K,G", SHAPES)
def test_dequantize_kernel_equals_the_reference(N, K, G):
    torch.manual_seed(1)
    packed, scales, mins = Q.int4_pack(torch.randn(N, K), G, torch.float32)
    out = torch.empty(N, K)
    assert torch.equal(Q.int4_dequantize(packed, scales, mins, K, out), Q.int4_unpack_reference(packed, scales, mins, K))


@pytest.mark.parametrize("N,K,G", SHAPES)
@pytest.mark.parametrize("M", [1, 5, 37])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_fused_dequant_gemm_matches_the_reference(N, K, G, M, dtype, tol):
    torch.manual_seed(2)
    packed, scales, mins = Q.int4_pack(torch.randn(N, K), G, dtype)
    w = Q.int4_unpack_reference(packed, scales, mins, K, torch.float32)
    x, dy = torch.randn(M, K).to(dtype), torch.randn(M, N).to(dtype)
    assert rel_err(Q.int4_matmul(x, packed, scales, mins, K), x.float() @ w.t()) < tol
    assert rel_err(Q.int4_matmul(dy, packed, scales, mins, K, transposed=True), dy.float() @ w) < tol
    base = torch.randn(M, N).to(dtype)
    summed = Q.int4_matmul(x, packed, scales, mins, K, out=base.clone())
    assert rel_err(summed, base.float() + x.float() @ w.t()) < tol


@pytest.mark.parametrize("mode", ["fused", "dequant"])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_lora_op_forward_and_every_gradient_match_the_reference(mode, dropout, bias):
    torch.manual_seed(3)
    N, K, G, r, T = 40, 96, 32, 6, 13
    packed, scales, mins = Q.int4_pack(torch.randn(N, K), G, torch.float32)

    def inputs():
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(2, T, K, generator=gen).requires_grad_()
        x_lora = (x * (torch.rand(2, T, K, generator=gen) > 0.3) / 0.7) if dropout else x
        A = (torch.randn(r, K, generator=gen) * 0.1).requires_grad_()
        B = (torch.randn(N, r, generator=gen) * 0.1).requires_grad_()
        b = torch.randn(N, generator=gen) if bias else None
        return x, x_lora, A, B, b

    outs = []
    for kernel in ("torch", "triton"):
        x, x_lora, A, B, b = inputs()
        y = Q.int4_lora_linear(x, x_lora, A, B, b, packed, scales, mins, K, 2.0, kernel, mode)
        y.backward(torch.ones_like(y) * torch.linspace(-1, 1, N))
        outs.append((y.detach(), x.grad, A.grad, B.grad))
    for ref, got in zip(outs[0], outs[1]):
        assert rel_err(got, ref) < 1e-5


def test_base_alone_and_its_input_gradient():
    torch.manual_seed(5)
    packed, scales, mins = Q.int4_pack(torch.randn(24, 64), 32, torch.float32)
    w = Q.int4_unpack_reference(packed, scales, mins, 64)
    for mode in ("fused", "dequant"):
        x = torch.randn(3, 64, requires_grad=True)
        y = Q.int4_lora_linear(x, None, None, None, None, packed, scales, mins, 64, 0.0, "triton", mode)
        y.sum().backward()
        assert rel_err(y, x.detach() @ w.t()) < 1e-5
        assert rel_err(x.grad, w.sum(0).expand(3, 64)) < 1e-5


# ----------------------------------------------------------------------------- the model


def test_injection_quantizes_every_target_and_the_fused_path_matches_the_reference():
    base = _llama()
    ids = torch.randint(0, 97, (2, 9))
    results = {}
    for kernel in ("torch", "triton"):
        model = get_peft_model(copy.deepcopy(base), _int4_config(kernel=kernel))
        randomize_lora_weights(model)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[kernel] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    layers = [m for m in model.modules() if isinstance(m, Int4BaseLinear)]
    assert len(layers) == 14  # 7 projections x 2 layers
    ref_loss, ref_grads = results["torch"]
    loss, grads = results["triton"]
    assert rel_err(loss, ref_loss) < 1e-5
    assert set(grads) == set(ref_grads) and len(grads) == 28
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-4, name


def test_int4_weights_hold_about_a_quarter_of_the_bf16_bytes():
    model = get_peft_model(_llama().to(torch.bfloat16), _int4_config(int4_group_size=32))
    memory = int4_weight_memory(model)
    assert memory["int4_layers"] == memory["layers"] == 14
    # per row: Kp / 2 bytes of codes (Kp = in_features padded to 64) and a bf16 scale and min per 32 features
    stored = bf16 = 0
    for m in model.modules():
        if isinstance(m, Int4BaseLinear):
            kp = -(-m.in_features // 64) * 64
            stored += m.out_features * (kp // 2 + 2 * 2 * kp // 32)
            bf16 += 2 * m.out_features * m.in_features
    assert memory["stored_bytes"] == stored and memory["bf16_bytes"] == bf16
    assert 0.3 < memory["ratio"] < 0.34  # down_proj's 96 features pad to 128; 0.27 at 4096 features, group 128


def test_outputs_stay_close_to_the_dense_model():
    base = _llama()
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        dense = base(input_ids=ids).logits
        model = get_peft_model(copy.deepcopy(base), _int4_config())
        quantized = model(input_ids=ids).logits  # B = 0: the base alone, quantized
    # Gaussian weights over 32-wide groups span ~4.5 std: a step of 0.3 std, a uniform rounding error of
    # 0.09 std per weight; the logits carry about that relative error, and a broken code layout gives ~1.4
    assert 0 < rel_err(quantized, dense) < 0.2


def test_disabled_adapter_runs_the_int4_base_alone():
    model = get_peft_model(_llama(), _int4_config())
    randomize_lora_weights(model)
    ids = torch.randint(0, 97, (1, 8))
    dense = copy.deepcopy(model).unload()  # dense layers holding the dequantized weights
    with torch.no_grad(), model.disable_adapter():
        off = model(input_ids=ids).logits
    with torch.no_grad():
        assert rel_err(off, dense(input_ids=ids).logits) < 1e-5
        assert rel_err(model(input_ids=ids).logits, off) > 1e-3  # the adapter does something when on


def test_merge_and_unload_export_and_stock_peft_give_the_same_outputs(tmp_path):
    model = get_peft_model(_llama(), _int4_config())
    randomize_lora_weights(model)
    ids = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_peft_lora(model, tmp_path / "plain")
    dense_base = copy.deepcopy(model).unload()  # the dequantized base, as stock PEFT would see it
    merged = copy.deepcopy(model).merge_and_unload()
    assert not any(isinstance(m, Int4BaseLinear) for m in merged.modules())
    stock = PeftModel.from_pretrained(dense_base, tmp_path / "plain")
    assert type(stock.peft_config["default"]).__name__ == "LoraConfig"
    with torch.no_grad():
        assert rel_err(merged(input_ids=ids).logits, expected) < 1e-5
        assert rel_err(stock(input_ids=ids).logits, expected) < 1e-5


def test_save_and_load_quantize_again_with_the_same_outputs(tmp_path):
    base = _llama()
    model = get_peft_model(copy.deepcopy(base), _int4_config())
    randomize_lora_weights(model)
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    assert sum(isinstance(m, Int4BaseLinear) for m in loaded.modules()) == 14
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)


def test_module_to_moves_codes_but_never_casts_them():
    model = get_peft_model(_llama(), _int4_config())
    model.to(torch.float16)
    layer = next(m for m in model.modules() if isinstance(m, Int4BaseLinear))
    assert layer.weight.dtype == torch.uint8 and layer.weight_scales.dtype == torch.float16


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("kwargs,match", [
    (dict(base_quant="nf4"), "base_quant='nf4' is invalid"),
    (dict(base_quant="int4", int4_group_size=48), "int4_group_size=48 is invalid: it must be a power of two"),
    (dict(int4_group_size=64), "only applies with base_quant='int4'"),
    (dict(base_quant="int4", fp8="hybrid", fp8_emulate=True), "cannot be combined with fp8='hybrid'"),
    (dict(base_quant="int4", use_dora=True), "cannot be combined with use_dora=True"),
])
def test_bad_configs_name_the_field_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SitsLoraConfig(r=4, target_modules=["q_proj"], **kwargs)


def test_a_group_size_that_does_not_divide_a_layer_fails_before_the_model_changes():
    model = _llama()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"int4_group_size=128 does not divide .*in_features=64.*exclude_modules"):
        get_peft_model(model, _int4_config(int4_group_size=128))
    assert not any("lora_" in n for n, _ in model.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_non_linear_target_is_refused_by_name():
    with pytest.raises(ValueError, match=r"quantizes torch.nn.Linear base layers only.*embed_tokens \(Embedding\)"):
        get_peft_model(_llama(), _int4_config(target_modules=["q_proj", "embed_tokens"]))


def test_adapters_of_one_model_must_share_the_base_setting():
    model = get_peft_model(_llama(), _int4_config())
    with pytest.raises(ValueError, match="disagree on the 4-bit base"):
        model.add_adapter("other", SitsLoraConfig(r=4, target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, Int4BaseLinear) and "other" not in layer.lora_A


def test_the_memory_plan_counts_the_packed_weights_and_one_dequantization_buffer():
    dense = get_peft_model(_llama(), SitsLoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"]))
    quantized = get_peft_model(_llama(), _int4_config(target_modules=["q_proj", "down_proj"]))
    plan_dense, plan_int4 = plan_memory(dense, 2, 16), plan_memory(quantized, 2, 16)
    packed = sum(m.packed_bytes() for m in quantized.modules() if isinstance(m, Int4BaseLinear))
    dense_bytes = sum(m.base_layer.weight.numel() * 4 for m in dense.modules() if hasattr(m, "lora_A"))
    largest = max(m.in_features * m.out_features * 4 for m in quantized.modules() if isinstance(m, Int4BaseLinear))
    assert plan_int4.frozen_weights == plan_dense.frozen_weights - dense_bytes + packed + largest


def test_the_guard_rails_check_the_int4_rows_and_name_a_misaligned_layer():
    model = get_peft_model(_llama(), _int4_config(target_modules=["q_proj", "down_proj"]))
    result = check_int4(model)
    assert result.status == "ok" and result.details["layers_checked"] == 4
    layer = next(m for m in model.modules() if isinstance(m, Int4BaseLinear))
    shifted = torch.empty(layer.weight.numel() + 8, dtype=torch.uint8)[8:].view_as(layer.weight)
    shifted.copy_(layer.weight)
    layer.weight.data = shifted  # a view 8 bytes into its buffer
    result = check_int4(model)
    assert result.status == "violated" and "byte offset 8 mod 32" in result.details["problems"][0]


def test_rebuilt_lora_inputs_work_on_the_int4_base_and_change_no_gradient():
    base = _llama()
    ids = torch.randint(0, 97, (2, 9))
    grads = {}
    for rebuild in (True, False):
        model = get_peft_model(copy.deepcopy(base), _int4_config(kernel="triton", recompute_lora_inputs=rebuild))
        randomize_lora_weights(model)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[rebuild] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if rebuild:
            report = input_recompute_report(model)
            # as on the bf16 base: everything but the first layer's q / k / v (its norm reads the embeddings)
            assert sum(r["rebuilt"] for r in report) == 11 and sum(r["saved"] for r in report) == 3
    assert all(torch.equal(grads[True][n], grads[False][n]) for n in grads[True])


def test_a_trainable_base_bias_gets_its_gradient_on_both_paths():
    torch.manual_seed(6)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 40, bias=True))
    grads = {}
    x = torch.randn(5, 64)
    for kernel in ("torch", "triton"):
        model = get_peft_model(copy.deepcopy(layer), SitsLoraConfig(r=4, target_modules=["0"], base_quant="int4",
                                                                     int4_group_size=32, bias="all", kernel=kernel))
        randomize_lora_weights(model)
        model(x).square().sum().backward()
        grads[kernel] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.endswith("base_layer.bias") for n in grads["triton"])
    assert set(grads["triton"]) == set(grads["torch"])
    assert all(rel_err(grads["triton"][n], grads["torch"][n]) < 1e-5 for n in grads["torch"])


def test_an_fp32_model_with_a_bias_under_bf16_autocast_computes_in_bf16():
    torch.manual_seed(7)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 40, bias=True))
    model = get_peft_model(layer, SitsLoraConfig(r=4, target_modules=["0"], base_quant="int4", int4_group_size=32))
    randomize_lora_weights(model)
    x = torch.randn(3, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        with model.disable_adapter():
            base_only = model(x)
    assert y.dtype == torch.bfloat16 and base_only.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an input already in autocast's dtype stays in it
        assert model(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_the_reference_path_keeps_no_dense_weight_for_backward():
    model = get_peft_model(_llama(), _int4_config(kernel="torch", target_modules=["gate_proj"]))
    own = {p.data_ptr() for p in model.parameters()}  # unadapted layers save their (own) weights: not copies
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(input_ids=torch.randint(0, 97, (1, 6)), labels=torch.randint(0, 97, (1, 6))).loss
    dense = [t for t in saved if t.shape in ((96, 64), (64, 96)) and t.data_ptr() not in own]
    assert not dense  # gate_proj's dequantized W (out 96, in 64), or its transpose


def test_gradient_checkpointing_gives_the_same_gradients():
    base = _llama()
    ids = torch.randint(0, 97, (2, 9))
    grads = []
    for checkpointing in (False, True):
        model = get_peft_model(copy.deepcopy(base), _int4_config(kernel="triton"))
        randomize_lora_weights(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert all(rel_err(grads[1][n], grads[0][n]) < 1e-6 for n in grads[0])


def test_merge_adapter_says_the_base_stays_dense_and_unmerge_still_trains(caplog):
    model = get_peft_model(_llama(), _int4_config())
    randomize_lora_weights(model)
    ids = torch.randint(0, 97, (1, 8))
    with caplog.at_level("WARNING", logger="sits_lora"):
        model.merge_adapter()
    assert "gives the adapted layers back dense" in caplog.text
    assert not any(isinstance(m, Int4BaseLinear) for m in model.modules())
    model.unmerge_adapter()
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_auto_mode_fuses_only_few_tokens_on_rows_the_fused_kernel_handles():
    from sits_lora.ops.int4_linear import FUSED_MAX_IN_FEATURES, FUSED_MAX_TOKENS, resolve_mode

    assert resolve_mode("auto", FUSED_MAX_TOKENS, 4096) == "fused"
    assert resolve_mode("auto", FUSED_MAX_TOKENS + 1, 4096) == "dequant"          # a training batch
    assert resolve_mode("auto", 1, FUSED_MAX_IN_FEATURES * 2) == "dequant"         # down_proj of an 8B model
    assert resolve_mode("fused", 8192, 14336) == "fused" and resolve_mode("dequant", 1, 64) == "dequant"
    with pytest.raises(ValueError, match=r"int4_mode='fast' is invalid: allowed values are 'auto', 'dequant'"):
        resolve_mode("fast", 1, 64)
