"""A bitsandbytes 4-bit base (QLoRA) on the CPU: SitsLoraLinear4bit against PEFT's own QLoRA layer (nf4 / fp4,
double quantization on and off; the reference and the Triton path under the interpreter), merge, export to stock
PEFT, save / load, and the CPU eval-mode repacking that bitsandbytes would otherwise do."""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # "Failed to load ... kernels-community"
bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import BitsAndBytesConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from conftest import rel_err, tiny_llama  # noqa: E402

from sits_lora import SitsLoraConfig, export_peft_lora  # noqa: E402
from sits_lora.activations import input_recompute_report  # noqa: E402
from sits_lora.layers.linear import SitsLoraLinear  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-4bit")
    tiny_llama(0, hidden_size=64, intermediate_size=128).save_pretrained(folder)
    return folder


def load_4bit(folder, quant_type="nf4", double=True):
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                                bnb_4bit_compute_dtype=torch.float32)
    return LlamaForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cpu")


def train_step(model, ids):
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n.split("base_model.model.", 1)[-1]: p.grad for n, p in model.named_parameters()
                           if p.grad is not None}


def layers_of(model, cls):
    return [m for m in model.modules() if type(m).__name__ == cls]


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("nf4", False), ("fp4", True)])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_fused_qlora_layer_matches_peft_qlora(model_dir, quant_type, double, kernel):
    ids = torch.randint(0, 97, (2, 9))
    torch.manual_seed(1)
    peft_model = get_peft_model(load_4bit(model_dir, quant_type, double),
                                LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, init_lora_weights=False))
    torch.manual_seed(1)
    ours = get_peft_model(load_4bit(model_dir, quant_type, double),
                          SitsLoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, init_lora_weights=False,
                                         kernel=kernel))
    assert len(layers_of(ours, "SitsLoraLinear4bit")) == 14 and not layers_of(ours, "SitsLoraLinear")
    ref_loss, ref_grads = train_step(peft_model, ids)
    loss, grads = train_step(ours, ids)
    assert rel_err(loss, ref_loss) < 1e-6
    assert set(grads) == set(ref_grads) and len(grads) == 28
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) < 1e-5, name
    # the layers after a norm (q/k/v, gate/up) saved a rebuild of their input, not the input (recompute_lora_inputs)
    report = {r["layer"].rsplit(".", 1)[-1]: r for r in input_recompute_report(ours)}
    assert len(report) == 7 and all(report[n]["rebuilt"] == report[n]["forwards"] > 0 for n in ("q_proj", "up_proj"))


def test_dropout_draws_the_same_masks_as_peft(model_dir):
    ids = torch.randint(0, 97, (2, 9))
    results = []
    for config in (LoraConfig(r=8, target_modules=PROJECTIONS, lora_dropout=0.3, init_lora_weights=False),
                   SitsLoraConfig(r=8, target_modules=PROJECTIONS, lora_dropout=0.3, init_lora_weights=False)):
        torch.manual_seed(1)
        model = get_peft_model(load_4bit(model_dir), config)
        torch.manual_seed(2)
        results.append(train_step(model, ids))
    (ref_loss, ref_grads), (loss, grads) = results
    assert rel_err(loss, ref_loss) < 1e-6
    assert all(rel_err(grads[n], ref_grads[n]) < 1e-5 for n in grads)


def test_eval_forward_leaves_the_packed_weight_alone(model_dir):
    """bitsandbytes' CPU eval path would repack the weight for its bf16 kernel, after which dequantize_4bit
    (and so merges and the fused path) read it wrong; the layer turns that off."""
    model = get_peft_model(load_4bit(model_dir), SitsLoraConfig(r=4, target_modules=PROJECTIONS))
    weight = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    before = bnb.functional.dequantize_4bit(weight.data, weight.quant_state).clone()
    model.eval()
    with torch.no_grad(), model.disable_adapter():  # PEFT's path: bitsandbytes' own forward
        model(input_ids=torch.randint(0, 97, (1, 6)))
    assert torch.equal(bnb.functional.dequantize_4bit(weight.data, weight.quant_state), before)


