"""merge_plan: a run of generations merges the LoRA when the measured savings pay for merging and unmerging, and
runs it unmerged otherwise; the costs are timed on the denoiser as it is and leave it as it was."""

from __future__ import annotations

import os
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

sys.path.insert(0, os.path.dirname(__file__))
from test_diffusers_models import ATTENTION, tiny_unet  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.diffusion import (DenoiserCosts, DenoiserPlan, calibrate, measure_denoiser_costs, merge_plan,  # noqa: E402
                                 quantize_fp8)
from sits_lora.diffusion.plan import example_inputs  # noqa: E402
from sits_lora.utils.merging import merged_adapters  # noqa: E402


def _adapted():
    torch.manual_seed(0)
    unet = tiny_unet().eval()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    return unet


def _sample(unet, inputs):
    with torch.no_grad():
        return unet(**inputs).sample


def test_the_rule_weighs_calls_against_merging():
    unet = _adapted()
    costs = DenoiserCosts(unmerged_ms=11.0, merged_ms=10.0, merge_ms=300.0)
    assert costs.crossover_calls == 300
    few = merge_plan(unet, images=2, steps=30, costs=costs)                 # 60 calls save 60 ms < 300
    many = merge_plan(unet, images=20, steps=30, costs=costs)               # 600 calls save 600 ms > 300
    assert (few.action, many.action) == ("dispatch", "merge")
    assert "would pay only after 300 denoiser calls" in few.reason and "pays after 300" in many.reason
    never = merge_plan(unet, images=1000, costs=DenoiserCosts(unmerged_ms=10.0, merged_ms=10.0, merge_ms=1.0))
    assert never.action == "dispatch" and "no faster" in never.reason
    assert not merged_adapters(unet)                                        # a plan changes nothing until applied


def test_apply_merges_and_a_dispatch_unmerges_to_the_same_outputs():
    unet = _adapted()
    inputs = example_inputs(unet)
    unmerged = _sample(unet, inputs)
    plan = merge_plan(unet, images=20, costs=DenoiserCosts(11.0, 10.0, 300.0), apply=True)
    assert plan.action == "merge" and merged_adapters(unet) == {"default"}
    torch.testing.assert_close(_sample(unet, inputs), unmerged, rtol=1e-4, atol=1e-4)
    again = merge_plan(unet, images=1, costs=DenoiserCosts(11.0, 10.0, 300.0))   # merged: staying so costs nothing
    assert again.action == "merge" and again.reason.endswith("merged already: nothing to pay")
    DenoiserPlan(unet, "dispatch", "default", "unmerged for the test").apply()
    assert not merged_adapters(unet)
    torch.testing.assert_close(_sample(unet, inputs), unmerged, rtol=1e-5, atol=1e-5)


def test_measuring_a_merged_bf16_denoiser_leaves_its_weights_bit_identical():
    """A denoiser merged before the measurement is unmerged for it and merged again after: in bf16 that round trip
    rounds (W + sBA - sBA != W); the base weights come back exactly, and merged."""
    unet = _adapted().to(torch.bfloat16)
    DenoiserPlan(unet, "merge", "default", "merged for the test").apply()
    before = {n: p.detach().clone() for n, p in unet.named_parameters() if "base_layer" in n}
    measure_denoiser_costs(unet, repeats=2)
    after = dict(unet.named_parameters())
    assert merged_adapters(unet) == {"default"}
    assert before and all(torch.equal(after[n], w) for n, w in before.items())


def test_measured_costs_leave_the_denoiser_as_it_was():
    unet = _adapted()
    inputs = example_inputs(unet)
    before = _sample(unet, inputs)
    costs = measure_denoiser_costs(unet, repeats=3)
    assert costs.unmerged_ms > 0 and costs.merged_ms > 0 and costs.merge_ms > 0
    assert not merged_adapters(unet)
    torch.testing.assert_close(_sample(unet, inputs), before)
    plan = merge_plan(unet, images=1, steps=1)            # measures, and decides by the rule on what it measured
    assert plan.costs is not None
    assert plan.action == ("merge" if 1 > plan.costs.crossover_calls else "dispatch"), plan.reason


def test_refusals_name_the_field_and_the_fix():
    unet = _adapted()
    with pytest.raises(ValueError, match=r"merge_plan\(images=0\) is invalid: it must be a positive integer"):
        merge_plan(unet, images=0)
    with pytest.raises(ValueError, match=r"no adapter named 'other'; it has \['default'\]"):
        merge_plan(unet, images=1, adapter="other")
    with pytest.raises(ValueError, match="measure_denoiser_costs: the denoiser has no adapter named 'other'"):
        measure_denoiser_costs(unet, adapter="other")
    with pytest.raises(ValueError, match="has no adapter; add one first"):
        merge_plan(tiny_unet(), images=1)
    with pytest.raises(TypeError, match="pass one denoising call's keyword arguments as inputs="):
        example_inputs(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"measure_denoiser_costs\(repeats=.*\) is invalid: it must be a positive integer"):
        measure_denoiser_costs(unet, repeats=0)


def test_a_quantized_base_dispatches_and_says_to_merge_first():
    unet = _adapted()
    inputs = example_inputs(unet)
    quantize_fp8(unet, calibrate(unet, [inputs]), min_rows=0)
    plan = merge_plan(unet, images=100)
    assert plan.action == "dispatch" and "merge before quantize_fp8" in plan.reason
    with pytest.raises(ValueError, match="cannot be merged.*merge before quantize_fp8"):
        measure_denoiser_costs(unet)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_costs_are_timed_through_the_recorded_graphs():
    from sits_lora.diffusion import graph_denoiser

    unet = _adapted().to("cuda", torch.bfloat16)
    graphs = graph_denoiser(unet)
    inputs = example_inputs(unet)
    before = _sample(unet, inputs)
    costs = measure_denoiser_costs(unet, inputs=inputs)
    assert graphs.replays > 0 and graphs.recordings >= 2            # unmerged and merged: one recording each
    assert costs.merge_ms > 0 and not merged_adapters(unet)
    torch.testing.assert_close(_sample(unet, inputs), before)


def test_timing_the_merges_leaves_bf16_base_weights_bit_identical():
    """Each timed merge + unmerge rounds the bf16 weights (W + sBA - sBA != W): the measurement restores them."""
    unet = _adapted().to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in unet.named_parameters() if "base_layer" in n}
    measure_denoiser_costs(unet, repeats=3)
    after = dict(unet.named_parameters())
    assert before and all(torch.equal(after[n], w) for n, w in before.items())
