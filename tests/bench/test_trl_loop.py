"""bench/trl_loop.py: the per-arm summary and its ratios, and the settings it refuses (its --smoke run is the GPU
run's shape on a CPU: python bench/trl_loop.py --smoke --out OUT)."""

from __future__ import annotations

import pytest
import torch
from conftest import bench_module


def test_each_arm_is_the_median_of_its_runs_with_its_ratios():
    trl_loop = bench_module("trl_loop")
    runs = [{"model": "1b", "arm": "native", "step_s": s, "tokens_per_s": 8192 / s, "host_share": h}
            for s, h in ((0.10, 0.1), (0.30, 0.2), (0.11, 0.3))]
    runs += [{"model": "1b", "arm": "sft-native", "step_s": s, "tokens_per_s": 8192 / s} for s in (0.12, 0.13)]
    runs += [{"model": "1b", "arm": "unsloth-sft", "step_s": 0.2, "tokens_per_s": 8192 / 0.2},
             {"model": "1b", "arm": "unsloth-sft-gc", "step_s": 0.25, "tokens_per_s": 8192 / 0.25},
             {"model": "1b", "arm": "sft-lora", "error": "timed out after 300 s"}]
    arms = ["native", "sft-native", "unsloth-sft", "unsloth-sft-gc", "sft-lora", "dpo-lora"]
    rows = {r["arm"]: r for r in trl_loop.summarize(runs, arms, ["1b"])}
    assert rows["native"]["step_s"] == 0.11 and rows["native"]["runs"] == 3 and rows["native"]["host_share"] == 0.2
    assert rows["native"]["step_min_s"] == 0.10 and rows["native"]["step_max_s"] == 0.30
    assert rows["sft-native"]["step_s"] == pytest.approx(0.125)
    assert rows["sft-native"]["x_native"] == pytest.approx(0.11 / 0.125)
    assert rows["sft-native"]["x_unsloth"] == pytest.approx(0.2 / 0.125)   # the faster Unsloth arm
    assert rows["sft-lora"]["error"] == "timed out after 300 s" and rows["dpo-lora"]["error"] == "not run"


def test_the_unsloth_site_arms_say_where_their_wheels_are_missing(tmp_path):
    trl_loop = bench_module("trl_loop")
    assert trl_loop.install_unsloth_site(str(tmp_path)) == ""
    args = trl_loop.argparse.Namespace(unsloth_site="", smoke=True, seq=32, batch=2, layers=0, warmup=3, steps=2,
                                       host_steps=1, out=str(tmp_path), arm_timeout=10)
    row = trl_loop.run_arm(args, "tiny", "unsloth-sft")
    assert "no Unsloth wheels" in row["error"] and "carry_unsloth.py" in row["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_a_cpu_run_without_smoke_and_bad_counts_are_named(capsys):
    trl_loop = bench_module("trl_loop")
    with pytest.raises(SystemExit):
        trl_loop.main(["--out", "unused"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trl_loop.main(["--steps", "0", "--smoke"])
    assert "--steps 0: it must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trl_loop.main(["--warmup", "2", "--smoke"])
    assert "records at its third call" in capsys.readouterr().err


@pytest.mark.slow
def test_every_smoke_arm_trains_the_adapter_alone(tmp_path):
    """On the CPU, the tiny shape: each arm trains LoRA's parameters only (the same count in every arm), through
    its own trainer (a first GPU run's NativeLoraTrainer arm trained the whole model)."""
    trl_loop = bench_module("trl_loop")
    pytest.importorskip("trl")
    args = trl_loop.argparse.Namespace(unsloth_site="", smoke=True, seq=32, batch=2, layers=0, warmup=3, steps=1,
                                       host_steps=1, out=str(tmp_path), arm_timeout=300)
    rows = [trl_loop.run_arm(args, "tiny", arm) for arm in ("native", "sft-native")]
    assert all("error" not in r for r in rows), rows
    counts = {r["trainable_params"] for r in rows}
    assert len(counts) == 1 and 0 < counts.pop() < 10**5, rows
