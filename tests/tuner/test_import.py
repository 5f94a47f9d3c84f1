"""``import sits_lora`` is light, the command line answers --help without torch, and PEFT learns SITS_LORA
whatever the order of the imports (sits_lora.registry)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_loads_neither_torch_nor_peft():
    proc = _python("import sys, sits_lora; print(sorted(m for m in ('torch', 'peft', 'transformers', 'triton') "
                   "if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_help_and_argument_errors_answer_without_torch():
    code = ("import sys\nfrom sits_lora.cli import main\n"
            "for argv in (['--help'], ['profile', '--steps', '0']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        print('exit', e.code)\n"
            "print('torch' in sys.modules)")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-3:] == ["exit 0", "exit 2", "False"]
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sits_lora", "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "check" in proc.stdout
    assert time.perf_counter() - t < 5.0  # ~0.1 s here; the bound is generous for a loaded CI machine


ORDERS = {
    "sits_lora, then peft": "import sits_lora\nimport peft",
    "peft, then sits_lora": "import peft\nimport sits_lora",
    "a public name first": "from sits_lora import SitsLoraConfig",
    "a layer module first": "import sits_lora.layers.linear",
    "the config package first": "from sits_lora.config import SitsLoraConfig",
    "the trainer first": "from sits_lora import NativeLoraTrainer",
    "peft's model class only": "import sits_lora\nfrom peft import PeftModel",
}


@pytest.mark.parametrize("imports", list(ORDERS.values()), ids=list(ORDERS))
def test_peft_knows_sits_lora_whatever_the_import_order(imports):
    proc = _python(imports + "\nfrom peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING\n"
                   "print(PEFT_TYPE_TO_CONFIG_MAPPING['SITS_LORA'].__name__, "
                   "PEFT_TYPE_TO_TUNER_MAPPING['SITS_LORA'].__name__)\n"
                   "import sys; print(any(type(f).__name__ == '_RegisterOnImport' for f in sys.meta_path))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["SitsLoraConfig", "SitsLoraModel", "False"]  # registered, finder gone


def test_a_saved_adapter_loads_after_a_bare_import(tmp_path):
    """The README's loading path in a fresh process: import sits_lora, then PEFT loads a SITS_LORA adapter (saved
    here, in the test's process: the load is the fresh process's)."""
    import torch
    from peft import get_peft_model

    import sits_lora

    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), sits_lora.SitsLoraConfig(r=2,
                                                                                                target_modules=["0"]))
    model.save_pretrained(str(tmp_path))
    load = ("import sits_lora, torch\nfrom peft import PeftModel\n"
            f"m = PeftModel.from_pretrained(torch.nn.Sequential(torch.nn.Linear(8, 8)), {str(tmp_path)!r})\n"
            "print(type(m.peft_config['default']).__name__)")
    proc = _python(load)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "SitsLoraConfig"
