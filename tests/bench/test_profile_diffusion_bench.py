"""bench/profile_diffusion.py on the CPU (--smoke): which layers --lora-targets adapts, and an fp8c arm's U-Net
convolutions in e4m3."""

from __future__ import annotations

import json

import pytest

from conftest import bench_module

pytest.importorskip("diffusers")
profile = bench_module("profile_diffusion")


@pytest.mark.slow
def test_lora_targets_choose_the_adapted_layers_and_fp8c_quantizes_convolutions(tmp_path):
    runs = {}
    for targets in ("attention", "cross"):
        out = tmp_path / targets
        assert profile.main(["--smoke", "--denoise-only", "--out", str(out), "--lora-targets", targets,
                             "--arms", "sits", "sits+fp8c"]) == 0
        runs[targets] = (json.load(open(out / "profile_diffusion.json")), (out / "profile_diffusion.txt").read_text())
    attention = runs["attention"][0]["sits"]["adapted_layers"]
    cross = runs["cross"][0]["sits"]["adapted_layers"]
    assert cross and all(name.endswith(("attn2.to_k", "attn2.to_v")) for name in cross)
    assert set(cross) < set(attention) and any(name.endswith("attn1.to_q") for name in attention)
    # the fp8c arm's summary: the convolutions were considered (the U-Net's first and last refused by name)
    line = next(line for line in runs["cross"][1].splitlines() if line.startswith("== sits+fp8c: sits_lora fp8:"))
    assert "layers in e4m3" in line and "2 fewer than 16 channels, or input channels not a multiple of 16" in line
