"""Cast copies of adapter weights (sits_lora.utils.cast_copies): made once, made again in their old memory when a
source is written, moved, or a recorded step replayed, dropped with their adapter."""

from __future__ import annotations

import torch
from torch import nn

from sits_lora.utils import cast_copies as cc


def _owner():
    owner = nn.Module()
    owner.weights = nn.ParameterDict({"a": nn.Parameter(torch.randn(4, 8)), "b": nn.Parameter(torch.randn(8, 4))})
    return owner


def _sources(owner):
    return lambda: (owner.weights["a"], owner.weights["b"])


def test_a_copy_is_made_once_and_again_in_place_when_a_source_is_written():
    owner = _owner()
    A, B = cc.cast_copies(owner, "one", _sources(owner), torch.float16)
    assert A.dtype == B.dtype == torch.float16 and not A.requires_grad
    assert cc.cast_copies(owner, "one", _sources(owner), torch.float16)[0] is A          # nothing changed
    with torch.no_grad():
        owner.weights["a"].mul_(2)
    A2, _ = cc.cast_copies(owner, "one", _sources(owner), torch.float16)
    assert A2 is A and torch.equal(A, owner.weights["a"].detach().half())                 # same memory, new values
    assert cc.kept_cast_copies([owner]) == [(A, B)]


def test_refresh_follows_replaced_weights_replayed_writes_and_deleted_adapters():
    owner = _owner()
    A, _ = cc.cast_copies(owner, "one", _sources(owner), torch.float16)
    assert cc.refresh_cast_copies([owner]) == 0
    owner.weights["a"] = nn.Parameter(torch.ones(4, 8))                   # replaced (load_adapter), same shape
    assert cc.refresh_cast_copies([owner]) == 1 and torch.equal(A, torch.ones(4, 8, dtype=torch.float16))
    cc.note_replayed_weight_writes()                                      # a recorded optimizer step replayed
    assert cc.refresh_cast_copies([owner]) == 1 and cc.refresh_cast_copies([owner]) == 0
    owner.weights["a"] = nn.Parameter(torch.ones(2, 8))                   # another shape: new memory
    assert cc.cast_copies(owner, "one", _sources(owner), torch.float16)[0].shape == (2, 8)
    del owner.weights["a"]
    assert cc.refresh_cast_copies([owner]) == 0 and cc.kept_cast_copies([owner]) == []


def test_weights_made_under_inference_mode_are_read_as_they_are():
    """An inference tensor has no version counter to prove a copy current: no copy, the weights themselves."""
    with torch.inference_mode():
        owner = _owner()
    assert cc.cast_copies(owner, "one", _sources(owner), torch.float16)[0] is owner.weights["a"]
    assert cc.kept_cast_copies([owner]) == []
    keys = {cc.source_key((owner.weights["a"],)) for _ in range(2)}
    assert len(keys) == 2                                                 # never the same: made again every time


def test_a_copy_made_in_inference_mode_is_written_again_outside_it():
    owner = _owner()
    with torch.inference_mode():
        A, _ = cc.cast_copies(owner, "one", _sources(owner), torch.float16)
    assert not A.is_inference()
    with torch.no_grad():
        owner.weights["a"].add_(1)
        A2, _ = cc.cast_copies(owner, "one", _sources(owner), torch.float16)   # generate's no_grad, after training
    assert A2 is A and torch.equal(A, owner.weights["a"].detach().half())
    with torch.inference_mode():
        stale = torch.zeros(4, 8, dtype=torch.float16)
    fresh = torch.ones(4, 8, dtype=torch.float16)
    assert cc.written_into((stale,), (fresh,))[0] is fresh                # never writes into an inference tensor
    assert cc.written_into((fresh.clone().to(torch.float32),), (fresh,))[0] is fresh   # nor across dtypes


def test_copies_are_dropped_with_their_adapter_and_when_the_layer_moves():
    from conftest import tiny_llama
    from peft import get_peft_model

    from sits_lora import SitsLoraConfig

    model = get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, target_modules=["q_proj"]))
    model.add_adapter("other", SitsLoraConfig(r=4, target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    for name in ("default", "other"):
        cc.cast_copies(layer, name, lambda name=name: (layer.lora_A[name].weight,), torch.float16)
    assert len(cc.kept_cast_copies([layer])) == 2
    model.delete_adapter("other")
    assert len(cc.kept_cast_copies([layer])) == 1
    model.to(torch.float64)
    assert cc.kept_cast_copies([layer]) == []
