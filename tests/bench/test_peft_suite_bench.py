"""bench/peft_suite.py on a small stand-in for PEFT's source tree: three modes, differences found, known ones
excused, the outputs written; a missing test dependency and a wrong file are refused before any test runs."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from conftest import bench_module, shared_across_workers

peft_suite = bench_module("peft_suite")

# tests written like PEFT's: they import LoraConfig from peft at module level
FAKE_TESTS = '''
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn


def test_lora_trains_a_linear():
    model = get_peft_model(nn.Sequential(nn.Linear(6, 4)), LoraConfig(r=2, target_modules=["0"]))
    model(torch.randn(3, 6)).sum().backward()


def test_the_config_class_is_peft_own():
    assert LoraConfig.__module__.startswith("peft.")


def test_peft_types_are_peft_own():
    from peft.utils.peft_types import PeftType

    assert "SITS_LORA" not in PeftType.__members__


def test_always_fails():
    assert False, "broken on this machine"


@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
'''


def _fake_source(tmp_path, body=FAKE_TESTS):
    source = tmp_path / "peft-src"
    (source / "tests").mkdir(parents=True)
    (source / "tests" / "test_fake.py").write_text(body)
    return source


@pytest.fixture
def shared_source(monkeypatch, tmp_path_factory):
    """The stand-in source made once a session, and its pytest processes too: the collection and every mode's run
    that two tests ask with the same arguments (both collect it and run swap on all of it) run once, the first test
    to ask runs it and the other reads its outcomes (conftest.shared_across_workers); main's own work on them (the
    order of the modes, plain on failures, the differences and their excuses, the files) stays each test's own."""
    source = shared_across_workers(tmp_path_factory, "peft-suite-source", lambda folder: str(_fake_source(folder)))
    real_run, real_check = peft_suite.run_mode, peft_suite.check_collection

    def shared(what, produce):
        return shared_across_workers(tmp_path_factory, "peft-suite-" + hashlib.sha1(what.encode()).hexdigest(),
                                     produce)

    def check_collection(source_, files, keyword, env):
        return shared(json.dumps(["collect", source_, files, keyword]),
                      lambda folder: real_check(source_, files, keyword, env))

    def run_mode(mode, source_, files, keyword, env, out, node_ids=None):
        return shared(json.dumps(["run", mode, source_, files, keyword, node_ids]),
                      lambda folder: real_run(mode, source_, files, keyword, env, str(folder), node_ids))

    monkeypatch.setattr(peft_suite, "check_collection", check_collection)
    monkeypatch.setattr(peft_suite, "run_mode", run_mode)
    return Path(source)


def test_three_modes_find_what_sits_lora_changes(tmp_path, capsys, shared_source):
    source, out = shared_source, tmp_path / "out"
    code = peft_suite.main(["--out", str(out), "--peft-src", str(source), "--files", "test_fake.py", "-k", ""])
    assert code == 1   # two differences nobody has explained
    summary = json.loads((out / "peft_suite.json").read_text())
    assert summary["modes"]["plain"]["counts"] == {"passed": 3, "failed": 1, "error": 0, "skipped": 1}
    assert summary["modes"]["swap"]["counts"]["passed"] == 1   # the LoRA case trains with SitsLoraConfig
    found = {(d["mode"], d["test"].rsplit("::", 1)[1]) for d in summary["differences"]}
    # importing sits_lora adds SITS_LORA to PEFT's enum; swapping changes LoraConfig's module too
    assert found == {("import", "test_peft_types_are_peft_own"), ("swap", "test_peft_types_are_peft_own"),
                     ("swap", "test_the_config_class_is_peft_own")}
    assert all(d["plain"] == "passed" and d["outcome"] == "failed" and d["message"] for d in summary["differences"])
    with open(out / "peft_suite.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * 5 and {r["mode"] for r in rows} == {"plain", "import", "swap"}
    assert (out / "peft_suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 differences from plain PEFT, 3 unexplained" in capsys.readouterr().out


def test_known_differences_are_excused_with_their_reason(tmp_path, monkeypatch, shared_source):
    monkeypatch.setattr(peft_suite, "KNOWN_DIFFERENCES", {r"::test_the_config_class_is_peft_own$": "on purpose",
                                                          r"::test_peft_types_are_peft_own$": "registered type"})
    source, out = shared_source, tmp_path / "out"
    assert peft_suite.main(["--out", str(out), "--peft-src", str(source), "--files", "test_fake.py", "-k", "",
                            "--modes", "swap", "--plain", "failures"]) == 0
    summary = json.loads((out / "peft_suite.json").read_text())
    assert set(summary["modes"]) == {"plain", "swap"}   # plain always runs: the others are read against it
    assert {d["known"] for d in summary["differences"]} == {"on purpose", "registered type"}
    assert all(d["plain"] == "passed" for d in summary["differences"])
    # plain ran last and only on what failed under swap: the two differences and the test failing everywhere
    assert summary["modes"]["plain"]["counts"] == {"passed": 2, "failed": 1, "error": 0, "skipped": 0}


def test_junit_ids_become_the_node_ids_pytest_takes(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_custom_models.py").write_text("")
    junit_id = "tests.test_custom_models.TestPeftCustomModel::test_merge[SitsLora-Conv2d 1]"
    assert peft_suite.node_id(junit_id, str(tmp_path)) == \
        "tests/test_custom_models.py::TestPeftCustomModel::test_merge[SitsLora-Conv2d 1]"
    assert peft_suite.node_id("tests.test_custom_models::test_plain", str(tmp_path)) == \
        "tests/test_custom_models.py::test_plain"


def test_missing_test_dependency_and_wrong_file_are_refused_first(tmp_path, capsys):
    source = _fake_source(tmp_path, "import a_module_nobody_installed\n\ndef test_x():\n    pass\n")
    out = tmp_path / "out"
    assert peft_suite.main(["--out", str(out), "--peft-src", str(source), "--files", "test_fake.py"]) == 2
    assert "pip install a_module_nobody_installed" in capsys.readouterr().err
    assert peft_suite.main(["--out", str(out), "--peft-src", str(source), "--files", "test_nothing.py"]) == 2
    assert "--files test_nothing.py: not in" in capsys.readouterr().err
    assert peft_suite.main(["--out", str(out), "--peft-src", str(tmp_path / "nowhere")]) == 2
    assert "no tests/ folder there" in capsys.readouterr().err
    assert not (out / "junit_plain.xml").exists()


def test_plain_failures_without_another_mode_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        peft_suite.main(["--out", str(tmp_path), "--modes", "plain", "--plain", "failures"])
    assert stop.value.code == 2 and "name one of them in --modes" in capsys.readouterr().err
