"""bench/trainer_step.py: the per-arm summary and the settings it refuses (its --smoke run is the GPU run's shape on a
CPU: python bench/trainer_step.py --smoke --out OUT)."""

from __future__ import annotations

import pytest
import torch
from conftest import bench_module


def test_each_arm_is_the_median_of_its_runs_against_the_blocking_copy():
    trainer_step = bench_module("trainer_step")
    runs = [{"arm": "non-blocking", "step_s": s, "tokens_per_s": 8192 / s, "recorded": True} for s in (0.10, 0.30, 0.11)]
    runs += [{"arm": "blocking", "step_s": s, "tokens_per_s": 8192 / s, "recorded": True} for s in (0.12, 0.125)]
    runs.append({"arm": "blocking", "error": "timed out after 300 s"})
    rows = {r["arm"]: r for r in trainer_step.summarize(runs)}
    assert rows["non-blocking"]["step_s"] == 0.11 and rows["non-blocking"]["runs"] == 3
    assert rows["non-blocking"]["tokens_per_s"] == pytest.approx(8192 / 0.11)
    assert rows["blocking"]["step_s"] == pytest.approx(0.1225) and rows["blocking"]["runs"] == 2
    assert rows["non-blocking"]["vs_blocking"] == pytest.approx(0.11 / 0.1225)
    failed = {r["arm"]: r for r in trainer_step.summarize([{"arm": "blocking", "error": "boom"}])}
    assert failed["blocking"]["error"] == "boom" and failed["non-blocking"]["error"] == "not run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_cpu_run_without_smoke_and_bad_counts_are_named(capsys):
    trainer_step = bench_module("trainer_step")
    with pytest.raises(SystemExit):
        trainer_step.main(["--out", "unused"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trainer_step.main(["--steps", "0", "--smoke"])
    assert "--steps 0: it must be a positive integer" in capsys.readouterr().err
