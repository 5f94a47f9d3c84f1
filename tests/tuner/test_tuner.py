"""The sits_lora tuner against PEFT's LoRA: one table of cases driving generic checks (PEFT's way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

import sits_lora
from sits_lora import SitsLoraConfig, SitsLoraLinear, apply_native_lora, export_peft_lora

from conftest import REPO_ROOT, randomize_lora_weights, rel_err, tiny_llama, tiny_mlp

# name, model factory, config kwargs
TEST_CASES = [
    ("llama-qv", tiny_llama, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    ("llama-all-linear-rslora", tiny_llama, dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True)),
    ("llama-rank-pattern", tiny_llama,
     dict(r=6, lora_alpha=5, target_modules=["q_proj", "k_proj", "down_proj"], rank_pattern={"down_proj": 3})),
    ("mlp-bias-odd-rank", tiny_mlp, dict(r=5, lora_alpha=7, target_modules=["lin0", "lin1"])),
    ("mlp-trainable-bias", tiny_mlp, dict(r=3, lora_alpha=3, target_modules=["lin0", "lin1"], bias="all")),
    ("mlp-dropout", tiny_mlp, dict(r=4, lora_alpha=8, target_modules=["lin0", "lin1"], lora_dropout=0.25)),
]
CASE_IDS = [c[0] for c in TEST_CASES]


def _inputs(factory, seed=3, batch=3, seq=7):
    gen = torch.Generator().manual_seed(seed)
    if factory is tiny_llama:
        return {"input_ids": torch.randint(0, 97, (batch, seq), generator=gen)}
    return {"x": torch.randn(batch, seq, 24, generator=gen)}


def _run(model, inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out


def _pair(factory, kwargs, dtype=torch.float32, kernel="auto"):
    """(sits model, PEFT LoRA model) on identical base and adapter weights."""
    sits = get_peft_model(factory(dtype=dtype), SitsLoraConfig(kernel=kernel, **kwargs))
    peft = get_peft_model(factory(dtype=dtype), LoraConfig(**kwargs))
    randomize_lora_weights(sits)
    peft.load_state_dict(sits.state_dict())
    return sits, peft


@pytest.mark.parametrize("name,factory,kwargs", TEST_CASES, ids=CASE_IDS)
def test_injection_matches_peft(name, factory, kwargs):
    sits, peft = _pair(factory, kwargs)
    sits_layers = {n for n, m in sits.named_modules() if isinstance(m, SitsLoraLinear)}
    peft_layers = {n for n, m in peft.named_modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")}
    assert sits_layers == peft_layers and len(sits_layers) > 0
    assert sits.peft_config["default"].peft_type == "SITS_LORA"
    sits_trainable = sorted(n for n, p in sits.named_parameters() if p.requires_grad)
    peft_trainable = sorted(n for n, p in peft.named_parameters() if p.requires_grad)
    assert sits_trainable == peft_trainable


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("name,factory,kwargs", TEST_CASES, ids=CASE_IDS)
def test_forward_and_every_gradient_equal_peft(name, factory, kwargs, kernel):
    sits, peft = _pair(factory, kwargs, kernel=kernel)
    sits.train()
    peft.train()
    inputs = _inputs(factory)
    torch.manual_seed(11)
    out_s = _run(sits, inputs)
    torch.manual_seed(11)
    out_p = _run(peft, inputs)
    assert rel_err(out_s, out_p) < 1e-6
    grad_out = torch.randn_like(out_s)
    out_s.backward(grad_out)
    out_p.backward(grad_out)
    peft_params = dict(peft.named_parameters())
    checked = 0
    for n, p in sits.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, n
            assert rel_err(p.grad, peft_params[n].grad) < 1e-5, n  # fp32: only summation order differs
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_matches_peft(dtype):
    kwargs = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    sits, peft = _pair(tiny_llama, kwargs, dtype=dtype)
    inputs = _inputs(tiny_llama)
    out_s, out_p = _run(sits, inputs), _run(peft, inputs)
    assert out_s.dtype == out_p.dtype == dtype
    assert rel_err(out_s, out_p) < 1e-2
    out_s.float().square().mean().backward()
    out_p.float().square().mean().backward()
    peft_params = dict(peft.named_parameters())
    for n, p in sits.named_parameters():
        if p.requires_grad:
            # PEFT keeps adapters in fp32 under a half-precision base (autocast_adapter_dtype)
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
            assert rel_err(p.grad, peft_params[n].grad) < 2e-2, n


@pytest.mark.parametrize("shape", [(5,), (2, 5), (2, 3, 5)], ids=["1d-lead", "2d-lead", "3d-lead"])
def test_any_leading_dims(shape):
    model = get_peft_model(tiny_mlp(), SitsLoraConfig(r=3, target_modules=["lin0"]))
    randomize_lora_weights(model)
    layer = model.base_model.model.lin0
    x = torch.randn(*shape, 24, requires_grad=True)
    y = layer(x)
    assert y.shape == (*shape, 37)
    flat = layer(x.detach().reshape(-1, 24))
    torch.testing.assert_close(y.reshape(-1, 37), flat)
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("name,factory,kwargs", TEST_CASES, ids=CASE_IDS)
def test_save_load_round_trip(name, factory, kwargs, tmp_path):
    sits, _ = _pair(factory, kwargs)
    sits.eval()
    inputs = _inputs(factory)
    expected = _run(sits, inputs)
    sits.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "SITS_LORA" and config["kernel"] == "auto"
    assert (tmp_path / "adapter_model.safetensors").exists()
    again = PeftModel.from_pretrained(factory(), tmp_path)
    assert isinstance(again.peft_config["default"], SitsLoraConfig)
    assert any(isinstance(m, SitsLoraLinear) for m in again.modules())
    torch.testing.assert_close(_run(again, inputs), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name,factory,kwargs", TEST_CASES, ids=CASE_IDS)
def test_merge_unmerge(name, factory, kwargs):
    sits, _ = _pair(factory, kwargs)
    sits.eval()
    inputs = _inputs(factory)
    expected = _run(sits, inputs)
    before = {n: p.detach().clone() for n, p in sits.named_parameters() if "base_layer" in n}
    sits.merge_adapter()
    torch.testing.assert_close(_run(sits, inputs), expected, rtol=1e-4, atol=1e-5)
    sits.unmerge_adapter()
    for n, p in sits.named_parameters():
        if n in before:
            torch.testing.assert_close(p, before[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_run(sits, inputs), expected, rtol=1e-5, atol=1e-6)
    merged = sits.merge_and_unload()
    assert not any(isinstance(m, SitsLoraLinear) for m in merged.modules())
    torch.testing.assert_close(_run(merged, inputs), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,factory,kwargs", TEST_CASES, ids=CASE_IDS)
def test_disable_adapter_gives_base(name, factory, kwargs):
    base = factory()
    inputs = _inputs(factory)
    expected = _run(base, inputs)
    sits, _ = _pair(factory, kwargs)
    sits.eval()
    assert rel_err(_run(sits, inputs), expected) > 1e-4  # the adapter does something
    with sits.disable_adapter():
        torch.testing.assert_close(_run(sits, inputs), expected, rtol=0, atol=0)


def test_two_adapters_set_adapter_and_mixed_batch():
    kwargs = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(tiny_llama(), SitsLoraConfig(**kwargs))
    model.add_adapter("other", SitsLoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    randomize_lora_weights(model)
    model.eval()
    inputs = _inputs(tiny_llama)
    out_default = _run(model, inputs)
    model.set_adapter("other")
    out_other = _run(model, inputs)
    assert rel_err(out_default, out_other) > 1e-3
    with model.disable_adapter():
        out_base = _run(model, inputs)
    # rows 0 / 1 / 2 use default / other / no adapter, in one batch
    mixed = model(**inputs, adapter_names=["default", "other", "__base__"]).logits
    torch.testing.assert_close(mixed[0], out_default[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[1], out_other[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[2], out_base[2], rtol=1e-5, atol=1e-6)
    # the same against PEFT's LoRA with the same weights
    peft = get_peft_model(tiny_llama(), LoraConfig(**kwargs))
    peft.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    peft.load_state_dict(model.state_dict())
    peft.eval()
    peft_mixed = peft(**inputs, adapter_names=["default", "other", "__base__"]).logits
    torch.testing.assert_close(mixed, peft_mixed, rtol=1e-5, atol=1e-6)


def test_two_active_adapters_sum_like_peft():
    sits = get_peft_model(tiny_mlp(), SitsLoraConfig(r=3, target_modules=["lin0", "lin1"]))
    sits.add_adapter("b", SitsLoraConfig(r=2, target_modules=["lin0"]))
    peft = get_peft_model(tiny_mlp(), LoraConfig(r=3, target_modules=["lin0", "lin1"]))
    peft.add_adapter("b", LoraConfig(r=2, target_modules=["lin0"]))
    randomize_lora_weights(sits)
    peft.load_state_dict(sits.state_dict())
    sits.base_model.set_adapter(["default", "b"])
    peft.base_model.set_adapter(["default", "b"])
    x = _inputs(tiny_mlp)
    torch.testing.assert_close(_run(sits, x), _run(peft, x), rtol=1e-5, atol=1e-6)


def test_auto_peft_model_for_causal_lm_round_trip(tmp_path):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_llama().save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    model = apply_native_lora(AutoModelForCausalLM.from_pretrained(base_dir), SitsLoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    randomize_lora_weights(model)
    model.eval()
    inputs = _inputs(tiny_llama)
    expected = _run(model, inputs)
    model.save_pretrained(adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    again = AutoPeftModelForCausalLM.from_pretrained(adapter_dir)
    torch.testing.assert_close(_run(again, inputs), expected, rtol=0, atol=0)


_STOCK_PEFT_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base_dir, adapter_dir, inputs_path, expected_path = sys.argv[1:5]
    assert "sits_lora" not in sys.modules
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    assert "sits_lora" not in sys.modules
    assert model.peft_config["default"].peft_type == "LORA"
    ids = torch.load(inputs_path)
    out = model(input_ids=ids).logits
    expected = torch.load(expected_path)
    print(json.dumps({"max_abs_diff": (out - expected).abs().max().item()}))
    """
)


