"""AdapterState (sits_lora.utils.cuda_graphs): what a CUDA-graph recording depends on in Python, asked every call
without walking the module tree each time, and still seeing every change a recording must not miss."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from sits_lora import SitsLoraConfig
from sits_lora.utils.cuda_graphs import AdapterState, adapter_state


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1)),
                         nn.Linear(16, 4))


def test_it_equals_the_walk_and_sees_every_change_a_recording_depends_on():
    model = get_peft_model(tiny_model(), SitsLoraConfig(r=4, target_modules=["0", "2.0"]))
    state = AdapterState(model)
    first = state()
    assert first == adapter_state(model)
    assert state() == first   # nothing changed: the same state
    seen = [first]

    def changed():
        now = state()
        assert now == adapter_state(model) and all(now != before for before in seen)
        seen.append(now)

    model.base_model.model[2].train(False)   # one submodule's mode
    changed()
    model.add_adapter("other", SitsLoraConfig(r=2, target_modules=["0", "3"]))   # "3" becomes a LoRA layer
    model.set_adapter("other")
    changed()
    assert type(model.base_model.model[3]).__name__ != "Linear"   # the injected layer: in the walked list
    with model.disable_adapter():
        changed()
    model.base_model.model[0].scaling["other"] = 0.5
    changed()
    model.merge_adapter()
    changed()


def test_a_layer_injected_after_it_was_made_is_walked_again():
    model = tiny_model()
    state = AdapterState(model)
    before = state()
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["3"]))   # replaces model[3] in place
    now = state()
    assert now != before and now == adapter_state(model.base_model.model)


class SlicesItsLayers(nn.Module):
    """A forward that slices a ModuleList, as diffusers' mid blocks (`resnets[1:]`) and transformers' decoders
    (`layers[:n]`) do: a new ModuleList, whose submodules are registered again, every call."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers[1:]:
            x = layer(x)
        return x


def test_a_model_that_slices_its_layers_is_not_walked_again_each_call():
    model = SlicesItsLayers()
    state = AdapterState(model)
    state()
    walked = state._modules
    model(torch.randn(2, 8))
    state()
    assert state._modules is walked   # the slice's registrations are outside the walked tree
    model.layers[0] = nn.Linear(8, 8)   # a registration inside it
    state()
    assert state._modules is not walked


def test_a_compiled_model_that_slices_its_layers_compiles_once():
    # the registration hook ran under dynamo and bumped a global: every call failed its guard and compiled again
    # (the SDXL VAE decoder recompiled at every image, ~2 s each on an H200)
    AdapterState(nn.Linear(2, 2))   # sets the global hook
    compiles = []

    def backend(graph_module, example_inputs):
        compiles.append(graph_module)
        return graph_module.forward

    model = SlicesItsLayers()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 8)
    for _ in range(3):
        assert torch.equal(compiled(x), model(x))
    assert len(compiles) == 1
