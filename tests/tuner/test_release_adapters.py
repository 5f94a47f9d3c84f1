"""Adapters saved by an earlier revision of sits_lora load with this one and give that revision's outputs.

tests/tuner/release_adapters/ holds a tiny Llama, SITS_LORA adapters of several configurations saved on it and
their logits on one batch, written by ``make.py`` at the revision ``made_by.json`` names (the code before the
package was regrouped: a flat ``config.py``, ``layer.py``). A field renamed, a default changed, a state-dict key
moved or a forward reordered shows up here as a failed load or other logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release_adapters")
with open(os.path.join(HERE, "made_by.json")) as _f:
    MADE_BY = json.load(_f)


@pytest.mark.parametrize("name", list(MADE_BY["adapters"]))
def test_an_adapter_saved_by_the_earlier_revision_gives_its_logits(name):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    import sits_lora

    expected = load_file(os.path.join(HERE, "logits.safetensors"))
    base = LlamaForCausalLM.from_pretrained(os.path.join(HERE, "base")).eval()
    model = PeftModel.from_pretrained(base, os.path.join(HERE, name)).eval()
    config = model.peft_config["default"]
    assert isinstance(config, sits_lora.SitsLoraConfig)
    for field, value in MADE_BY["adapters"][name].items():  # every argument it was saved with reads back the same
        read = getattr(config, field)
        assert (sorted(read) if isinstance(read, (set, list)) else read) == \
            (sorted(value) if isinstance(value, list) else value), field
    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"]).logits.float()
        with model.disable_adapter():
            without = model(input_ids=expected["input_ids"]).logits.float()
    assert (expected[name] - without).abs().max() > 1e-2  # the adapter moves the logits: a lost weight would show
    torch.testing.assert_close(logits, expected[name], rtol=0, atol=1e-5)
