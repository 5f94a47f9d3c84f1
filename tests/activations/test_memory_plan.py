"""plan_memory and the memory check's suggestions with rebuilt LoRA inputs (sits_lora.activations) and Liger."""

from __future__ import annotations

import torch
from test_recompute import SHAPE, TARGETS, _family, _peft

from sits_lora import plan_memory
from sits_lora.training.alternatives import memory_alternatives
from sits_lora.training.constraints import check_memory


def _models():
    base, targets = _family("llama")  # fp32: transformers' RMSNorm keeps its input, so q/k/v and gate/up qualify
    return _peft(base, targets, recompute=False), _peft(base, targets, recompute=True)


def test_the_plan_drops_exactly_the_rebuilt_inputs():
    saved, rebuilt = _models()
    batch, seq = 2, 64
    plan_saved, plan_rebuilt = plan_memory(saved, batch, seq), plan_memory(rebuilt, batch, seq)
    T, h, inter, a = batch * seq, SHAPE["hidden_size"], SHAPE["intermediate_size"], 4
    # the largest block: the first, whose q/k/v input stays saved (its norm reads the embeddings, which need no
    # gradient); it drops its gate/up, o_proj and down_proj inputs
    assert plan_saved.activations_per_layer - plan_rebuilt.activations_per_layer == a * T * (2 * h + inter)
    # every block: the blocks after the first drop their q/k/v input too
    drop = a * T * (3 * h + inter) + a * T * (2 * h + inter)
    assert plan_saved.total - plan_rebuilt.total == drop
    # the overrides plan the other setting of the same model
    assert plan_memory(saved, batch, seq, recompute_lora_inputs=True).total == plan_rebuilt.total
    assert plan_memory(rebuilt, batch, seq, recompute_lora_inputs=False).total == plan_saved.total
    # Liger's fused cross-entropy holds no T x V logits, its norm and SwiGLU keep less
    assert plan_memory(rebuilt, batch, seq, liger=True).total < plan_rebuilt.total


def test_the_memory_check_recommends_the_cheapest_change_that_fits():
    saved, _ = _models()
    plan = plan_memory(saved, 2, 64)
    rebuilt = plan_memory(saved, 2, 64, recompute_lora_inputs=True)
    budget = (plan.total + rebuilt.total) // 2  # rebuilding the inputs is enough
    alternatives = memory_alternatives(saved, 2, 64, plan, budget, n_ckpt=0, plan_kwargs={})
    labels = list(alternatives)
    first = 1 if torch.cuda.is_available() and "Liger" in labels[0] else 0
    assert "recompute_lora_inputs=True" in labels[first] and "gradient checkpointing" in labels[first + 1]
    result = check_memory(plan, budget, "test budget", alternatives)
    assert result.status == "violated"
    recommended = [s for s in result.suggestions if "recommended" in s]
    cheapest_fit = next(label for label, alt in alternatives.items() if alt.total <= budget)
    assert len(recommended) == 1 and recommended[0].startswith(cheapest_fit)
    assert first == 1 or cheapest_fit == labels[0]  # on the CPU: rebuilding the inputs


def test_the_memory_check_offers_layers_on_the_host_when_the_copies_hide():
    """With the hardware's pinned bandwidth and matmul rate, the layers whose saved tensors can cross PCIe during
    the forward are offered before any recompute (gradient checkpointing)."""
    from types import SimpleNamespace

    import transformers

    config = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": 6})
    config._attn_implementation = "sdpa"
    saved = _peft(transformers.LlamaForCausalLM(config).float(), TARGETS, recompute=False)
    plan = plan_memory(saved, 2, 64)
    hardware = SimpleNamespace(pinned_bandwidth=1e15, matmul_flops=1e12)
    alternatives = memory_alternatives(saved, 2, 64, plan, plan.total // 2, n_ckpt=0, plan_kwargs={},
                                       hardware=hardware)
    labels = list(alternatives)
    host = [i for i, label in enumerate(labels) if "copies hidden behind the forward" in label]
    checkpointing = labels.index("gradient checkpointing (TrainingArguments(gradient_checkpointing=True))")
    assert len(host) == 1 and host[0] < checkpointing
    assert "enable_activation_offload(model, range(0, 6))" in labels[host[0]]
    assert alternatives[labels[host[0]]].total < plan.total
    # without the hardware's figures nothing is offered
    assert not any("copies hidden" in label for label in memory_alternatives(
        saved, 2, 64, plan, plan.total // 2, n_ckpt=0, plan_kwargs={}))
