"""NF4 / FP4 storage with fp8 compute: a bitsandbytes 4-bit layer under SitsLoraConfig(fp8=...).

The scaled dequantization (W · w_scale into either layout, fp8 or not) against its PyTorch reference, under the
interpreter and on a GPU; the layer in emulation against the fp8 base over the same dense values (the same W8, the
same scales: equal losses and gradients); what the model reports; merge and unload; on a GPU the torch._scaled_mm
path against the emulation at a Llama shape.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
bnb = pytest.importorskip("bitsandbytes")

from peft import get_peft_model  # noqa: E402
from transformers import BitsAndBytesConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from conftest import tiny_llama  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.bases.bnb4 import BNB4_BASE, dequantized_copy, layout_of  # noqa: E402
from sits_lora.fp8 import fp8_layer_plan, fp8_scaling_state, frozen_weight_memory  # noqa: E402
from sits_lora.ops import fp8 as F  # noqa: E402
from sits_lora.ops.bnb4_dequant import bnb4_dequantize_scaled, bnb4_dequantize_scaled_reference  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref = reference.float()
    return (10 * torch.log10(ref.pow(2).mean() / (ref - other.float()).pow(2).mean())).item()


def quantized(shape, nested, device="cpu", quant="nf4", blocksize=64):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(device)
    return bnb.functional.quantize_4bit(w, quant_type=quant, compress_statistics=nested, blocksize=blocksize)


@pytest.mark.skipif(not INTERPRETER, reason="the Triton kernel on a CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", [(33, 70), (48, 96), (5, 256)])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("row_scale", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
def test_scaled_dequantization_matches_its_reference_under_the_interpreter(shape, nested, row_scale, transpose):
    packed, state = quantized(shape, nested)
    layout = layout_of(state)
    w_scale = (torch.rand(shape[0]) + 0.5) if row_scale else torch.tensor([0.7])
    for dtype in (torch.float32, torch.float16):
        want = bnb4_dequantize_scaled_reference(packed, layout, shape, w_scale, dtype, transpose)
        got = bnb4_dequantize_scaled(packed, layout, shape, w_scale, torch.full(want.shape, float("nan"), dtype=dtype),
                                     transpose)
        assert torch.allclose(got.float(), want.float(), rtol=1e-6, atol=0)
    # into e4m3, saturating: the interpreter's fp8 rounding is not faithful (the GPU test checks it bit for bit), so
    # here a loose SQNR (a wrong scale or layout gives about 0 dB) and the saturation bound
    big = w_scale * 300
    want = bnb4_dequantize_scaled_reference(packed, layout, shape, big, F.E4M3, transpose)
    got = bnb4_dequantize_scaled(packed, layout, shape, big, torch.empty(want.shape, dtype=F.E4M3), transpose)
    assert sqnr(want, got) > 15 and got.float().abs().max() <= 448


def test_scaled_dequantization_refuses_what_it_cannot_form():
    packed, state = quantized((8, 64), True)
    layout = layout_of(state)
    with pytest.raises(ValueError, match=r"out must be contiguous of shape \(64, 8\)"):
        bnb4_dequantize_scaled(packed, layout, (8, 64), torch.ones(1), torch.empty(8, 64), transpose=True)
    with pytest.raises(ValueError, match="w_scale must be float32 of 1 or 8 values"):
        bnb4_dequantize_scaled(packed, layout, (8, 64), torch.ones(3), torch.empty(8, 64))
    with pytest.raises(ValueError, match="7 columns"):
        bnb4_dequantize_scaled(packed, layout, (8, 7), torch.ones(1), torch.empty(8, 7))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-4bit-fp8")
    tiny_llama(0, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    return folder


def load_4bit(folder, device="cpu", dtype=torch.float32):
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype)
    return LlamaForCausalLM.from_pretrained(folder, quantization_config=config, device_map=device, dtype=dtype)


def dense_twin(model_4bit, folder, device="cpu", dtype=torch.float32):
    """The same model with plain nn.Linear projections holding the values the 4-bit codes stand for."""
    dense = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    values = {name: dequantized_copy(m.weight).to(dtype) for name, m in model_4bit.named_modules()
              if isinstance(m, bnb.nn.Linear4bit)}
    with torch.no_grad():
        for name, m in dense.named_modules():
            if name in values:
                m.weight.copy_(values[name])
    return dense


def fp8_config(**overrides):
    options = dict(r=8, lora_alpha=16, target_modules=PROJECTIONS, init_lora_weights=False, fp8="hybrid",
                   fp8_layers="all")
    options.update(overrides)
    return SitsLoraConfig(**options)


def train_steps(model, ids, steps=2):
    """Losses and the last step's gradients of ``steps`` steps (the first with current scaling, later ones with the
    delayed scales the first recorded)."""
    model.train()
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        fp8_scaling_state(model).update()
        losses.append(loss.item())
    grads = {n.split("base_model.model.", 1)[-1]: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_the_4bit_layer_on_fp8_equals_the_fp8_base_over_the_same_values(model_dir, granularity):
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    quantized_model = load_4bit(model_dir)
    dense = dense_twin(quantized_model, model_dir)
    results = {}
    for name, base in (("4bit", quantized_model), ("dense", dense)):
        torch.manual_seed(1)
        model = get_peft_model(base, fp8_config(fp8_emulate=True, fp8_weight_scale=granularity))
        results[name] = train_steps(model, ids)
        if name == "4bit":
            layer = model.base_model.model.model.layers[0].mlp.down_proj
            assert type(layer.frozen_base).__name__ == "Bnb4Fp8Base"
            assert isinstance(layer.base_layer, bnb.nn.Linear4bit)   # the 4-bit bytes stay the storage
            plan = fp8_layer_plan(model)
            assert {e["base"] for e in plan.values()} == {"4-bit storage, fp8 compute"} and len(plan) == 14
            memory = frozen_weight_memory(model)
            assert memory["fp8_layers"] == 14 and memory["ratio"] < 0.4
    (losses, grads), (losses_dense, grads_dense) = results["4bit"], results["dense"]
    # the same W8 (e4m3 of the same values under the same amax), the same delayed scales: the same numbers
    assert losses == pytest.approx(losses_dense, rel=1e-6)
    assert grads.keys() == grads_dense.keys() and len(grads) == 28
    for key in grads:
        torch.testing.assert_close(grads[key], grads_dense[key], rtol=1e-4, atol=1e-6)


def adapted_4bit(model_dir, fp8: str):
    """The tiny 4-bit model with the same adapter (seeded) on fp8 compute (emulated) or on the 4-bit path's own."""
    torch.manual_seed(1)
    options = dict(fp8_emulate=True) if fp8 == "hybrid" else dict(fp8="off", fp8_layers="auto")
    return get_peft_model(load_4bit(model_dir), fp8_config(**options))


