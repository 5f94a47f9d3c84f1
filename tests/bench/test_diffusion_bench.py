"""bench/diffusion.py on the CPU (--smoke: tiny U-Net and VAE): every arm's row, the fidelity columns, the training
arms, the files, and the errors it gives before building anything."""

from __future__ import annotations

import json
import os

import pytest

from conftest import bench_module

pytest.importorskip("diffusers")
diffusion = bench_module("diffusion")


def test_smoke_run_writes_every_arm_with_fidelity_and_the_training_step(tmp_path):
    assert diffusion.main(["--smoke", "--out", str(tmp_path), "--arms", "base", "peft", "sits", "sits+noreuse",
                           "sits+fp8", "--train"]) == 0
    rows = json.load(open(tmp_path / "diffusion.json"))["rows"]
    inference = {r["arm"]: r for r in rows if "seconds_per_image" in r}
    assert sorted(inference) == ["base", "peft", "sits", "sits+fp8", "sits+noreuse"]
    # calibrated e4m3 linears (emulated on the CPU): near the bf16 image, not equal to it
    assert 20 < inference["sits+fp8"]["psnr_db"] < 60
    assert inference["peft"]["psnr_db"] == float("inf") and inference["base"]["finite"]
    # the kept K / V gives the image computing them every step gives
    assert inference["sits"]["max_abs"] == inference["sits+noreuse"]["max_abs"]
    assert inference["sits"]["psnr_db"] > 60   # the same LoRA as PEFT's, fp32 on the CPU
    train = {r["arm"]: r for r in rows if "train_step_s" in r}
    assert sorted(train) == ["train:frozen", "train:peft", "train:sits", "train:sits+fused"]
    assert len(train["train:sits"]["times"]) == 1   # --smoke: one round per training arm
    assert train["train:frozen"]["vs_frozen"] == 1.0 and train["train:sits"]["train_step_s"] > 0
    for name in ("diffusion.csv", "diffusion.png"):
        assert os.path.getsize(tmp_path / name) > 0


def test_phases_split_an_image_into_its_first_step_a_step_and_the_decode(tmp_path):
    assert diffusion.main(["--smoke", "--out", str(tmp_path), "--arms", "base", "--phases", "--scheduler",
                           "euler"]) == 0
    row = json.load(open(tmp_path / "diffusion.json"))["rows"][0]
    assert row["scheduler"] == "euler"
    parts = row["phase_first_step_ms"] + (row["steps"] - 1) * row["phase_step_ms"] + row["phase_after_steps_ms"]
    # the stamps cover the whole call: its parts add up to the total (one step after the first: no median's spread)
    assert row["steps"] == 2 and row["phase_total_ms"] > 0 and parts == pytest.approx(row["phase_total_ms"], rel=1e-6)
    assert row["phase_host_step_ms"] > 0
    assert "kernel_ms" not in row   # the profiled image is CUDA only


def test_blocked_order_takes_each_arms_images_in_a_row(tmp_path, capsys):
    assert diffusion.main(["--smoke", "--out", str(tmp_path), "--arms", "base", "sits", "--order", "blocked"]) == 0
    rounds = [line.split("]")[0].lstrip("[").split()[-1] for line in capsys.readouterr().out.splitlines()
              if "] round " in line]
    assert rounds == ["base", "base", "sits", "sits"]   # --smoke: a warm-up image and a timed one, arm after arm
    rows = json.load(open(tmp_path / "diffusion.json"))["rows"]
    assert [(r["arm"], r["order"], len(r["times"])) for r in rows] == [("base", "blocked", 1), ("sits", "blocked", 1)]
    assert "gpu_step_ms" not in rows[0]   # the event split is CUDA only


def test_median_gap_is_the_median_step_between_stamps():
    assert diffusion.median_gap([0.0, 1.0, 3.0, 4.0, 9.0]) == 1.5   # gaps 1, 2, 1, 5
    assert diffusion.median_gap([2.0]) is None and diffusion.median_gap([]) is None


def test_bad_options_stop_before_any_model_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit):
        diffusion.main(["--smoke", "--out", str(tmp_path), "--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        diffusion.main(["--smoke", "--out", str(tmp_path), "--train-rounds", "0"])
    assert "--train-rounds must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        diffusion.main(["--out", str(tmp_path), "--shapes", "sd21"])
    assert "invalid choice: 'sd21'" in capsys.readouterr().err
