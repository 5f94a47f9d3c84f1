"""SitsLoraConfig is a drop-in for LoraConfig: the same arguments give the same adapters, outputs and errors.

One table of small models and configurations in the spirit of PEFT's own LoRA suite (written here, not
copied): a classifier head narrower than r, Conv2d, embeddings, multi-head attention, GPT-2's Conv1D
with fan_in_fan_out, modules_to_save. Each case builds the model twice from one seed, wraps one copy
with LoraConfig and the other with SitsLoraConfig (same arguments), gives both the same adapter
weights, and checks the state dict's keys and shapes, the outputs, merge / safe_merge / unmerge,
disable_adapter, a second adapter, add_weighted_adapter and save / load.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from sits_lora import SitsLoraConfig

from conftest import rel_err


class _MLP(nn.Module):
    """A classifier whose head (20 -> 2) is narrower than the rank of most adapters."""

    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(10, 20, bias=True)
        self.relu = nn.ReLU()
        self.lin1 = nn.Linear(20, 2, bias=True)

    def forward(self, x):
        return self.lin1(self.relu(self.lin0(x)))


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.lin = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        return self.lin(torch.relu(self.conv(x)).flatten(1))


class _Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 12)
        self.lin = nn.Linear(12, 6)

    def forward(self, x):
        return self.lin(self.emb(x))


class _MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.mha(x, x, x)[0])


class _GPT2Conv1D(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_attn = Conv1D(24, 8)  # nx=8 in, nf=24 out: weight stored (in, out), hence fan_in_fan_out
        self.head = nn.Linear(24, 4)

    def forward(self, x):
        return self.head(self.c_attn(x))


def _x(case):
    g = torch.Generator().manual_seed(3)
    if case == "emb":
        return torch.randint(0, 30, (4, 7), generator=g)
    if case == "conv":
        return torch.randn(2, 3, 6, 6, generator=g)
    if case in ("mha",):
        return torch.randn(2, 5, 16, generator=g)
    if case == "conv1d":
        return torch.randn(3, 5, 8, generator=g)
    return torch.randn(6, 10, generator=g)


# name: (model class, LoraConfig keyword arguments)
CASES = {
    "mlp r8, head narrower than r": ("mlp", _MLP, dict(r=8, target_modules=["lin0", "lin1"])),
    "mlp r32 everywhere": ("mlp", _MLP, dict(r=32, lora_alpha=16, target_modules=["lin0", "lin1"])),
    "mlp rslora, bias, dropout": ("mlp", _MLP, dict(r=4, use_rslora=True, lora_dropout=0.1, bias="lora_only",
                                                    target_modules=["lin0", "lin1"])),
    "mlp rank_pattern": ("mlp", _MLP, dict(r=4, rank_pattern={"lin1": 16}, alpha_pattern={"lin0": 2},
                                           target_modules=["lin0", "lin1"])),
    "mlp modules_to_save": ("mlp", _MLP, dict(r=4, target_modules=["lin0"], modules_to_save=["lin1"])),
    "mlp all-linear": ("mlp", _MLP, dict(r=4, target_modules="all-linear")),
    "mlp regex": ("mlp", _MLP, dict(r=4, target_modules=r".*lin\d")),
    "conv2d": ("conv", _Conv, dict(r=4, target_modules=["conv", "lin"])),
    "embedding": ("emb", _Emb, dict(r=4, target_modules=["emb", "lin"])),
    "multi-head attention": ("mha", _MHA, dict(r=4, target_modules=["mha", "out"])),
    "gpt2 Conv1D": ("conv1d", _GPT2Conv1D, dict(r=4, fan_in_fan_out=True, target_modules=["c_attn", "head"])),
}


def _pair(name):
    case, cls, kwargs = CASES[name]
    kwargs = dict(kwargs, init_lora_weights=False)  # B != 0: the adapters change the outputs
    torch.manual_seed(0)
    base = cls().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the narrow-head warning (its own test below) and PEFT's own notes
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**kwargs))
        sits_model = get_peft_model(copy.deepcopy(base), SitsLoraConfig(**kwargs))
    set_peft_model_state_dict(sits_model, get_peft_model_state_dict(peft_model))
    for module in ("lin1",) if "modules_to_save" in kwargs else ():
        sits_model.base_model.model.get_submodule(module).load_state_dict(
            peft_model.base_model.model.get_submodule(module).state_dict())
    return case, peft_model.eval(), sits_model.eval()


def _close(a, b, tol=1e-5):
    return rel_err(a, b) < tol


@pytest.mark.parametrize("name", list(CASES))
def test_same_adapter_same_outputs(name):
    case, peft_model, sits_model = _pair(name)
    x = _x(case)
    peft_state, sits_state = get_peft_model_state_dict(peft_model), get_peft_model_state_dict(sits_model)
    assert {k: v.shape for k, v in peft_state.items()} == {k: v.shape for k, v in sits_state.items()}
    assert _close(sits_model(x), peft_model(x))
    with peft_model.disable_adapter(), sits_model.disable_adapter():
        assert _close(sits_model(x), peft_model(x))
    sits_model.merge_adapter()
    peft_model.merge_adapter()
    assert _close(sits_model(x), peft_model(x))
    sits_model.unmerge_adapter()
    peft_model.unmerge_adapter()
    assert _close(sits_model(x), peft_model(x))
    merged_sits = copy.deepcopy(sits_model).merge_and_unload(safe_merge=True)
    merged_peft = copy.deepcopy(peft_model).merge_and_unload(safe_merge=True)
    assert _close(merged_sits(x), merged_peft(x))


@pytest.mark.parametrize("name", ["mlp r8, head narrower than r", "conv2d", "gpt2 Conv1D"])
def test_training_step_same_gradients(name):
    case, peft_model, sits_model = _pair(name)
    x = _x(case)
    for model in (peft_model, sits_model):
        model.train()
        out = model(x)
        (out.float() ** 2).mean().backward()
    peft_grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    sits_grads = {n: p.grad for n, p in sits_model.named_parameters() if p.requires_grad}
    assert peft_grads.keys() == sits_grads.keys()
    for n in peft_grads:
        assert _close(sits_grads[n], peft_grads[n]), n


@pytest.mark.parametrize("combination", ["linear", "cat", "svd", "ties", "dare_linear", "magnitude_prune"])
def test_add_weighted_adapter_every_combination(combination):
    """PEFT's adapter arithmetic: the same adapter, or the same error. 'cat' of ranks 4 and 8 makes 12, above
    the head's 2 outputs; 'svd' at rank 8 on that head fails inside PEFT itself (a 2 x 2 B), and must fail
    the same way here."""
    outcomes = {}
    for config_cls in (LoraConfig, SitsLoraConfig):
        torch.manual_seed(0)
        base = _MLP().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(base, config_cls(r=4, target_modules=["lin0", "lin1"], init_lora_weights=False))
            # PEFT wants equal ranks for the element-wise combinations, any ranks for cat and svd
            r2 = 8 if combination in ("cat", "svd") else 4
            model.add_adapter("second", config_cls(r=r2, target_modules=["lin0", "lin1"], init_lora_weights=False))
            kwargs = dict(density=0.5) if combination in ("ties", "dare_linear", "magnitude_prune") else {}
            torch.manual_seed(1)  # dare draws a random mask
            try:
                model.add_weighted_adapter(["default", "second"], [0.7, 0.4], "mixed", combination_type=combination,
                                           **kwargs)
                model.set_adapter("mixed")
                shapes = {k: v.shape for k, v in get_peft_model_state_dict(model, adapter_name="mixed").items()}
                outcomes[config_cls] = ("ok", model(_x("mlp")), shapes)
            except Exception as error:  # noqa: BLE001 - compared with PEFT's outcome below
                outcomes[config_cls] = ("error", type(error), str(error))
    peft_outcome, sits_outcome = outcomes[LoraConfig], outcomes[SitsLoraConfig]
    assert sits_outcome[0] == peft_outcome[0], (peft_outcome, sits_outcome)
    if peft_outcome[0] == "error":
        assert sits_outcome[1:] == peft_outcome[1:]
    else:
        assert sits_outcome[2] == peft_outcome[2]
        assert _close(sits_outcome[1], peft_outcome[1], tol=1e-4)


def test_rank_above_a_layers_side_logs_naming_it_and_works(caplog):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as raised, caplog.at_level("WARNING", logger="sits_lora"):
        warnings.simplefilter("always")
        model = get_peft_model(_MLP(), SitsLoraConfig(r=8, target_modules=["lin0", "lin1"]))
    assert "r=8 is larger than the smaller dimension (2) of layer 'lin1'" in caplog.text
    # a log line, not a warning: LoraConfig raises none here, and a drop-in raises what PEFT raises
    assert not [w for w in raised if "smaller dimension" in str(w.message)]
    assert model.base_model.model.lin1.lora_A["default"].weight.shape == (8, 20)
    model(_x("mlp")).sum().backward()


def test_save_and_load_round_trip_like_peft(tmp_path):
    case, peft_model, sits_model = _pair("mlp r8, head narrower than r")
    sits_model.save_pretrained(tmp_path / "sits")
    peft_model.save_pretrained(tmp_path / "peft")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(_MLP().eval(), tmp_path / "sits")
    assert type(loaded.peft_config["default"]) is SitsLoraConfig
    assert _close(loaded(_x(case)), peft_model(_x(case)))
    saved = {p.name for p in (tmp_path / "sits").iterdir()}
    assert saved == {p.name for p in (tmp_path / "peft").iterdir()}


@pytest.mark.parametrize("kwargs", [dict(target_modules=["nope"]), dict(r=0, target_modules=["lin0"]),
                                    dict(lora_dropout=1.5, target_modules=["lin0"])])
def test_bad_configurations_fail_where_peft_fails(kwargs):
    outcomes = []
    for config_cls in (LoraConfig, SitsLoraConfig):
        try:
            get_peft_model(_MLP(), config_cls(**kwargs))
            outcomes.append(None)
        except Exception as error:  # noqa: BLE001 - the outcome, whatever it is, is what is compared
            outcomes.append(type(error))
    peft_outcome, sits_outcome = outcomes
    assert (peft_outcome is None) == (sits_outcome is None)
    if peft_outcome is not None:
        assert issubclass(sits_outcome, peft_outcome) or issubclass(peft_outcome, sits_outcome)


def _warnings_of(config_cls, name):
    _, cls, kwargs = CASES[name]
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        get_peft_model(cls().eval(), config_cls(**kwargs))
    # every warning, category and words: the same model class, so even the messages that name it must match
    return sorted((w.category.__name__, str(w.message)) for w in raised)


@pytest.mark.parametrize("name", list(CASES))
def test_same_warnings_as_peft(name):
    """Test suites check the last warning or turn warnings into errors: a drop-in raises what PEFT raises."""
    assert _warnings_of(SitsLoraConfig, name) == _warnings_of(LoraConfig, name)


def test_a_layer_class_registered_for_linear_wins_as_in_peft():
    """LoraConfig._register_custom_module({nn.Linear: MyLayer}) puts the user's own layer on every Linear target,
    in place of PEFT's lora.Linear; with SitsLoraConfig it must win over SitsLoraLinear the same way."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    class MyLoraLinear(LoraLinear):
        def forward(self, x, *args, **kwargs):
            return super().forward(x, *args, **kwargs) + 1.0

    for config_cls in (LoraConfig, SitsLoraConfig):
        config = config_cls(r=4, target_modules=["lin0", "lin1"])
        config._register_custom_module({nn.Linear: MyLoraLinear})
        model = get_peft_model(_MLP(), config)
        assert type(model.base_model.model.lin0) is MyLoraLinear, config_cls
        assert type(model.base_model.model.lin1) is MyLoraLinear, config_cls


