"""serving_plan: several adapters in a batch dispatch, none runs the base model, one merges when the request is long
enough for the measured per-token saving to pay for merging and unmerging; apply() leaves the model in that state
with the outputs of that state; measure_serving_costs measures and leaves the model as it was."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from peft import get_peft_model

from sits_lora import SitsLoraConfig, serving_plan
from sits_lora.serving import ServingCosts, measure_serving_costs

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]
COSTS = ServingCosts(dispatch_ms=2.0, merged_ms=1.5, merge_ms=10.0)    # merging pays after 20 tokens


def _model():
    model = get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                         init_lora_weights=False), adapter_name="one")
    model.add_adapter("two", SitsLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    return model.eval()


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def test_the_crossover_is_the_merge_cost_over_the_saving_per_token():
    assert COSTS.crossover_tokens == pytest.approx(20.0)
    assert ServingCosts(1.0, 1.0, 5.0).crossover_tokens == float("inf")


def test_the_decision_follows_the_adapters_and_the_request_length():
    model = _model()
    assert serving_plan(model, ["one", "two", "one"], 500, costs=COSTS).action == "dispatch"
    assert serving_plan(model, ["one", "__base__"], 500, costs=COSTS).action == "dispatch"
    assert serving_plan(model, ["__base__"] * 2, 500, costs=COSTS).action == "base"
    long = serving_plan(model, ["one"] * 4, 500, costs=COSTS)
    assert long.action == "merge" and long.adapter == "one" and "after 20 tokens" in long.reason
    short = serving_plan(model, "one", 10, costs=COSTS)
    assert short.action == "dispatch" and "only after 20 tokens" in short.reason
    flat = serving_plan(model, "one", 10_000, costs=ServingCosts(1.0, 1.0, 5.0))
    assert flat.action == "dispatch" and "no faster" in flat.reason


def test_apply_gives_each_state_its_outputs():
    model = _model()
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(1))
    model.set_adapter("one")
    one = _logits(model, ids)
    with model.disable_adapter():
        base = _logits(model, ids)
    mixed_names = ["one", "two", "__base__"]
    mixed = _logits(model, ids, adapter_names=mixed_names)

    plan = serving_plan(model, "one", 500, costs=COSTS, apply=True)
    assert plan.action == "merge" and model.base_model.model.model.layers[0].self_attn.q_proj.merged
    torch.testing.assert_close(_logits(model, ids), one, rtol=1e-4, atol=1e-4)
    assert serving_plan(model, "one", 5, costs=COSTS).reason.startswith("adapter 'one' is merged already")

    plan = serving_plan(model, mixed_names, 500, costs=COSTS, apply=True)       # unmerges for the mixed batch
    assert plan.action == "dispatch" and plan.generate_kwargs == {"adapter_names": mixed_names}
    torch.testing.assert_close(_logits(model, ids, **plan.generate_kwargs), mixed, rtol=1e-5, atol=1e-5)

    serving_plan(model, ["__base__"] * 3, 500, costs=COSTS, apply=True)
    torch.testing.assert_close(_logits(model, ids), base, rtol=1e-5, atol=1e-5)
    serving_plan(model, "one", 5, costs=COSTS, apply=True)                      # adapters back on, unmerged
    torch.testing.assert_close(_logits(model, ids), one, rtol=1e-5, atol=1e-5)


def test_costs_are_measured_once_and_the_model_is_left_as_it_was():
    model = _model()
    model.set_adapter("two")
    costs = measure_serving_costs(model, "one", batch_size=2, repeats=2)
    assert costs.dispatch_ms > 0 and costs.merged_ms > 0 and costs.merge_ms > 0
    assert model.active_adapters == ["two"] and not any(getattr(m, "merged", False) for m in model.modules())
    assert measure_serving_costs(model, "one", batch_size=2) is costs                 # kept on the model
    plan = serving_plan(model, ["one"] * 2, 10**9)                                     # measures (uses the kept costs)
    assert plan.costs is costs and plan.action in ("merge", "dispatch")


@pytest.mark.parametrize("merged_before", [False, True], ids=["unmerged", "merged-before"])
def test_timing_the_merges_leaves_bf16_base_weights_bit_identical(merged_before):
    """Each timed merge + unmerge rounds the bf16 weights (W + sBA - sBA != W): the measurement restores them,
    also where an adapter was merged before it (unmerged for the timing, merged again after)."""
    model = _model().to(torch.bfloat16)
    if merged_before:
        model.set_adapter("two")
        model.merge_adapter(["two"])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    measure_serving_costs(model, "one", repeats=2)
    after = dict(model.named_parameters())
    assert before and all(torch.equal(after[n], w) for n, w in before.items())
    assert any(getattr(m, "merged", False) for m in model.modules()) is merged_before


def test_refusals_name_the_fix():
    model = _model()
    with pytest.raises(ValueError, match=r"no adapter named \['three'\]"):
        serving_plan(model, ["one", "three"], 10)
    with pytest.raises(ValueError, match=r"serving_plan\(new_tokens=.*\) is invalid: it must be a positive integer"):
        serving_plan(model, "one", 0)
    with pytest.raises(ValueError, match="one per sample"):
        serving_plan(model, [], 10)
    with pytest.raises(TypeError, match="needs a PeftModel"):
        serving_plan(tiny_llama(0), "one", 10)
    with pytest.raises(ValueError, match="graphs=True times CUDA graphs"):
        measure_serving_costs(model, "one", graphs=True)


@pytest.mark.gpu
def test_on_a_gpu_costs_timed_as_replayed_graphs():
    model = _model().to("cuda", torch.bfloat16)
    costs = measure_serving_costs(model, "one", batch_size=4, graphs=True, repeats=3)
    assert costs.dispatch_ms > 0 and costs.merged_ms > 0 and costs.merge_ms > 0
    assert not any(getattr(m, "merged", False) for m in model.modules())
    plan = serving_plan(model, ["one"] * 4, 10**6, graphs=True)
    assert plan.costs is costs
