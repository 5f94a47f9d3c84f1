"""The forward plan (sits_lora.layers.forward_plan): one decision per call, which the layer then executes.

On the CPU the kernel setting "auto" resolves to the reference; the GPU cases are reached by resolving to the Triton
path as a GPU would (ops.resolve_kernel patched), which is the only GPU-dependent step of the decision."""

import pytest
import torch
from peft import get_peft_model

from sits_lora import SitsLoraConfig
from sits_lora.layers.forward_plan import ForwardPlan, plan_forward
from tests.conftest import tiny_llama


def _model(**config):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(tiny_llama(), SitsLoraConfig(r=4, target_modules=targets, **config))
    return model, model.base_model.model.model.layers[0].self_attn


def _as_on_a_gpu(monkeypatch):
    from sits_lora import ops

    monkeypatch.setattr(ops, "resolve_kernel", lambda requested, x, out_features=0, dtype=None:
                        "torch" if requested == "torch" else "triton")


def test_a_plain_adapter_takes_the_fused_path_with_its_siblings_on_the_reference_on_a_cpu():
    _, attn = _model()
    x = torch.randn(2, 5, attn.q_proj.in_features)
    assert plan_forward(attn.q_proj, x) == ForwardPlan("fused", "default", "torch", True, True)
    assert plan_forward(attn.o_proj, x) == ForwardPlan("fused", "default", "torch", False, True)   # no siblings


def test_what_the_fused_path_cannot_run_goes_to_peft_or_the_mixed_batch():
    model, attn = _model()
    model.add_adapter("other", SitsLoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    x = torch.randn(2, 5, attn.q_proj.in_features)
    assert plan_forward(attn.q_proj, x, (), {"adapter_names": ["default", "other"]}).path == "mixed_batch"
    with model.disable_adapter():
        assert plan_forward(attn.q_proj, x).path == "peft"
    model.base_model.set_adapter(["default", "other"])   # two active adapters: PEFT sums them
    assert plan_forward(attn.q_proj, x).path == "peft"
    model.base_model.set_adapter("default")
    attn.q_proj.base_layer.register_forward_hook(lambda *a: None)   # a hooked base module runs as the user set it
    assert plan_forward(attn.q_proj, x).path == "peft"
    assert plan_forward(attn.k_proj, x).path == "fused"


@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_the_kernel_of_the_fused_path(monkeypatch, kernel):
    """The decode kernel for a few rows without gradients; the ATen path for a call too small for the kernels under
    "auto" only; the reference for a trainable base; the kernels otherwise."""
    _as_on_a_gpu(monkeypatch)
    _, attn = _model(kernel=kernel)
    layer = attn.o_proj
    x = torch.randn(1, 4, layer.in_features)
    with torch.no_grad():
        assert plan_forward(layer, x).kernel == "decode"
    assert plan_forward(layer, x).kernel == ("aten" if kernel == "auto" else "triton")
    layer.lora_dropout["default"] = torch.nn.Dropout(0.1)   # its mask changes x: no decode kernel
    with torch.no_grad():
        assert plan_forward(layer, x).kernel != "decode"
    layer.base_layer.weight.requires_grad_(True)
    assert plan_forward(layer, x).kernel == "torch"


def test_the_layer_executes_its_plan(monkeypatch):
    """What the base runs is the plan's, unchanged: the layer chooses nothing after plan_forward."""
    _, attn = _model()
    layer = attn.o_proj
    seen = []
    base = type(layer.frozen_base)
    run = base.fused_forward
    monkeypatch.setattr(base, "fused_forward", lambda self, lyr, plan, x: seen.append(plan) or run(self, lyr, plan, x))
    x = torch.randn(2, 3, layer.in_features)
    expected = plan_forward(layer, x)
    y = layer(x)
    assert seen == [expected] and y.shape == (2, 3, layer.out_features)


def test_a_routed_adapter_is_planned_as_routed_and_refused_in_a_mixed_batch():
    model = get_peft_model(tiny_llama(), SitsLoraConfig(r=8, target_modules=["o_proj"], use_dynamic_rank=True,
                                                        rank_buckets=[2, 4, 8], target_mean_rank=4))
    layer = model.base_model.model.model.layers[0].self_attn.o_proj
    x = torch.randn(2, 3, layer.in_features)
    assert layer.routing_on("default")
    assert plan_forward(layer, x) == ForwardPlan("routed", "default", rebuild_input=True)
    with pytest.raises(ValueError, match="mixed batch"):
        plan_forward(layer, x, (), {"adapter_names": ["default", "default"]})


def test_under_autocast_the_kernel_setting_is_resolved_in_autocast_dtype():
    """An fp32 model under bf16 autocast: the fused op computes in bf16, so "auto" takes the kernels on a GPU (x's own
    fp32 would have sent it to the reference)."""
    from sits_lora import ops
    from sits_lora.bases import BF16_BASE

    _, attn = _model()
    x = torch.randn(2, 3, attn.o_proj.in_features)
    assert BF16_BASE.kernel_dtype(attn.o_proj, x) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert BF16_BASE.kernel_dtype(attn.o_proj, x) == torch.bfloat16

    class OnAGpu:   # what resolve_kernel reads of a CUDA tensor
        is_cuda, dtype, shape = True, torch.float32, (6, 64)

        def numel(self):
            return 6 * 64

        def dim(self):
            return 2

    assert ops.resolve_kernel("auto", OnAGpu(), 64) == "torch"
    assert ops.resolve_kernel("auto", OnAGpu(), 64, torch.bfloat16) == "triton"
