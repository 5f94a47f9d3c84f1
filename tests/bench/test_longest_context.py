"""bench/longest_context.py: the bisection, and the planned search on the tiny shape (a CPU)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import bench_module


def test_bisect_finds_the_last_length_that_fits():
    longest_context = bench_module("longest_context")
    calls = []

    def fits(seq):
        calls.append(seq)
        return seq <= 5000

    assert longest_context.bisect(fits, 1024, 64 * 1024, 1024) == 4096
    assert len(calls) <= 8  # logarithmic, not a scan
    assert longest_context.bisect(lambda seq: False, 1024, 8192, 1024) == 0


def test_plan_search_writes_rows_and_orders_the_arms(tmp_path):
    pytest.importorskip("liger_kernel")
    longest_context = bench_module("longest_context")
    assert longest_context.main(["--plan", "--smoke", "--out", str(tmp_path)]) == 0
    rows = {r["arm"]: r for r in json.load(open(os.path.join(tmp_path, "longest_context.json")))["rows"]}
    assert set(rows) == set(longest_context.ARMS)
    planned = {arm: row["planned_tokens"] for arm, row in rows.items()}
    assert all(v > 0 and v % 64 == 0 for v in planned.values())
    # what each setting saves: rebuilt inputs over saved ones, checkpointing over none, sits over PEFT
    assert planned["sits+liger"] > planned["sits+liger+saved"]
    assert planned["sits+liger+gc"] > planned["sits+liger"]
    assert planned["sits+liger"] > planned["peft"]
    assert all(row["planned_gib_at_it"] <= 0.01 for row in rows.values())
    assert os.path.exists(os.path.join(tmp_path, "longest_context.png"))


def test_bad_settings_are_named(capsys):
    longest_context = bench_module("longest_context")
    with pytest.raises(SystemExit):
        longest_context.main(["--plan", "--arms", "qlora"])
    assert "--arms qlora: unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        longest_context.main(["--arms", "peft"])
    assert "give --plan" in capsys.readouterr().err


def test_offload_arm_keeps_on_the_device_what_the_host_cap_leaves_out():
    """The offloaded arm keeps the last layers' inputs on the device when the pinned host budget cannot take them
    all; with room on the host it keeps none (without Liger, which the CI machine does not install)."""
    longest_context = bench_module("longest_context")
    roomy = longest_context.planned_longest("tiny", "sits+offload", 0.01 * 2**30, 64, 64 * 1024)
    assert roomy["keep_on_device"] == 0 and roomy["planned_tokens"] > 0
    cramped = longest_context.planned_longest("tiny", "sits+offload", 0.01 * 2**30, 64, 64 * 1024,
                                              host_cap_bytes=1024)
    assert cramped["keep_on_device"] == 2 and cramped["planned_host_gib_at_it"] == 0
    assert cramped["planned_tokens"] <= roomy["planned_tokens"]


def test_missing_layers_are_what_the_plan_gives_the_layers_not_built():
    longest_context = bench_module("longest_context")
    assert longest_context.missing_layers_bytes("tiny", "peft+gc", 0)(1024) == 0
    missing = longest_context.missing_layers_bytes("8b", "peft+gc", 4)
    # 28 missing 8B layers: their bf16 weights (~436 MB each), r16 adapters with fp32 gradients and AdamW states
    # (~22 MB), and, checkpointed, their bf16 inputs
    assert 28 * 0.45e9 < missing(1024) < 28 * 0.47e9
    assert missing(2048) - missing(1024) == pytest.approx(28 * 1024 * 4096 * 2, rel=0.01)


def test_profile_rebuild_smoke(tmp_path):
    profile_rebuild = bench_module("profile_rebuild")
    assert profile_rebuild.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.load(open(os.path.join(tmp_path, "profile_rebuild.json")))["rows"]
    assert [r["arm"] for r in rows] == ["sits", "sits+saved"] and all(r["step_s"] > 0 for r in rows)


def test_four_bit_and_unsloth_arms_are_measured_not_planned(capsys):
    longest_context = bench_module("longest_context")
    assert not longest_context.planned("unsloth+nf4+gc") and not longest_context.planned("sits+nf4+liger+offload")
    assert longest_context.planned("sits+liger+offload")
    assert longest_context.offloaded("unsloth+nf4+gc") and longest_context.offloaded("sits+nf4+liger+offload")
    assert not longest_context.offloaded("sits+nf4+liger+gc")
    row = longest_context.planned_longest("8b", "unsloth+nf4+gc", 80 * 2**30, 1024, 2**20)
    assert row["planned_tokens"] is None and row["keep_on_device"] == 0
    with pytest.raises(SystemExit):
        longest_context.main(["--plan", "--arms", "unsloth+nf4+gc"])
    assert "--arms unsloth+nf4+gc: plan_memory does not plan" in capsys.readouterr().err


def test_missing_layers_read_off_the_built_model():
    """The stand-in for the layers a shallow build lacks, for the arms without a plan: what its first decoder layer
    holds (parameters, and a gradient and two AdamW states for each trainable one) per missing layer, plus a kept
    bf16 input per missing layer unless the arm offloads it."""
    import torch

    longest_context = bench_module("longest_context")
    bench_model = bench_module("bench_model")
    full = bench_model.MODELS["tiny"]["num_hidden_layers"]
    hidden = bench_model.MODELS["tiny"]["hidden_size"]
    model, params = bench_model.build("tiny", "peft+gc", "cpu", torch.float32, 1)
    first = model.base_model.model.model.layers[0]
    held = sum(p.numel() * p.element_size() for p in first.parameters())
    trainable = sum(p.numel() * p.element_size() for p in first.parameters() if p.requires_grad)
    assert trainable > 0
    missing = longest_context.measured_missing_bytes(model, "peft+gc", "tiny", 1)
    assert missing(64) == (full - 1) * (held + 3 * trainable + 2 * hidden * 64)
    offload = longest_context.measured_missing_bytes(model, "unsloth+nf4+gc", "tiny", 1)
    assert offload(64) == offload(128) == (full - 1) * (held + 3 * trainable)
    assert longest_context.measured_missing_bytes(model, "peft+gc", "tiny", full)(64) == 0