def test_hotswap_copies_a_saved_adapter_in_place(tmp_path):
    """peft.utils.hotswap (what diffusers' load_lora_weights(hotswap=True) calls) swaps a SITS_LORA adapter's
    weights in place: the same outputs as loading the second adapter, no new module."""
    from peft.utils.hotswap import hotswap_adapter

    saved = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = get_peft_model(_MLP(), SitsLoraConfig(r=4, lora_alpha=8, target_modules=["lin0", "lin1"],
                                                      init_lora_weights=False))
        model.save_pretrained(tmp_path / f"a{seed}")
        saved.append(tmp_path / f"a{seed}")
    x = _x("mlp")
    torch.manual_seed(0)
    base = _MLP().eval()
    second = PeftModel.from_pretrained(copy.deepcopy(base), saved[1]).eval()
    model = PeftModel.from_pretrained(copy.deepcopy(base), saved[0]).eval()
    layer = model.base_model.model.lin0
    assert not _close(model(x), second(x))
    hotswap_adapter(model, str(saved[1]), adapter_name="default")
    assert model.base_model.model.lin0 is layer
    assert _close(model(x), second(x))


def test_pissa_adapter_converts_to_plain_lora_on_save(tmp_path):
    """save_pretrained(path_initial_model_for_weight_conversion=...) turns a PiSSA adapter (which changed the base
    weights) into one that applies to the original base, as with LoraConfig."""
    x = _x("mlp")
    torch.manual_seed(0)
    base = _MLP().eval()
    model = get_peft_model(copy.deepcopy(base), SitsLoraConfig(r=2, init_lora_weights="pissa",
                                                                target_modules=["lin0", "lin1"]))
    model.save_pretrained(tmp_path / "init")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.05 * torch.randn_like(param))   # "training"
    model.eval()
    model.save_pretrained(tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "init"))
    again = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "converted").eval()
    assert again.peft_config["default"].r == 4   # PiSSA's conversion doubles the rank
    assert _close(again(x), model(x), tol=1e-4)


