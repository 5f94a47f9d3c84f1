"""fp8_layers='auto': the fp8 base only on layers whose shape makes it faster (sits_lora.fp8.selection).

On the CPU: the rule without a measurement, a stored measurement winning over the rule, the model-level
plan (which layer got which base, and why) and the config checks. The measurement itself
(selection.measure_layer) times two layer steps on a GPU: bench/tune_kernels.py --fp8 runs it there.
"""

from __future__ import annotations

import pytest
import torch

from sits_lora import SitsLoraConfig
from sits_lora.fp8 import selection
from sits_lora.ops import tuning

from test_fp8 import TARGETS, fp8_llama


@pytest.fixture
def fake_gpu_cache(tmp_path, monkeypatch):
    """A tuning cache in tmp_path, and a 'cuda' device named FakeGPU, without a GPU."""
    monkeypatch.setenv("SITS_LORA_TUNING_CACHE", str(tmp_path / "kernel_configs.json"))
    monkeypatch.setattr(tuning, "_cache", None)
    monkeypatch.setattr(tuning, "_packaged_path", lambda: str(tmp_path / "none.json"))
    monkeypatch.setattr(tuning, "_device_name", lambda device: "FakeGPU")
    yield torch.device("cuda")
    monkeypatch.setattr(tuning, "_cache", None)


def test_rule_without_measurement(fake_gpu_cache):
    use, why = selection.choose(fake_gpu_cache, 4096, 14336)
    assert use and "rule" in why and "56.0 Mi" in why
    use, why = selection.choose(fake_gpu_cache, 2048, 8192)
    assert not use and "too narrow" in why


def test_measurement_wins_over_rule(fake_gpu_cache):
    tuning.store_fp8_layer_measurement(fake_gpu_cache, 2048, 8192,
                                       {"ratio": 0.93, "use_fp8": True, "tokens": 8192, "rank": 16}, save=True)
    use, why = selection.choose(fake_gpu_cache, 2048, 8192)
    assert use and "measured" in why and "0.93x" in why
    tuning._cache = None  # read back from the file, as a new process would
    assert tuning.fp8_layer_measurement(fake_gpu_cache, 2048, 8192)["use_fp8"] is True
    assert tuning.fp8_layer_measurement(fake_gpu_cache, 4096, 4096) is None


def test_auto_quantizes_only_the_layers_that_pay(monkeypatch):
    """A tiny Llama with fp8 on (not emulated): the layers the choice refuses keep their bf16 nn.Linear."""
    from peft import get_peft_model

    from sits_lora.fp8 import fp8_layer_plan, frozen_weight_memory
    from sits_lora.fp8 import model as fp8_model
    from sits_lora.bases.fp8 import Fp8BaseLinear

    monkeypatch.setattr(fp8_model, "check_fp8_hardware", lambda device, emulate: None)  # no fp8 GPU here
    monkeypatch.setattr(selection, "choose", lambda device, k, n: (n >= 128, f"test: {n} outputs"))
    model = get_peft_model(fp8_llama(), SitsLoraConfig(r=8, target_modules=TARGETS, fp8="hybrid"))
    plan = fp8_layer_plan(model)
    assert len(plan) == 2 * len(TARGETS)
    for name, entry in plan.items():
        assert entry["base"] == ("fp8" if entry["out_features"] >= 128 else "bf16"), (name, entry)
        assert entry["why"] == f"test: {entry['out_features']} outputs"
    quantized = sum(isinstance(m, Fp8BaseLinear) for m in model.modules())
    assert quantized == sum(e["base"] == "fp8" for e in plan.values()) > 0
    assert frozen_weight_memory(model)["fp8_layers"] == quantized
    all_layers = get_peft_model(fp8_llama(), SitsLoraConfig(r=8, target_modules=TARGETS, fp8="hybrid",
                                                             fp8_layers="all"))
    assert all(e["base"] == "fp8" and e["why"] == "fp8_layers='all'" for e in fp8_layer_plan(all_layers).values())


def test_emulation_quantizes_every_layer():
    from peft import get_peft_model

    from sits_lora.fp8 import fp8_layer_plan

    model = get_peft_model(fp8_llama(), SitsLoraConfig(r=8, target_modules=TARGETS, fp8="hybrid", fp8_emulate=True))
    assert {e["base"] for e in fp8_layer_plan(model).values()} == {"fp8"}


@pytest.mark.parametrize("kwargs,message", [
    (dict(fp8="hybrid", fp8_layers="some"), "fp8_layers='some' is invalid"),
    (dict(fp8_layers="all"), "only apply with fp8 on"),
])
def test_config_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SitsLoraConfig(r=8, target_modules=TARGETS, **kwargs)
