"""export_peft_lora(model, path, rank=k): a nested adapter as a plain rank-k LoRA checkpoint for stock PEFT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file

from sits_lora import SitsLoraConfig, export_peft_lora, truncate_rank

from conftest import randomize_lora_weights, tiny_llama

_STOCK = textwrap.dedent(
    """
    import json, sys, torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base_dir, adapter_dir, ids_path, expected_path = sys.argv[1:5]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    assert "sits_lora" not in sys.modules
    with torch.no_grad():
        out = model(input_ids=torch.load(ids_path)).logits
    print(json.dumps({"peft_type": model.peft_config["default"].peft_type.value,
                      "max_abs_diff": (out - torch.load(expected_path)).abs().max().item()}))
    """
)


def _model(base, scheduler="entropy-gated", use_rslora=True):
    kwargs = dict(target_mean_rank=4) if scheduler != "static" else {}
    config = SitsLoraConfig(r=8, lora_alpha=6, use_rslora=use_rslora, target_modules=["q_proj", "v_proj", "up_proj"],
                            use_dynamic_rank=True, rank_scheduler=scheduler, rank_buckets=[2, 4, 8], **kwargs)
    model = get_peft_model(base, config)
    randomize_lora_weights(model)
    return model.eval()


def _ids():
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_export_with_rank_loads_in_stock_peft_without_sits_lora(tmp_path):
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    tiny_llama().save_pretrained(base_dir)
    model = _model(AutoModelForCausalLM.from_pretrained(base_dir))
    export_peft_lora(model, tmp_path / "export", rank=4)  # the routed model itself is left as it is
    assert any(m.routing_on("default") for m in model.modules() if hasattr(m, "routing_on"))
    config = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and "use_dynamic_rank" not in config
    tensors = load_file(tmp_path / "export" / "adapter_model.safetensors")
    assert not [k for k in tensors if "router" in k or "probe" in k]
    assert {tuple(v.shape) for k, v in tensors.items() if "lora_A" in k} == {(4, 48)}
    with torch.no_grad():
        expected = truncate_rank(model, 4)(input_ids=_ids()).logits  # the truncated adapter equals the masked one
    torch.save(_ids(), tmp_path / "ids.pt")
    torch.save(expected, tmp_path / "expected.pt")
    (tmp_path / "stock.py").write_text(_STOCK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(tmp_path / "stock.py"), str(base_dir), str(tmp_path / "export"),
                           str(tmp_path / "ids.pt"), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["peft_type"] == "LORA" and result["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("use_rslora", [True, False], ids=["rslora", "alpha-over-r"])
def test_export_with_rank_keeps_the_scale(tmp_path, use_rslora):
    """PEFT derives the scale from r and lora_alpha; the rank-k export carries the alpha that keeps it."""
    model = _model(tiny_llama(), use_rslora=use_rslora)
    export_peft_lora(model, tmp_path, rank=2)
    plain = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    assert plain.peft_config["default"].peft_type == "LORA"
    with torch.no_grad():
        expected = truncate_rank(model, 2)(input_ids=_ids()).logits
        torch.testing.assert_close(plain(input_ids=_ids()).logits, expected, rtol=1e-5, atol=1e-6)


def test_export_of_a_routed_adapter_needs_a_rank(tmp_path):
    model = _model(tiny_llama())
    with pytest.raises(ValueError, match=r"routes each token to its own rank .* Pass rank=k .* e.g. rank=4"):
        export_peft_lora(model, tmp_path / "a")
    with pytest.raises(ValueError, match=r"export_peft_lora: rank=16 is invalid: it must be an integer between 1 "
                                         r"and the adapter's rank r=8, ideally a bucket of \[2, 4, 8\]"):
        export_peft_lora(model, tmp_path / "b", rank=16)
    static = get_peft_model(tiny_llama(), SitsLoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="rank=2 needs an adapter trained with nested rank dimensions"):
        export_peft_lora(static, tmp_path / "c", rank=2)
    export_peft_lora(static, tmp_path / "d", rank=4)  # its own rank: the ordinary export


def test_static_nested_adapter_exports_at_full_rank(tmp_path):
    model = _model(tiny_llama(), scheduler="static")
    export_peft_lora(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == pytest.approx(6.0)