def test_saving_an_ungathered_shard_warns_as_peft_does(tmp_path):
    """PEFT warns when save_pretrained meets a 1-D lora_A / lora_B (a ZeRO-3 / FSDP shard saved without
    gathering) for its LoRA types; a SITS_LORA adapter gets the same warning, and the files are still written."""
    from peft.utils import save_and_load

    if not hasattr(save_and_load, "_validate_lora_adapter_state_dict"):
        pytest.skip("this PEFT version does not check the saved shapes")
    model = get_peft_model(_MLP(), SitsLoraConfig(r=4, target_modules=["lin0"]))
    model.base_model.model.lin0.lora_A["default"].weight.data = torch.zeros(32)
    with pytest.warns(Warning, match="ZeRO-3 / FSDP shards"):
        model.save_pretrained(tmp_path / "shard")
    assert (tmp_path / "shard" / "adapter_config.json").exists()


def _mixed(config_cls, base):
    """base + an adapter of config_cls + a LoHa adapter, both active, in a PeftMixedModel."""
    from peft import LoHaConfig

    torch.manual_seed(5)
    model = get_peft_model(copy.deepcopy(base), config_cls(r=4, target_modules=["lin0", "lin1"],
                                                           init_lora_weights=False), mixed=True)
    model.add_adapter("loha", LoHaConfig(r=4, target_modules=["lin0"], init_weights=False))
    model.set_adapter(["default", "loha"])
    return model.eval()