def test_fp8_compute_stays_near_the_4bit_layers_own_path(model_dir):
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = {}
    for fp8 in ("off", "hybrid"):
        model = adapted_4bit(model_dir, fp8)
        model.train()
        losses[fp8] = model(input_ids=ids, labels=ids).loss.item()
    assert losses["hybrid"] == pytest.approx(losses["off"], rel=1e-3)


def test_merge_leaves_the_fp8_path_and_merges_as_the_4bit_layer_does(model_dir):
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
    logits = {}
    for fp8 in ("off", "hybrid"):
        model = adapted_4bit(model_dir, fp8)
        model.eval()
        model.base_model.merge_adapter()
        layer = model.base_model.model.model.layers[1].self_attn.q_proj
        assert layer.frozen_base is BNB4_BASE
        if fp8 == "hybrid":
            assert fp8_layer_plan(model)["base_model.model.model.layers.1.self_attn.q_proj"]["base"] == (
                "4-bit storage, bf16 compute")
        with torch.no_grad():
            logits[fp8] = model(input_ids=ids).logits
    # PEFT's 4-bit merge (dequantize, add, quantize again) on the same adapter: the same model after it
    assert torch.equal(logits["hybrid"], logits["off"])


@pytest.mark.parametrize("granularity,limit,message", [
    ("tensor", 64, r"2\*\*31 elements.*tile_mlp"),
    ("row", 2**31, r"fp8_weight_scale='row' runs the row-wise torch._scaled_mm.*bnb_4bit_compute_dtype"),
])
def test_a_call_the_fp8_kernels_cannot_run_is_refused_before_any_kernel(model_dir, monkeypatch, granularity, limit,
                                                                        message):
    """As on a GPU (emulation off, the device check passed): past 32-bit offsets (the limit lowered here), or an
    fp32 input under row-wise weight scales, is an error that names the way out."""
    from sits_lora.ops import choice

    monkeypatch.setattr(choice, "INT32_ELEMENTS", limit)
    model = get_peft_model(load_4bit(model_dir), fp8_config(fp8_emulate=True, fp8_weight_scale=granularity))
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    layer.frozen_base.state.emulate = False
    monkeypatch.setattr("sits_lora.bases.fp8.check_fp8_device", lambda x, emulate: None)
    from sits_lora.layers.forward_plan import ForwardPlan

    with pytest.raises(ValueError, match=message):
        layer.frozen_base.fused_forward(layer, ForwardPlan("fused", "default"), torch.randn(2, 8, 64))