def test_export_loads_in_stock_peft_without_sits_lora(tmp_path):
    base_dir, export_dir = tmp_path / "base", tmp_path / "export"
    tiny_llama().save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        SitsLoraConfig(r=5, lora_alpha=10, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"],
                       rank_pattern={"up_proj": 2}),
    )
    randomize_lora_weights(model)
    model.eval()
    ids = _inputs(tiny_llama)["input_ids"]
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(model(input_ids=ids).logits.detach(), tmp_path / "expected.pt")
    export_peft_lora(model, export_dir)
    config = json.loads((export_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and "kernel" not in config
    assert set(load_file(export_dir / "adapter_model.safetensors")) == set(
        load_file(_saved(model, tmp_path / "native") / "adapter_model.safetensors"))
    script = tmp_path / "stock.py"
    script.write_text(_STOCK_PEFT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(script), str(base_dir), str(export_dir), str(tmp_path / "ids.pt"), str(tmp_path / "expected.pt")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["max_abs_diff"] == 0.0


def _saved(model, path):
    model.save_pretrained(path)
    return path


def test_loading_without_import_fails_with_the_documented_key(tmp_path):
    """Without `import sits_lora`, PEFT cannot know SITS_LORA: it fails with KeyError 'SITS_LORA',
    which the README documents ("import sits_lora first")."""
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_llama().save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), SitsLoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter_dir)
    code = (
        "import sys; from peft import PeftModel; from transformers import AutoModelForCausalLM\n"
        f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(base_dir)!r}), {str(adapter_dir)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "KeyError: 'SITS_LORA'" in proc.stderr
    readme = open(os.path.join(REPO_ROOT, "README.md")).read()
    assert "KeyError: 'SITS_LORA'" in readme and "import sits_lora" in readme


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(r=0), "SitsLoraConfig.r=0 is invalid"),
        (dict(r=-3), "SitsLoraConfig.r=-3 is invalid"),
        (dict(r=2.5), "SitsLoraConfig.r=2.5 is invalid"),
        (dict(kernel="cuda"), "SitsLoraConfig.kernel='cuda' is invalid: allowed values are 'auto', 'triton', 'torch'"),
        (dict(lora_dropout=1.5), "SitsLoraConfig.lora_dropout=1.5 is invalid"),
        (dict(lora_alpha="big"), "SitsLoraConfig.lora_alpha='big' is invalid"),
        (dict(bias="some"), "SitsLoraConfig.bias='some' is invalid: allowed values are 'none', 'all', 'lora_only'"),
        (dict(rank_pattern={"q_proj": 0}), "SitsLoraConfig.rank_pattern={'q_proj': 0} is invalid"),
    ],
)
def test_bad_config_values_name_field_value_and_fix(kwargs, needle):
    with pytest.raises(ValueError) as info:
        SitsLoraConfig(target_modules=["q_proj"], **kwargs)
    assert needle in str(info.value)