def test_a_plain_sits_adapter_mixes_with_other_types_as_a_lora_one(tmp_path):
    """get_peft_model(..., mixed=True) and PeftMixedModel.from_pretrained take a SITS_LORA adapter (PEFT's LoRA
    layer runs it there): the same outputs as LoraConfig in the same mix."""
    from peft import PeftMixedModel

    torch.manual_seed(0)
    base = _MLP().eval()
    x = _x("mlp")
    lora, sits = _mixed(LoraConfig, base), _mixed(SitsLoraConfig, base)
    assert sits.peft_config["default"].peft_type.value == "SITS_LORA"
    assert not _close(lora(x), base(x))
    assert _close(sits(x), lora(x))
    # a saved sits adapter loads into a mixed model
    torch.manual_seed(7)
    saved = get_peft_model(copy.deepcopy(base), SitsLoraConfig(r=4, target_modules=["lin0"], init_lora_weights=False))
    saved.save_pretrained(tmp_path / "a")
    loaded = PeftMixedModel.from_pretrained(copy.deepcopy(base), tmp_path / "a").eval()
    assert _close(loaded(x), saved.eval()(x))


@pytest.mark.parametrize("field, value", [("fp8", "hybrid"), ("use_dynamic_rank", True), ("kernel", "triton")])
def test_a_mixed_model_refuses_what_only_sits_layers_run(field, value):
    needs = {"fp8": dict(fp8_emulate=True), "use_dynamic_rank": dict(rank_buckets=[1, 2, 4], target_mean_rank=2)}
    extra = needs.get(field, {})
    config = SitsLoraConfig(r=4, target_modules=["lin0"], **{field: value}, **extra)
    with pytest.raises(ValueError, match=rf"sets {field}={value!r} \(needs .*without\s+mixed=True"):
        get_peft_model(_MLP(), config, mixed=True)
    # other types keep PEFT's own check and message
    from peft import PromptTuningConfig

    with pytest.raises(ValueError, match="is not compatible with the `PeftMixedModel`"):
        get_peft_model(_MLP(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2), mixed=True)


