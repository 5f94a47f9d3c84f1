"""The Unsloth arms of bench/bench_model.py and their targets in bench/regress.py, on the CPU: the same adapter and
batch as our arms, the same random weights through a local checkpoint folder, and one line where Unsloth cannot
run."""

from __future__ import annotations

import subprocess

import torch

from conftest import bench_module

bench_model = bench_module("bench_model")
regress = bench_module("regress")


def test_the_unsloth_adapter_is_ours():
    sits, _ = bench_model.build("tiny", "sits", "cpu", torch.float32)
    ours = sits.peft_config["default"]
    for arm, checkpointing in (("unsloth", False), ("unsloth+gc", "unsloth"), ("unsloth+nf4", False),
                               ("unsloth+nf4+gc", "unsloth")):
        kwargs = bench_model.unsloth_lora_kwargs(arm)
        assert (kwargs["r"], kwargs["lora_alpha"], kwargs["lora_dropout"]) == (ours.r, ours.lora_alpha,
                                                                               ours.lora_dropout)
        assert set(kwargs["target_modules"]) == set(ours.target_modules) and kwargs["bias"] == ours.bias == "none"
        assert kwargs["use_gradient_checkpointing"] == checkpointing
        assert arm in bench_model.OPTIONAL_ARMS and arm not in bench_model.ARMS   # off by default


def test_every_arm_gets_the_same_batch_and_steps(monkeypatch):
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped by the test")

    monkeypatch.setattr(bench_model.subprocess, "run", fake_run)
    for arm in ("sits+liger", "unsloth", "unsloth+nf4+gc"):
        bench_model.run_arm("1b", arm, batch=4, seq=2048, warmup=2, steps=6)
    settings = [[c for c in cmd if not c.startswith("unsloth") and not c.startswith("sits")] for cmd in commands]
    assert settings[0] == settings[1] == settings[2]
    assert ["--batch", "4", "--seq", "2048"] == settings[0][settings[0].index("--batch"):][:4]


def test_the_local_checkpoint_holds_the_weights_build_makes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = bench_model.local_checkpoint("tiny", 0, torch.float32, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    built, _ = bench_model.build("tiny", "frozen", "cpu", torch.float32)
    reference = built.state_dict()
    assert all(torch.equal(tensor, reference[name]) for name, tensor in loaded.state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tokenizer) == loaded.config.vocab_size and tokenizer("t5 t7").input_ids == [5, 7]
    assert bench_model.local_checkpoint("tiny", 0, torch.float32, str(tmp_path)) == folder   # written once


def test_without_a_gpu_or_unsloth_the_arm_stops_with_one_line():
    row = bench_model.run_arm("tiny", "unsloth", smoke=True, warmup=1, steps=1)
    assert "step_s" not in row and row["error"].startswith("arm unsloth: skipped: ")
    assert "\n" not in row["error"]


def test_the_unsloth_targets():
    def rows(shape, **arms):
        return [{"shape": shape, "arm": arm.replace("_", "+"), "step_s": step, "peak_gib": peak}
                for arm, (step, peak) in arms.items()]

    def check(shape, what, measured):
        checks = {c["what"]: c for c in regress.compare(measured, None, [], regress.TARGETS) if c["shape"] == shape}
        return checks[what]

    bf16 = "best sits bf16 >= 1.15x unsloth"
    ahead = rows("1b", frozen_liger=(0.8, 8.0), sits_default=(0.9, 9.0), unsloth=(1.2, 9.5), unsloth_gc=(1.3, 7.0))
    assert check("1b", bf16, ahead)["ok"] is True
    assert "sits+default 1.33x as fast as unsloth" in check("1b", bf16, ahead)["detail"]
    behind = rows("8b", frozen_liger=(0.8, 8.0), sits_liger=(1.0, 9.0), unsloth=(1.1, 9.5))
    assert check("8b", bf16, behind)["ok"] is False
    assert check("8b", bf16, rows("8b", frozen_liger=(0.8, 8.0), sits_liger=(1.0, 9.0)))["ok"] is None
    nf4 = "best sits nf4 >= 1.15x unsloth+nf4 at <= its peak"
    lean = rows("8b-full", sits_nf4_liger=(1.0, 30.0), unsloth_nf4=(1.2, 35.0), unsloth_nf4_gc=(1.5, 20.0))
    assert check("8b-full", nf4, lean)["ok"] is True
    heavy = rows("8b-full", sits_nf4_liger=(1.0, 40.0), unsloth_nf4=(1.2, 35.0))
    assert check("8b-full", nf4, heavy)["ok"] is False and "peak 40.0 GiB against 35.0" in check(
        "8b-full", nf4, heavy)["detail"]


def test_the_quality_runs_start_both_adapters_alike_and_keep_every_step(tmp_path):
    import json

    quality = bench_module("unsloth_quality")
    ours, _ = bench_model.build("tiny", "sits", "cpu", torch.float32)
    theirs, _ = bench_model.build("tiny", "peft", "cpu", torch.float32)   # another library's initialization
    assert quality.same_start(ours, 3) == quality.same_start(theirs, 3) == 2 * 7
    ours_p, theirs_p = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert all(torch.equal(p, theirs_p[n]) for n, p in ours_p.items() if "lora_" in n)
    assert not any(p.any() for n, p in ours_p.items() if "lora_B" in n)
    assert quality.main(["--size", "tiny", "--arms", "sits", "unsloth", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "unsloth_quality.json").read_text())
    sits = [r for r in saved["runs"] if r["arm"] == "sits"]
    assert len(sits) == 2 and all(len(r["train_losses"]) == r["steps"] == 4 for r in sits)
    assert all(r["error"].startswith("arm unsloth: skipped: ") for r in saved["runs"] if r["arm"] == "unsloth")
    assert saved["verdict"]["ok"] is None
    assert quality.verdict([{"arm": "sits", "test_loss": 2.0}, {"arm": "unsloth", "test_loss": 1.9},
                            {"arm": "unsloth", "test_loss": 2.1}])["ok"] is True
    assert quality.verdict([{"arm": "sits", "test_loss": 2.2}, {"arm": "unsloth", "test_loss": 1.9},
                            {"arm": "unsloth", "test_loss": 2.1}])["ok"] is False
