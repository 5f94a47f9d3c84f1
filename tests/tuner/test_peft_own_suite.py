"""PEFT's own LoRA tests (test_custom_models.py -k LoRA of the installed PEFT, from its source distribution) pass with
SitsLoraConfig in place of LoraConfig, and with sits_lora imported, wherever they pass as PEFT ships them, but for the
differences bench/peft_suite.py names as kept on purpose. Plain PEFT runs only the tests that failed with sits_lora
(``--plain failures``): a difference needs a failure there, and this halves the time."""

from __future__ import annotations

import json

import pytest

from conftest import bench_module

peft_suite = bench_module("peft_suite")


@pytest.mark.slow
@pytest.mark.starts_first
def test_pefts_own_lora_tests_pass_with_sits_lora(tmp_path):
    try:
        peft_suite.peft_source(str(tmp_path), None)
    except peft_suite.SuiteError as error:  # no package index here, or a release without its tests
        pytest.skip(f"PEFT's tests are not available: {error}")
    code = peft_suite.main(["--out", str(tmp_path), "--plain", "failures"])
    summary = json.loads((tmp_path / "peft_suite.json").read_text())
    unexplained = [(d["mode"], d["test"], d["message"]) for d in summary["differences"] if not d["known"]]
    assert not unexplained, unexplained[:10]
    assert code == 0
    imported, swap = summary["modes"]["import"]["counts"], summary["modes"]["swap"]["counts"]
    assert swap["passed"] > 1000 and swap["passed"] >= imported["passed"] - len(summary["differences"])