def test_rank_larger_than_layer_logs_naming_layer_and_limit(caplog):
    """PEFT accepts a rank above a layer's smaller side, so a drop-in does too (it logs, naming the fix)."""
    with caplog.at_level("WARNING", logger="sits_lora"):
        model = get_peft_model(tiny_mlp(), SitsLoraConfig(r=20, target_modules=["lin1"]))  # lin1 is 37 -> 19
    msg = caplog.text
    assert "r=20" in msg and "lin1" in msg and "(19)" in msg and "rank_pattern={'lin1': 19}" in msg
    assert model(torch.randn(3, 24)).shape == (3, 19)


def test_a_target_matching_nothing_raises_peft_error_with_the_names_that_exist():
    with pytest.raises(ValueError) as info:
        get_peft_model(tiny_llama(), SitsLoraConfig(r=2, target_modules=["qkv_proj"]))
    assert type(info.value) is type(_peft_error(["qkv_proj"]))   # PEFT's own class (NoMatchingPeftModuleError)
    msg = str(info.value)
    assert msg.startswith(str(_peft_error(["qkv_proj"])))         # PEFT's words first: what callers match on
    assert "'q_proj'" in msg.split("exist in")[1] and "'down_proj'" in msg and "'default'" not in msg


def test_a_second_adapter_matching_nothing_names_the_model_layers_not_lora_parts():
    model = get_peft_model(tiny_llama(), SitsLoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError) as info:
        model.add_adapter("other", SitsLoraConfig(r=2, target_modules=["qkv_proj"]))
    names = str(info.value).split("exist in")[1]
    assert "'q_proj'" in names and "'base_layer'" not in names and "'default'" not in names