def test_the_memory_plan_counts_an_e4m3_buffer_for_the_fp8_layers(model_dir):
    """Layers on fp8 compute form W in a buffer of one byte a value, not in the 4-bit weight's own dtype."""
    from sits_lora.training.memory import plan_memory
    from sits_lora.utils.model_structure import stored_bytes

    model = get_peft_model(load_4bit(model_dir), fp8_config(fp8_emulate=True))
    inner = model.base_model.model   # the fp8 scaling state beside it is not a weight
    frozen = sum(stored_bytes(t) for t in list(inner.parameters()) + list(inner.buffers()) if not t.requires_grad)
    layers = [m for m in model.modules() if type(m).__name__ == "SitsLoraLinear4bit"]
    assert len(layers) == 14 and all(type(m.frozen_base).__name__ == "Bnb4Fp8Base" for m in layers)
    largest_w8 = max(m.in_features * m.out_features for m in layers)
    assert plan_memory(model, batch_size=2, seq_len=16).frozen_weights == frozen + largest_w8


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a GPU of compute capability >= 8.9")
def test_on_a_gpu_the_scaled_dequantization_is_bit_exact_and_the_layer_matches_the_emulation(tmp_path):
    for shape, nested in (((4096, 4096), True), ((1024, 4096 + 64), False), ((4096, 14336), True)):
        packed, state = quantized(shape, nested, "cuda")
        layout = layout_of(state)
        for w_scale in (torch.tensor([90.0], device="cuda"), torch.rand(shape[0], device="cuda") * 100 + 50):
            for transpose in (False, True):
                want = bnb4_dequantize_scaled_reference(packed, layout, shape, w_scale, F.E4M3, transpose)
                got = bnb4_dequantize_scaled(packed, layout, shape, w_scale, torch.empty_like(want), transpose)
                # the products in the reference's order; where the GPU fuses the double quantization's
                # multiply-add its last fp32 bit can move one rounding: one e4m3 step, rarely
                differ = got.view(torch.uint8) != want.view(torch.uint8)
                assert differ.float().mean() < 1e-3
                steps = (got.float() - want.float()).abs()[differ]
                assert (steps <= want.float().abs()[differ] * 2**-3 + 2**-9).all()
    folder = tmp_path / "llama"
    tiny_llama(0, hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
               max_position_embeddings=512).save_pretrained(folder)
    ids = torch.randint(0, 97, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    for emulate in (False, True):
        torch.manual_seed(1)
        model = get_peft_model(load_4bit(folder, "cuda", torch.bfloat16), fp8_config(fp8_emulate=emulate))
        results[emulate] = train_steps(model, ids, steps=3)
    (losses, grads), (losses_e, grads_e) = results[False], results[True]
    assert losses == pytest.approx(losses_e, rel=2e-2)
    # the same fp8 casts; what differs: fast accumulation, bf16 tensor-core LoRA kernels against fp32 products
    assert min(sqnr(grads_e[k], grads[k]) for k in grads) > 20
