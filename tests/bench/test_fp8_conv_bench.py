"""bench/fp8_conv.py and bench/diffusion_graph_breaks.py on the CPU: the convolution rows on the Triton interpreter,
the VAE decode in fp8 against bf16 at the tiny shape, and the graphs dynamo makes of one transformer block."""

from __future__ import annotations

import json

import pytest

from conftest import bench_module

pytest.importorskip("diffusers")
fp8_conv = bench_module("fp8_conv")
graph_breaks = bench_module("diffusion_graph_breaks")


def test_smoke_run_checks_the_kernel_and_quantizes_the_vae_decoder(tmp_path):
    assert fp8_conv.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.load(open(tmp_path / "fp8_conv.json"))
    assert [row["shape"] for row in result["conv"]] == [shape[0] for shape in fp8_conv.SMOKE_SHAPES]
    assert all(row["sqnr_db"] > 60 for row in result["conv"])   # fp16 codes, the same kernel as e4m3's
    bf16, fp8 = result["vae"]
    assert bf16["arm"] == "bf16" and fp8["arm"] == "fp8" and fp8["layers_fp8"] > 0
    assert 25 < fp8["psnr_db"] < 80   # e4m3 codes through the decoder: close to its image, not equal
    assert (tmp_path / "fp8_conv.csv").read_text().startswith("shape,")


def test_a_cpu_without_smoke_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fp8_conv.torch.cuda, "is_available", lambda: False)
    assert fp8_conv.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device; run with --smoke" in capsys.readouterr().err


def test_the_block_is_one_graph_unless_kept_k_v_break_it(tmp_path):
    assert graph_breaks.main(["--out", str(tmp_path)]) == 0
    result = json.load(open(tmp_path / "diffusion_graph_breaks.json"))
    assert len(result["keep_under_compile=False"]) == 1
    kept = result["keep_under_compile=True"]
    assert len(kept) >= 1 and sum(row["ops"] for row in kept) > 0


def test_vae_only_skips_the_convolution_table(tmp_path):
    assert fp8_conv.main(["--smoke", "--vae-only", "--out", str(tmp_path)]) == 0
    result = json.load(open(tmp_path / "fp8_conv.json"))
    assert "conv" not in result and [row["arm"] for row in result["vae"]] == ["bf16", "fp8"]
    assert (tmp_path / "fp8_conv.csv").read_text().startswith("arm,")