def test_a_partly_matching_list_adapts_the_rest_as_peft_and_logs_the_misses(caplog):
    """A list naming the projections of several model families is common; PEFT adapts what matches."""
    targets = ["q_proj", "qkv_proj"]
    with caplog.at_level("WARNING", logger="sits_lora"):
        model = get_peft_model(tiny_llama(), SitsLoraConfig(r=2, target_modules=targets))
    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=targets))
    assert model.targeted_module_names == peft_model.targeted_module_names
    assert "'qkv_proj' match no module" in caplog.text and "'q_proj'" in caplog.text.split("exist in")[1]


def _peft_error(targets):
    try:
        get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=targets))
    except ValueError as error:
        return error
    raise AssertionError("PEFT accepted it")


def test_apply_native_lora_is_get_peft_model():
    a = apply_native_lora(tiny_llama(), SitsLoraConfig(r=2, target_modules=["q_proj"]))
    b = get_peft_model(tiny_llama(), SitsLoraConfig(r=2, target_modules=["q_proj"]))
    assert type(a) is type(b)
    assert sorted(a.state_dict()) == sorted(b.state_dict())
    with pytest.raises(TypeError, match="expects a SitsLoraConfig"):
        apply_native_lora(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))


def test_export_refuses_wrong_inputs(tmp_path):
    with pytest.raises(TypeError, match="expects the PeftModel"):
        export_peft_lora(tiny_llama(), tmp_path)
    model = get_peft_model(tiny_llama(), SitsLoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="adapter_name='nope' does not exist"):
        export_peft_lora(model, tmp_path, adapter_name="nope")


def test_registration_is_idempotent_and_registered():
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    sits_lora.register_with_peft()
    assert PEFT_TYPE_TO_CONFIG_MAPPING["SITS_LORA"] is SitsLoraConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING["SITS_LORA"] is sits_lora.SitsLoraModel