def test_transformers_adapter_methods_take_a_sits_config(tiny_model_dir, tmp_path, monkeypatch):
    """transformers' own adapter methods on a PreTrainedModel (add_adapter, disable / enable_adapters,
    save_pretrained, load_adapter, AutoModelForCausalLM.from_pretrained on an adapter folder) with a
    SitsLoraConfig give the outputs LoraConfig gives there."""
    import json

    import transformers.integrations.peft as transformers_peft
    from packaging import version
    from peft import __version__ as peft_version
    from transformers import AutoModelForCausalLM

    if version.parse(peft_version) < version.parse(transformers_peft.MIN_PEFT_VERSION):
        # some transformers releases ask for a PEFT newer than PyPI's newest (5.25 asks for 0.22, PyPI has 0.21.2):
        # their methods refuse PEFT's own LoraConfig too. Step past that gate to test the code behind it.
        monkeypatch.setattr(transformers_peft, "check_peft_version", lambda min_version: None)
    x = torch.arange(12)[None] % 50
    outputs = {}
    for name, config_cls in (("lora", LoraConfig), ("sits", SitsLoraConfig)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        base = model(x).logits
        torch.manual_seed(3)
        model.add_adapter(config_cls(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                          adapter_name="a")
        adapted = model(x).logits
        assert not _close(adapted, base)
        model.disable_adapters()
        assert _close(model(x).logits, base)
        model.enable_adapters()
        model.save_pretrained(tmp_path / name)
        again = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        again.load_adapter(tmp_path / name, adapter_name="a")
        assert _close(again(x).logits, adapted)
        saved = json.loads((tmp_path / name / "adapter_config.json").read_text())
        saved["base_model_name_or_path"] = str(tiny_model_dir)
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(saved))
        assert _close(AutoModelForCausalLM.from_pretrained(tmp_path / name)(x).logits, adapted)
        outputs[name] = adapted
    assert json.loads((tmp_path / "sits" / "adapter_config.json").read_text())["peft_type"] == "SITS_LORA"
    assert _close(outputs["sits"], outputs["lora"])