def test_a_model_evaluated_before_wrapping_gets_its_repacked_weights_back(model_dir):
    """An eval forward on the plain 4-bit model (before get_peft_model) repacks its weights on a CPU with
    AVX512-BF16; the sits_lora layer restores bitsandbytes' layout, so its outputs match a model never evaluated."""
    ids = torch.randint(0, 97, (2, 9))
    config = SitsLoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, init_lora_weights=False)
    evaluated = load_4bit(model_dir)
    linears = [m for m in evaluated.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in linears:
        m.support_avx512bf16_for_cpu = True  # as on such a CPU, whatever this one has
    evaluated.eval()
    with torch.no_grad():
        evaluated(input_ids=ids)
    repacked = [getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in linears]
    if not any(repacked):
        pytest.skip("this bitsandbytes does not repack 4-bit weights for its CPU kernel")
    torch.manual_seed(1)
    ours = get_peft_model(evaluated, config)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in linears)
    torch.manual_seed(1)
    fresh = get_peft_model(load_4bit(model_dir), config)
    (loss, grads), (ref_loss, ref_grads) = train_step(ours, ids), train_step(fresh, ids)
    # bitsandbytes' inverse quantizes the scales again (double quantization): close, not bit for bit (the repacked
    # layout itself, read by dequantize_4bit, gives wrong values: the eval-forward test above)
    assert rel_err(loss, ref_loss) < 1e-4, rel_err(loss, ref_loss)
    assert max(rel_err(grads[n], ref_grads[n]) for n in grads) < 1e-2, max(rel_err(grads[n], ref_grads[n]) for n in grads)


def test_merge_matches_peft_and_export_loads_in_stock_peft_on_the_same_4bit_model(model_dir, tmp_path):
    # train mode throughout (no dropout: deterministic): bitsandbytes' CPU eval path is its bf16 kernel, which
    # the stock layers below would take
    ids = torch.randint(0, 97, (2, 8))
    torch.manual_seed(3)
    ours = get_peft_model(load_4bit(model_dir), SitsLoraConfig(r=8, target_modules=PROJECTIONS,
                                                               init_lora_weights=False))
    ours.train()
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
    export_peft_lora(ours, tmp_path / "plain")
    stock = PeftModel.from_pretrained(load_4bit(model_dir), tmp_path / "plain")
    assert layers_of(stock, "Linear4bit") and not layers_of(stock, "SitsLoraLinear4bit")
    torch.manual_seed(3)
    peft_model = get_peft_model(load_4bit(model_dir), LoraConfig(r=8, target_modules=PROJECTIONS,
                                                                 init_lora_weights=False))
    with torch.no_grad():
        assert rel_err(stock.train()(input_ids=ids).logits, expected) < 1e-6
        merged_ours = copy.deepcopy(ours).merge_and_unload().train()(input_ids=ids).logits
        merged_peft = peft_model.merge_and_unload().train()(input_ids=ids).logits
    assert rel_err(merged_ours, merged_peft) < 1e-6  # both requantize the merged weight the same way


def test_save_and_load_give_the_fused_layers_back(model_dir, tmp_path):
    ids = torch.randint(0, 97, (1, 7))
    torch.manual_seed(4)
    model = get_peft_model(load_4bit(model_dir), SitsLoraConfig(r=4, target_modules=PROJECTIONS,
                                                                init_lora_weights=False))
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_4bit(model_dir), tmp_path / "adapter")
    assert len(layers_of(loaded, "SitsLoraLinear4bit")) == 14
    with torch.no_grad():
        assert rel_err(loaded.eval()(input_ids=ids).logits, expected) < 1e-6


def test_a_dense_model_still_gets_the_dense_layer(model_dir):
    model = get_peft_model(LlamaForCausalLM.from_pretrained(model_dir), SitsLoraConfig(r=4, target_modules=["q_proj"]))
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj, SitsLoraLinear)


def test_the_int4_base_refuses_a_bitsandbytes_model_by_name(model_dir):
    with pytest.raises(ValueError, match=r"quantizes torch.nn.Linear base layers only.*\(Linear4bit\)"):
        get_peft_model(load_4bit(model_dir), SitsLoraConfig(r=4, target_modules=["q_proj"], base_quant="int4",
                                                            int4_group_size=32))


@pytest.mark.gpu
def test_fused_qlora_layer_matches_peft_qlora_on_a_gpu_in_bf16(model_dir):
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 64), device="cuda")
    results = []
    for lora in (LoraConfig(r=8, target_modules=PROJECTIONS, init_lora_weights=False),
                 SitsLoraConfig(r=8, target_modules=PROJECTIONS, init_lora_weights=False)):
        torch.manual_seed(1)
        base = LlamaForCausalLM.from_pretrained(model_dir, quantization_config=config, dtype=torch.bfloat16,
                                                device_map="cuda")
        results.append(train_step(get_peft_model(base, lora), ids))
    (ref_loss, ref_grads), (loss, grads) = results
    assert rel_err(loss.float(), ref_loss.float()) < 1e-2
    for name in grads:
        assert rel_err(grads[name].float(), ref_grads[name].float()) < 5e-2, name


def test_weight_memory_counts_the_4bit_codes_and_their_quantization_state(model_dir):
    from sits_lora.int4 import int4_weight_memory

    for double in (True, False):
        model = get_peft_model(load_4bit(model_dir, "nf4", double), SitsLoraConfig(r=8, target_modules=PROJECTIONS))
        memory = int4_weight_memory(model)
        bases = [m.get_base_layer() for m in layers_of(model, "SitsLoraLinear4bit")]
        codes = sum(b.weight.numel() for b in bases)                     # uint8, two weights a byte
        weights = sum(b.in_features * b.out_features for b in bases)
        assert memory["layers"] == 14 and memory["bf16_bytes"] == 2 * weights and 2 * codes == weights
        # one absmax per 64 weights: a byte when double-quantized (plus the nested fp32 absmax and code
        # tables), a float32 otherwise
        state = memory["stored_bytes"] - codes
        assert (weights // 64 < state < weights // 64 + 14 * 2048) if double else state >= 4 * (weights // 64)
        # the code tables are fixed-size, a large share of this tiny model's bytes (0.26x at Llama shapes)
        assert memory["ratio"] == memory["stored_bytes"] / memory["bf16_bytes"] < 0.5


def test_the_memory_plan_counts_what_the_4bit_weights_store(model_dir):
    """plan_memory's frozen weights: every frozen tensor once, a 4-bit weight with its whole quantization state
    (the nested absmax and code tables too), plus one dequantization buffer of the largest adapted W."""
    from sits_lora.training.memory import plan_memory
    from sits_lora.utils.model_structure import stored_bytes

    model = get_peft_model(load_4bit(model_dir), SitsLoraConfig(r=8, target_modules=PROJECTIONS))
    frozen = sum(stored_bytes(t) for t in list(model.parameters()) + list(model.buffers()) if not t.requires_grad)
    state = sum(stored_bytes(m.get_base_layer().weight) - m.get_base_layer().weight.numel()
                for m in layers_of(model, "SitsLoraLinear4bit"))
    largest_w = max(m.in_features * m.out_features * 4 for m in layers_of(model, "SitsLoraLinear4bit"))  # fp32
    assert state > 14 * (1024 + 64)   # each layer's nested code table (256 fp32) and NF4 table (16 fp32) at least
    assert plan_memory(model, batch_size=2, seq_len=16).frozen_weights == frozen + largest_w


def test_the_memory_plan_names_a_4bit_layer_not_quantized_yet():
    """A bitsandbytes 4-bit model built on the meta device (its weights not quantized: no stored size yet) gets an
    error that names the layer and the fix, not an AttributeError from inside the plan."""
    from conftest import bench_module

    from sits_lora.training.memory import plan_memory

    bench_model = bench_module("bench_model")
    with torch.device("meta"):
        model = tiny_llama(0, hidden_size=64, intermediate_size=128)
    bench_model.to_bitsandbytes_nf4(model, torch.float32)
    model = get_peft_model(model, SitsLoraConfig(r=8, target_modules=PROJECTIONS))
    assert layers_of(model, "SitsLoraLinear4bit")
    with pytest.raises(ValueError, match=r"plan_memory: the 4-bit weight of \S+q_proj \(and \d+ more\) holds no "
                                         r"quantization state yet.*load_in_4bit=True"):
        plan_memory(model, batch_size=1, seq_len=16)
