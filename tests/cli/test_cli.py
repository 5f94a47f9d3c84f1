"""The sits-lora command line (check, bench, profile, compile) and BenchmarkRunner.

CPU tests run the commands in-process through ``sits_lora.cli.main`` (an import of the package costs
seconds, so one test only goes through a subprocess: the installed entry point). GPU tests are
marked ``gpu``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import sits_lora
from sits_lora import cli
from sits_lora.cli.bench import (
    DEFAULT_INT4_OFFSETS,
    MAX_SPREAD,
    BackendUnavailableError,
    BenchmarkConfigError,
    BenchmarkRunner,
)
from sits_lora.ops.int4_linear import int4_dequantize, int4_pack, int4_unpack_into, int4_unpack_reference

from conftest import REPO_ROOT, tiny_llama

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse: --help and usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"sits-lora {command}: error: "), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- help and bad arguments


@pytest.mark.parametrize("command, words", [
    (None, ["check", "bench", "profile", "compile", "Exit status"]),
    ("check", ["--model", "--config", "--batch-size", "--seq-len", "--memory-budget-gib", "--json", "meta device"]),
    ("bench", ["--backend", "--int4-mode", "--alignment", "--int4-offsets", "--out", "--json", "sits2026"]),
    ("profile", ["--model", "--config", "--steps", "--out", "heatmap", "LoRA"]),
    ("compile", ["--model", "--config", "--force", "--cache", "cached",
                 "The cache key is the GPU name, kernel, shape and dtype, not the torch / triton versions"]),
])
def test_every_command_has_help(capsys, command, words):
    code, out, _ = run_cli(capsys, *([command] if command else []), "--help")
    assert code == 0
    text = " ".join(out.split())
    for word in words:
        assert word in text, word


def test_no_command_prints_help_and_fails(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2 and "COMMAND" in err


@pytest.mark.parametrize("argv, expected", [
    (["bench", "--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
    (["bench", "--alignment", "24"], "'24' is not 'sits2026', 'none' or a power of two"),
    (["bench", "--int4-offsets", "16,32"], "including 0"),
    (["bench", "--int4-mode", "loose"], "argument --int4-mode: invalid choice"),
    (["check", "--model", "/no/such/model"], "--model /no/such/model: no such file or folder"),
    (["check", "--config", "/no/such.yaml"], "--config /no/such.yaml: no such file"),
    (["check", "--batch-size", "0"], "argument --batch-size: '0' is not a positive integer"),
    (["check", "--rank-share", "1.5"], "--rank-share 1.5: it must be a fraction in (0, 1)"),
    (["profile", "--steps", "0"], "argument --steps: '0' is not a positive integer"),
    (["profile", "--model", "/no/such/model.gguf"], "--model /no/such/model.gguf: no such file or folder"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, argv, expected):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert expected in one_line_error(err, argv[0])


def test_bad_config_files_are_named(capsys, tmp_path, tiny_model_dir):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("r: 8\nrank: 4\n")
    code, _, err = run_cli(capsys, "check", "--model", str(tiny_model_dir), "--config", str(unknown))
    assert code == 2 and "unknown keys ['rank']" in one_line_error(err, "check")
    bad_value = tmp_path / "bad.yaml"
    bad_value.write_text("r: 0\n")
    code, _, err = run_cli(capsys, "check", "--model", str(tiny_model_dir), "--config", str(bad_value))
    assert code == 2 and "r=0 is invalid" in one_line_error(err, "check")
    missing_target = tmp_path / "target.yaml"
    missing_target.write_text("target_modules: [c_attn]\n")
    code, _, err = run_cli(capsys, "check", "--model", str(tiny_model_dir), "--config", str(missing_target))
    assert code == 2 and "'c_attn'" in one_line_error(err, "check")


@NO_GPU
def test_gpu_backend_and_compile_without_a_gpu(capsys, tiny_model_dir):
    code, _, err = run_cli(capsys, "bench", "--backend", "cuda")
    assert code == 2 and "no GPU is visible to torch" in one_line_error(err, "bench")
    code, _, err = run_cli(capsys, "compile", "--model", str(tiny_model_dir))
    assert code == 2 and "torch sees none" in one_line_error(err, "compile")


def test_out_that_is_a_file_is_refused(capsys, tmp_path, tiny_model_dir):
    taken = tmp_path / "taken"
    taken.write_text("x")
    code, _, err = run_cli(capsys, "bench", "--backend", "cpu", "--out", str(taken))
    assert code == 2 and "a file of that name exists" in one_line_error(err, "bench")
    code, _, err = run_cli(capsys, "profile", "--model", str(tiny_model_dir), "--out", str(taken))
    assert code == 2 and "a file of that name exists" in one_line_error(err, "profile")


@pytest.mark.slow
def test_console_script_entry_point():
    """The installed `sits-lora` (or `python -m sits_lora`): help, and one error line for a bad backend."""
    script = os.path.join(os.path.dirname(sys.executable), "sits-lora")  # this environment's, not another on PATH
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "sits_lora"]
    done = subprocess.run(cmd + ["bench", "--backend", "tpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("sits-lora bench: error: argument --backend")


# ----------------------------------------------------------------------------- BenchmarkRunner arguments


def test_runner_validates_its_arguments():
    with pytest.raises(BenchmarkConfigError, match=r"backend='tpu'\) is invalid: allowed values are 'auto', 'cuda'"):
        BenchmarkRunner(backend="tpu")
    with pytest.raises(BenchmarkConfigError, match=r"int4_mode='loose'\) is invalid: allowed values are 'strict'"):
        BenchmarkRunner(backend="cpu", int4_mode="loose")
    for bad in ("sits2025", 24, 0, True):
        with pytest.raises(BenchmarkConfigError, match=r"alignment=.* is invalid: use 'sits2026'"):
            BenchmarkRunner(backend="cpu", alignment=bad)
    for bad in ((16, 32), (0, 0, 16), (0, -16), (0, 8192), "0,16"):
        with pytest.raises(BenchmarkConfigError, match=r"int4_offsets=.* is invalid: give distinct byte offsets"):
            BenchmarkRunner(backend="cpu", int4_offsets=bad)
    runner = BenchmarkRunner(backend="cpu", alignment=16, int4_offsets=(32, 0, 16))
    assert runner.alignment_bytes == 16 and runner.int4_offsets == (0, 16, 32)
    assert BenchmarkRunner(backend="cpu").alignment_bytes == 32  # sits2026
    assert BenchmarkRunner(backend="cpu", alignment="none").alignment_bytes is None
    assert BenchmarkRunner(backend="auto").backend == ("cuda" if torch.cuda.is_available() and not torch.version.hip
                                                       else "rocm" if torch.cuda.is_available() else "cpu")


@NO_GPU
def test_runner_refuses_a_gpu_backend_without_a_gpu():
    with pytest.raises(BackendUnavailableError, match=r"backend 'cuda': no GPU is visible to torch"):
        BenchmarkRunner(backend="cuda")
    with pytest.raises(BackendUnavailableError, match=r"backend 'rocm': this torch .* has no ROCm support"):
        BenchmarkRunner(backend="rocm")


# ----------------------------------------------------------------------------- bench on the CPU


def test_bench_cpu_json_marks_what_does_not_apply(capsys, tmp_path):
    json_path, out = tmp_path / "out.json", tmp_path / "bench"
    code, stdout, _ = run_cli(capsys, "bench", "--backend", "cpu", "--json", str(json_path), "--out", str(out),
                              "--no-progress")
    assert code == 0
    assert "verdict: pass" in stdout and "not applicable" in stdout
    result = json.loads(json_path.read_text())
    assert result == json.loads((out / "bench.json").read_text())
    assert result["command"] == "bench" and result["backend"] == "cpu" and result["passed"] is True
    env = result["environment"]
    for key in ("torch", "triton", "transformers", "peft", "git_revision", "cpu", "date"):
        assert env[key], key
    assert env["gpu"] is None
    status = {(i["section"], i["name"]): i for i in result["items"]}
    for key in [("device memory", "fp8 matmul"), ("device memory", "LoRA kernels"), ("device memory", "LoRA layer"),
                ("pcie", "host<->device transfers"), ("pcie", "adapter checkpoint load")]:
        assert status[key]["status"] == "not applicable" and status[key]["summary"], key
    for key in [("device memory", "copy bandwidth (host memory)"), ("device memory", "fp32 matmul (CPU)")]:
        item = status[key]
        assert item["status"] == "measured" and item["value"] > 0 and item["details"]["seconds"] > 0
    offsets = [i for i in result["items"] if i["name"].startswith("offset ")]
    assert [i["details"]["offset"] for i in offsets] == list(DEFAULT_INT4_OFFSETS)
    for item in offsets:
        assert item["details"]["correct"] and item["value"] > 0
        assert item["details"]["address_mod_512"] == item["details"]["offset"]
    verdict = status[("int4 alignment", "rule sits2026 (32-byte)")]
    if os.environ.get("TRITON_INTERPRET") == "1":  # interpreter timings measure Python: values only
        assert verdict["status"] == "not applicable" and "values correct" in verdict["summary"]
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_json_to_stdout_and_int4_off(capsys, tmp_path):
    code, stdout, _ = run_cli(capsys, "bench", "--backend", "cpu", "--json", "--int4-mode", "off",
                              "--out", str(tmp_path), "--no-progress")
    assert code == 0
    result = json.loads(stdout)  # nothing but the document on stdout
    int4 = [i for i in result["items"] if i["section"] == "int4 alignment"]
    assert len(int4) == 1 and int4[0]["status"] == "skipped" and "int4_mode='off'" in int4[0]["summary"]
    assert result["settings"]["int4_mode"] == "off"


def test_int4_with_the_pytorch_path_and_a_16_byte_rule(monkeypatch):
    """TRITON_INTERPRET off: the CPU measures the PyTorch dequantization, and the rule gets a timing verdict."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    runner = BenchmarkRunner(backend="cpu", int4_mode="warn", alignment=16, int4_offsets=(0, 8, 16, 32),
                             progress=False)
    items = runner._int4()
    offsets, verdict = items[:-1], items[-1]
    assert [i.details["offset"] for i in offsets] == [0, 8, 16, 32]
    assert [i.details["obeys_rule"] for i in offsets] == [True, False, True, True]
    assert all(i.details["correct"] for i in offsets)
    assert verdict.name == "rule 16-byte" and verdict.status in ("ok", "warning")  # warn never fails the run
    assert verdict.details["tolerance"] >= 0.05 and set(verdict.details["latency_us"]) == {"0", "8", "16", "32"}


def _verdict(slowdown: dict, mode="strict", alignment="sits2026", errors=None, spread=0.02):
    runner = BenchmarkRunner(backend="cpu", int4_mode=mode, alignment=alignment, int4_offsets=tuple(slowdown),
                             progress=False)
    micro = {o: 10.0 * (1 + s) for o, s in slowdown.items()}
    errors = errors or {o: 0.0 for o in slowdown}
    return runner._int4_verdict(micro, slowdown, max(0.05, spread), errors, False, "synthetic")


def test_int4_rule_verdicts():
    """The decision, on given timings: holds, needed, broken, wrong values, no rule, too noisy."""
    flat = {0: 0.0, 4: 0.01, 8: -0.01, 16: 0.02, 32: 0.0, 64: 0.01, 128: -0.02}
    held = _verdict(flat)
    assert held.status == "ok" and "not needed" in held.summary and held.details["rule_holds"]
    assert "no cost measured at any offset down to 4 B" in held.summary
    seed_like = {**flat, 16: 1.35}  # the seed's claim: +135 % at offset 16
    needed = _verdict(seed_like)
    assert needed.status == "ok" and needed.details["rule_needed"] and "16 B +135%" in needed.summary
    assert needed.details["smallest_alignment_without_measured_cost"] == 32
    assert "offset 16: +135.0% (the rule's source claims +135%)" in needed.summary
    sector = {**flat, 32: 0.3}  # an offset that obeys the 32-byte rule is slower: the rule is not enough
    broken = _verdict(sector)
    assert broken.status == "violated" and "does not hold: offsets [32]" in broken.summary
    assert broken.details["smallest_alignment_without_measured_cost"] == 64
    assert _verdict(sector, mode="warn").status == "warning"
    bad_values = {**{o: 0.0 for o in flat}, 64: 0.5}
    wrong = _verdict(flat, errors=bad_values)
    assert wrong.status == "violated" and "wrong at offsets [64]" in wrong.summary
    assert _verdict(flat, mode="warn", errors=bad_values).status == "warning"
    none = _verdict(seed_like, alignment="none")
    assert none.status == "measured" and "support 32-byte alignment" in none.summary
    noisy = _verdict(seed_like, spread=MAX_SPREAD + 0.1)
    assert noisy.status == "warning" and "inconclusive" in noisy.summary


def test_int4_kernel_and_pytorch_paths_match_the_reference_at_any_offset():
    """The bench times the INT4 base's own format (ops.int4_linear) from views at any byte offset."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 128, generator=gen)
    packed, scales, mins = int4_pack(weight, 64)
    reference = int4_unpack_reference(packed, scales, mins, 128, torch.float32)
    assert (reference - weight).abs().max() <= scales.max() / 2 + 1e-6  # half a step
    buffer = torch.zeros(packed.numel() + 64, dtype=torch.uint8)
    for offset in (0, 1, 4, 16, 32):
        view = buffer[offset:offset + packed.numel()].view(packed.shape)
        view.copy_(packed)
        assert torch.equal(int4_unpack_into(view, scales, mins, torch.empty(32, 128)), reference)
        if os.environ.get("TRITON_INTERPRET") == "1":
            out = torch.empty(32, 128)
            assert torch.equal(int4_dequantize(view, scales, mins, 128, out), reference), offset
    with pytest.raises(ValueError, match=r"out must be contiguous \(32, 128\)"):
        int4_unpack_into(packed, scales, mins, torch.empty(32, 64))


# ----------------------------------------------------------------------------- check


def test_check_flags_an_over_budget_plan(capsys, tmp_path, tiny_model_dir):
    path = tmp_path / "check.json"
    code, stdout, _ = run_cli(capsys, "check", "--model", str(tiny_model_dir), "--batch-size", "2", "--seq-len", "64",
                              "--memory-budget-gib", "0.001", "--json", str(path))
    assert code == 1
    assert "VIOLATED: memory" in stdout and "memory plan" in stdout
    report = json.loads(path.read_text())
    memory = next(c for c in report["constraints"] if c["name"] == "memory")
    assert report["passed"] is False and memory["status"] == "violated"
    assert memory["details"]["budget_bytes"] == int(0.001 * 2**30)
    assert memory["details"]["plan"]["total"] == report["memory_plan"]["total"] > memory["details"]["budget_bytes"]
    assert any("gradient checkpointing" in s for s in memory["suggestions"])
    assert {c["name"] for c in report["constraints"]} == {"memory", "rank", "pcie", "int4"}
    assert report["recipe"]["batch_size"] == 2 and report["recipe"]["seq_len"] == 64


def test_check_passes_with_the_recipe_config(capsys, tiny_model_dir):
    config = os.path.join(REPO_ROOT, "recipes", "configs", "default.yaml")
    code, stdout, _ = run_cli(capsys, "check", "--model", str(tiny_model_dir), "--config", config, "--json")
    assert code == 0
    report = json.loads(stdout)
    assert report["passed"] is True and report["recipe"]["seq_len"] == 256  # from the YAML
    assert next(c for c in report["constraints"] if c["name"] == "memory")["status"] == "ok"
    if not torch.cuda.is_available():
        assert next(c for c in report["constraints"] if c["name"] == "rank")["status"] == "skipped"


def test_check_rank_follows_the_dtype_the_run_trains_in(monkeypatch, tmp_path, tiny_model_dir):
    """The meta model has no device: on a (here faked) GPU, layers count as fused when the run's dtype makes
    kernel 'auto' pick the Triton path (bf16 / fp16), as sits_lora.training's check_rank decides it."""
    from sits_lora import training
    from sits_lora.cli.check import run_check
    from sits_lora.training import HardwareReport

    gpu = HardwareReport(device="cuda:0", name="H200", total_memory=140 * 2**30, free_memory=130 * 2**30,
                         matmul_flops=788e12, hbm_bandwidth=4.25e12, h2d_bandwidth=55e9, d2h_bandwidth=55e9)
    monkeypatch.setattr(training, "probe_hardware", lambda device=None, **kwargs: gpu)
    for dtype, fused in (("float32", False), ("bfloat16", True)):
        config = tmp_path / f"{dtype}.yaml"
        config.write_text(f"dtype: {dtype}\n")
        rank = next(r for r in run_check(str(tiny_model_dir), str(config), 2, 64).results if r.name == "rank")
        assert rank.status != "skipped" and {row["fused"] for row in rank.details["layers"]} == {fused}, rank


def test_check_reads_a_gguf_header_like_transformers(tmp_path):
    """The fast GGUF path rebuilds the same config as transformers' reader (which reads the whole vocabulary)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from transformers import AutoConfig

    from sits_lora.cli.check import model_config

    for tied in (True, False):
        folder = tmp_path / f"tied{tied}"
        folder.mkdir()
        writer = gguf.GGUFWriter(str(folder / "m.gguf"), "llama")
        writer.add_name("tiny")
        writer.add_block_count(2)
        writer.add_context_length(128)
        writer.add_embedding_length(48)
        writer.add_feed_forward_length(80)
        writer.add_head_count(4)
        writer.add_head_count_kv(2)
        writer.add_rope_dimension_count(12)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(10000.0)
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(100)])  # longer than 64: skipped, counted
        writer.add_token_types([1] * 100)
        writer.add_tensor("token_embd.weight", np.zeros((100, 48), dtype=np.float32))
        if not tied:
            writer.add_tensor("output.weight", np.zeros((100, 48), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        fast, source = model_config(str(folder / "m.gguf"))
        slow = AutoConfig.from_pretrained(str(folder), gguf_file="m.gguf")
        ours, theirs = fast.to_dict(), slow.to_dict()
        ours.pop("_name_or_path"), theirs.pop("_name_or_path")
        assert ours == theirs and fast.tie_word_embeddings is tied and fast.vocab_size == 100
    (tmp_path / "bad.gguf").write_bytes(b"NOTGGUF" + bytes(32))
    from sits_lora.cli.check import CheckError

    with pytest.raises(CheckError, match="not a GGUF file"):
        model_config(str(tmp_path / "bad.gguf"))


# ----------------------------------------------------------------------------- profile


def test_profile_writes_csv_png_and_top10(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "profile"
    code, stdout, _ = run_cli(capsys, "profile", "--model", str(tiny_model_dir), "--batch-size", "2", "--seq-len", "16",
                              "--steps", "2", "--out", str(out))
    assert code == 0
    assert "top 10 (layer, op type)" in stdout and "LoRA branch in all layers" in stdout
    with open(out / "profile.csv") as f:
        rows = list(csv.DictReader(f))
    ops = ("norm", "attn_proj", "attn_core", "mlp_proj", "mlp_act", "lora")
    assert [(r["layer"], r["op_type"]) for r in rows] == (
        [(str(i), op) for i in range(2) for op in ops] + [("head", "norm"), ("head", "lm_head")])
    for r in rows:  # lora too: a difference of two passes, whose noise below zero is reported, not drawn
        assert math.isfinite(float(r["forward_ms"])) and math.isfinite(float(r["backward_ms"]))
        assert float(r["forward_ms"]) >= 0 and float(r["backward_ms"]) >= 0
    report = json.loads((out / "profile.json").read_text())
    assert report["step_ms"]["lora_noise_ms"] >= 0
    # norm, attn_core, mlp_act and the head are windows inside the adapted pass, attn_proj / mlp_proj inside the
    # pass with the adapter disabled: each pass's cells cannot sum past its own step time (with 2 steps a median
    # is a mean, so the sums of medians are medians of sums). A LoRA cell (adapted minus disabled projections,
    # clamped at 0) cannot pass the adapted step. The two passes are not compared with each other: a load spike
    # on this machine in one of them is not a bug.
    for phase in ("forward", "backward"):
        def cells(kinds):
            return sum(r[f"{phase}_ms"] for r in report["rows"] if r["op_type"] in kinds)

        assert 0 < cells(("norm", "attn_core", "mlp_act", "lm_head")) <= report["step_ms"][phase] * 1.001, phase
        assert 0 < cells(("attn_proj", "mlp_proj")) <= report["step_ms"][f"disabled_{phase}"] * 1.001, phase
        assert 0 <= cells(("lora",)) <= report["step_ms"][phase] * 1.001, phase
    assert report["meta"]["timer"] == ("CUDA events" if torch.cuda.is_available() else "time.perf_counter")
    assert (out / "profile.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_profile_keeps_sibling_fusion_and_removes_its_hooks():
    """On the Triton path (interpreter here) q/k/v and gate/up run fused; profiling must not split them."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs the Triton path: a GPU or TRITON_INTERPRET=1")
    from peft import get_peft_model

    from sits_lora.cli.profile import profile_model
    from sits_lora.layers.siblings import SiblingGroup

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = get_peft_model(tiny_llama(dtype=dtype).to(device), sits_lora.SitsLoraConfig(
        r=4, kernel="triton", target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    groups = {id(m.sibling_group): m.sibling_group for m in model.modules()
              if isinstance(getattr(m, "sibling_group", None), SiblingGroup)}
    assert len(groups) == 4  # q/k/v and gate/up in each of 2 layers
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)

    def hooks():  # the model's own hooks (the norms' of sits_lora.activations) stay; the profiler's go
        return {(name, key) for name, m in model.named_modules()
                for key in (*m._forward_hooks, *m._forward_pre_hooks)}

    before = hooks()
    rows, step = profile_model(model, ids, steps=1, warmup=0, progress=False)
    assert all(g.enabled for g in groups.values())
    assert hooks() == before
    lora = [r for r in rows if r["op_type"] == "lora"]
    assert len(lora) == 2 and step["forward"] > 0 and step["backward"] > 0


# ----------------------------------------------------------------------------- compile: versions of cached entries


# The measured files the packaged tuned_configs.json was copied from, each under its results folder's name (the raw
# folders are archived in git's history: docs/results.md); the test below checks that the two agree.
TUNING_RUNS = os.path.join(REPO_ROOT, "tests", "cli", "tuning_runs")


def test_packaged_tuning_versions_are_those_of_their_run():
    """tuned_configs.json holds run2's kernel_configs.json (its keys then carried versions), for which autotune
    names run2's torch / triton, the fp8-vs-bf16 layer measurements of a later H200 run (fp8_layers="auto"), and the
    decode kernel's configurations of a later H200 run under the same torch / triton (bench/decode_kernels.py)."""
    from sits_lora.cli.compile import _PACKAGED_VERSIONS

    run = os.path.join(TUNING_RUNS, "2026-11-30-h200-run2")
    with open(os.path.join(REPO_ROOT, "src", "sits_lora", "ops", "tuned_configs.json")) as f:
        packaged = json.load(f)
    with open(os.path.join(run, "kernel_configs.json")) as f:
        measured = json.load(f)
    with open(os.path.join(run, "tuning.json")) as f:
        environment = json.load(f)["environment"]
    suffix = f"|torch{environment['torch'].split('+')[0]}|triton{environment['triton']}"
    kernels = {k: v for k, v in packaged.items() if k != "capabilities" and not any(
        f"|{name}|" in k for name in ("fp8_layer", "decode", "decode_gemv"))}
    assert packaged["capabilities"] == {"NVIDIA H200": [9, 0]}   # the GPU of every packaged entry
    assert {k.removesuffix(suffix): v for k, v in measured.items() if k.endswith(suffix)} == kernels
    assert _PACKAGED_VERSIONS == {"torch": environment["torch"], "triton": environment["triton"]}
    fp8_run = os.path.join(TUNING_RUNS, "2026-12-01-h200-session8", "call4_gate_8b", "tune")
    with open(os.path.join(fp8_run, "kernel_configs.json")) as f:
        fp8_measured = {k: v for k, v in json.load(f).items() if "|fp8_layer|" in k}
    assert len(fp8_measured) == 8 and {k: v for k, v in packaged.items() if "|fp8_layer|" in k} == fp8_measured
    decode_run = os.path.join(TUNING_RUNS, "2026-12-03-h200-session23", "call1", "decode")
    with open(os.path.join(decode_run, "decode_configs.json")) as f:
        decode_measured = json.load(f)
    with open(os.path.join(decode_run, "decode_kernels.json")) as f:
        decode_environment = json.load(f)["environment"]
    # rank 16 from that run; rank 128 (the block mixed batches of 8 adapters decode at) and the one-row kernel's
    # configurations, stored where it beat the dot kernel, from a later run under the same torch / triton
    later_run = os.path.join(TUNING_RUNS, "2026-12-04-h200-session29", "call2")
    with open(os.path.join(later_run, "dk128", "decode_configs.json")) as f:
        decode_measured.update(json.load(f))
    # the 8B shape's rank-128 entries at 32 rows tuned again with bf16 stacks, as mixed decode steps read them
    bf16_run = os.path.join(TUNING_RUNS, "2026-12-04-h200-session29", "call4", "dk128bf")
    with open(os.path.join(bf16_run, "decode_configs.json")) as f:
        decode_measured.update(json.load(f))
    # rank 16 at 1 and 32 rows tuned again with the L2 cold (the one-row kernel then won only at 8B gate / up), and
    # the sibling groups (q+k+v, gate+up: one kernel each) at their total width, with bf16 adapters
    cold_run = os.path.join(TUNING_RUNS, "2026-12-04-h200-session30")
    with open(os.path.join(cold_run, "call1", "dk16", "decode_configs.json")) as f:
        cold = json.load(f)
    decode_measured.update({k: v for k, v in cold.items() if "|decode|" in k})
    with open(os.path.join(cold_run, "call2", "groups", "decode_configs.json")) as f:
        decode_measured.update(json.load(f))
    # the sibling groups at rank 128 (mixed decode steps run them as one kernel), bf16 adapters; that run's time
    # limit stopped it after it wrote its cache, before its results file (decode_kernels.json): its environment is
    # the next run's on the same machine (serve.json)
    groups_run = os.path.join(TUNING_RUNS, "2026-12-04-h200-session31", "call1")
    with open(os.path.join(groups_run, "r128", "decode_configs.json")) as f:
        groups128 = json.load(f)
    assert len(groups128) == 8 and all("x128|" in k for k in groups128)
    decode_measured.update(groups128)
    one_row = {k: v for k, v in cold.items() if "|decode_gemv|" in k}
    with open(os.path.join(groups_run, "serve", "serve.json")) as f:
        environments = [decode_environment, json.load(f)["environment"]]
    for path in (os.path.join(later_run, "dk16"), os.path.join(cold_run, "call1", "dk16"),
                 os.path.join(cold_run, "call2", "groups")):
        with open(os.path.join(path, "decode_kernels.json")) as f:
            environments.append(json.load(f)["environment"])
    assert {k: v for k, v in packaged.items() if "|decode|" in k} == decode_measured
    assert {k: v for k, v in packaged.items() if "|decode_gemv|" in k} == one_row and len(one_row) == 1
    for env in environments:
        assert {k: env[k] for k in ("torch", "triton")} == _PACKAGED_VERSIONS


def test_compile_report_names_the_versions_that_measured_each_entry(tmp_path):
    from sits_lora.cli.compile import (
        _PACKAGED_VERSIONS,
        CompileReport,
        cached_entry,
        current_versions,
        record_versions,
        versions_path,
    )

    cache = str(tmp_path / "kernel_configs.json")
    old = {"torch": "2.10.0", "triton": "3.5.0"}
    path = record_versions(cache, ["GPU|shrink|576x16|bfloat16"], old)
    assert path == str(tmp_path / "kernel_configs.versions.json")
    records = json.loads(open(versions_path(cache)).read())
    assert records["GPU|shrink|576x16|bfloat16"]["triton"] == "3.5.0" and records["GPU|shrink|576x16|bfloat16"]["tuned_at"]
    cfg, other = {"BLOCK_T": 64}, {"BLOCK_T": 128}
    user = {"GPU|shrink|576x16|bfloat16": cfg, "GPU|expand|576x16|bfloat16": cfg, "GPU|x_pass|576x16|bfloat16": cfg,
            "GPU|dy_pass|576x16|bfloat16": other}
    packaged = {"GPU|x_pass|576x16|bfloat16": cfg, "GPU|dy_pass|576x16|bfloat16": cfg, "GPU|x_pass|64x16|bfloat16": cfg}
    assert cached_entry("GPU|shrink|576x16|bfloat16", user, packaged, records) == ("cached", old)
    assert cached_entry("GPU|expand|576x16|bfloat16", user, packaged, records) == ("cached", None)  # no record
    # a copy of the packaged entry that a tuning run saved into the user's file is the packaged entry
    assert cached_entry("GPU|x_pass|576x16|bfloat16", user, packaged, records) == ("cached (packaged)",
                                                                                   _PACKAGED_VERSIONS)
    assert cached_entry("GPU|dy_pass|576x16|bfloat16", user, packaged, records) == ("cached", None)  # tuned over it
    assert cached_entry("GPU|x_pass|64x16|bfloat16", user, packaged, records) == ("cached (packaged)", _PACKAGED_VERSIONS)
    assert cached_entry("GPU|expand|64x16|bfloat16", user, packaged, records) == (None, None)

    running = current_versions()
    assert running == {"torch": torch.__version__, "triton": __import__("triton").__version__}
    rows = [{"kernel": "shrink", "dims": [576, 16], "layers": 2, "source": "cached", "versions": old, "config": cfg},
            {"kernel": "expand", "dims": [576, 16], "layers": 2, "source": "cached", "versions": None, "config": cfg},
            {"kernel": "x_pass", "dims": [576, 16], "layers": 2, "source": "tuned now", "versions": running,
             "config": cfg, "best_ms": 0.01, "default_ms": 0.02}]
    report = CompileReport(model="m", gpu="GPU", dtype="bfloat16", tokens=2048, cache_file=cache, rows=rows, seconds=1.0,
                           versions=running)
    table = report.table()
    assert "measured with" in table and "torch 2.10.0, triton 3.5.0" in table and "unknown" in table
    assert f"torch {running['torch']}, triton {running['triton']}" in table.splitlines()[0]
    assert ("the cache key is GPU, kernel, shape and dtype, not versions: 1 cached entries were measured under other "
            "torch / triton versions and 1 under unknown ones; --force") in table
    payload = json.loads(json.dumps(report.to_dict()))
    assert payload["cache_key"] == ["gpu", "kernel", "dims", "dtype"] and payload["versions"] == running
    assert payload["cached_under_other_versions"] == 1 and payload["versions_unknown"] == 1 and payload["tuned"] == 1
    assert payload["versions_file"] == path and payload["rows"][0]["versions"] == old


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_bench_measures_every_part(tmp_path):
    result = BenchmarkRunner(backend="auto", progress=False).run()
    assert result.backend in ("cuda", "rocm")
    # The alignment rule's verdict is what this GPU measured (a 32-byte offset can cost a few per cent where the
    # loads straddle more 128-byte lines): either verdict is a result, as long as it follows from its measurements.
    # Every other part must hold.
    verdict = next(i for i in result.items if i.section == "int4 alignment" and i.name.startswith("rule "))
    assert verdict.status in ("ok", "violated", "warning"), verdict
    if verdict.status != "warning":
        assert (verdict.status == "violated") == (not verdict.details["rule_holds"]), verdict
        assert result.passed == (verdict.status == "ok")
    failed = [(i.name, i.status, i.summary) for i in result.items if i.status in ("violated", "error") and i is not verdict]
    assert not failed, failed
    names = {(i.section, i.name): i for i in result.items}
    assert names[("device memory", "copy bandwidth")].value > 1e11
    assert names[("device memory", "bf16 matmul")].value > 1e13
    assert names[("device memory", "LoRA layer fwd+bwd")].status == "ok"
    pcie = [i for i in result.items if i.section == "pcie" and "sizes" in i.details]
    assert len(pcie) == 4 and all(len(i.details["sizes"]) == 5 for i in pcie)
    assert names[("pcie", "adapter checkpoint load")].status == "measured"
    assert len([i for i in result.items if i.name.startswith("offset ")]) == len(DEFAULT_INT4_OFFSETS)
    assert result.seconds < 180
    assert result.plot(str(tmp_path / "bench.png"))
    assert json.loads(json.dumps(result.to_dict()))["passed"] == result.passed


@pytest.mark.gpu
def test_gpu_check_runs_every_constraint(capsys, tiny_model_dir):
    code, stdout, _ = run_cli(capsys, "check", "--model", str(tiny_model_dir), "--json")
    report = json.loads(stdout)
    status = {c["name"]: c["status"] for c in report["constraints"]}
    assert status["rank"] != "skipped" and status["pcie"] != "skipped" and status["memory"] != "skipped"
    assert code == (0 if report["passed"] else 1)


@pytest.mark.gpu
def test_gpu_profile_uses_cuda_events(capsys, tmp_path, tiny_model_dir):
    code, _, _ = run_cli(capsys, "profile", "--model", str(tiny_model_dir), "--batch-size", "2", "--seq-len", "64",
                         "--out", str(tmp_path))
    assert code == 0
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["meta"]["timer"] == "CUDA events" and report["meta"]["dtype"] == "bfloat16"


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_compile_tunes_then_reuses_the_cache(capsys, tmp_path, tiny_model_dir, monkeypatch):
    config = tmp_path / "q.yaml"
    config.write_text("target_modules: [q_proj]\nbatch_size: 2\nseq_len: 512\n")
    cache = tmp_path / "kernel_configs.json"
    monkeypatch.setenv("SITS_LORA_TUNING_CACHE", str(cache))  # --cache sets it too; restored after the test
    argv = ["compile", "--model", str(tiny_model_dir), "--config", str(config), "--cache", str(cache), "--json"]
    code, stdout, _ = run_cli(capsys, *argv)
    first = json.loads(stdout)
    assert code == 0 and first["tuned"] == 4 and cache.exists()  # shrink, expand, dy pass, x pass at 48 x 48
    code, stdout, _ = run_cli(capsys, *argv)
    second = json.loads(stdout)
    assert code == 0 and second["tuned"] == 0 and {r["source"] for r in second["rows"]} == {"cached"}
    assert [r["config"] for r in second["rows"]] == [r["config"] for r in first["rows"]]
    # the versions that measured each entry, recorded by the first run next to the cache
    assert all(r["versions"] == first["versions"] for r in first["rows"] + second["rows"])
    assert second["cached_under_other_versions"] == 0 and second["versions_unknown"] == 0
    assert (tmp_path / "kernel_configs.versions.json").exists()


def test_compile_fp8_measures_each_layer_shape_once_then_reads_the_cache(monkeypatch, tmp_path):
    from sits_lora.cli import compile as compile_cli
    from sits_lora.fp8 import selection
    from sits_lora.ops import tuning

    monkeypatch.setenv("SITS_LORA_TUNING_CACHE", str(tmp_path / "kernel_configs.json"))
    stored, timed = {}, []
    device = torch.device("cuda", 0)   # a key only: nothing runs on it

    def measure_layer(K, N, tokens, rank):
        timed.append((K, N, tokens, rank))
        stored[(K, N)] = {"ratio": 0.8 if K * N > 2**23 else 1.3, "use_fp8": K * N > 2**23, "bf16_ms": 1.0,
                          "fp8_ms": 0.8 if K * N > 2**23 else 1.3, "tokens": tokens, "rank": rank}
        return stored[(K, N)]

    monkeypatch.setattr(selection, "measure_layer", measure_layer)
    monkeypatch.setattr(tuning, "fp8_layer_measurement", lambda device, K, N: stored.get((K, N)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(tuning, "config_key", lambda kernel, device, dims, dtype: f"GPU|{kernel}|{dims}")
    shapes = [{"name": f"l{i}.{p}", "K": K, "N": N, "r": 16}
              for i in range(2) for p, K, N in (("q", 2048, 2048), ("up", 2048, 8192), ("down", 8192, 2048))]
    cached = lambda key: ("cached", {"torch": "x"})  # noqa: E731
    first = compile_cli.fp8_crossover_rows(shapes, device, 8192, False, cached)
    assert timed == [(2048, 2048, 8192, 16), (2048, 8192, 8192, 16), (8192, 2048, 8192, 16)]
    assert [(r["dims"], r["layers"], r["source"], r["config"]["base"]) for r in first] == [
        ([2048, 2048], 2, "tuned now", "bf16"), ([2048, 8192], 2, "tuned now", "fp8"),
        ([8192, 2048], 2, "tuned now", "fp8")]
    assert first[1]["best_ms"] == 0.8 and first[1]["default_ms"] == 1.0
    second = compile_cli.fp8_crossover_rows(shapes, device, 8192, False, cached)
    assert len(timed) == 3 and {r["source"] for r in second} == {"cached"}
    assert [r["config"] for r in second] == [r["config"] for r in first]
    compile_cli.fp8_crossover_rows(shapes, device, 8192, True, cached)     # --force measures again
    assert len(timed) == 6


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_compile_fp8_stores_where_the_fp8_base_pays(capsys, tmp_path, tiny_model_dir, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the fp8 base needs compute capability >= 8.9")
    config = tmp_path / "q.yaml"
    config.write_text("target_modules: [q_proj, up_proj]\nbatch_size: 2\nseq_len: 512\n")
    cache = tmp_path / "kernel_configs.json"
    monkeypatch.setenv("SITS_LORA_TUNING_CACHE", str(cache))
    argv = ["compile", "--model", str(tiny_model_dir), "--config", str(config), "--cache", str(cache), "--fp8",
            "--json"]
    code, stdout, _ = run_cli(capsys, *argv)
    rows = [r for r in json.loads(stdout)["rows"] if r["kernel"] == "fp8_layer"]
    assert code == 0 and len(rows) == 2 and {r["source"] for r in rows} == {"tuned now"}
    assert all(r["config"]["base"] in ("fp8", "bf16") and r["best_ms"] > 0 for r in rows)
    code, stdout, _ = run_cli(capsys, *argv)
    again = [r for r in json.loads(stdout)["rows"] if r["kernel"] == "fp8_layer"]
    assert code == 0 and {r["source"] for r in again} == {"cached"}
    assert [r["config"] for r in again] == [r["config"] for r in rows]


def test_check_plans_the_int4_base_and_names_what_it_cannot_plan(capsys, tmp_path, tiny_model_dir):
    from conftest import tiny_llama

    folder = tmp_path / "model"
    tiny_llama(0, hidden_size=64, intermediate_size=96).save_pretrained(folder)
    plans = {}
    for quant in ("off", "int4"):
        recipe = tmp_path / f"{quant}.yaml"
        recipe.write_text(f"base_quant: {quant}\n")
        code, out, _ = run_cli(capsys, "check", "--model", str(folder), "--config", str(recipe), "--json")
        assert code in (0, 1)
        plans[quant] = json.loads(out)["memory_plan"]
    assert plans["int4"]["frozen_weights"] < plans["off"]["frozen_weights"]
    nf4 = tmp_path / "nf4.yaml"
    nf4.write_text("base_quant: nf4\n")
    code, _, err = run_cli(capsys, "check", "--model", str(folder), "--config", str(nf4))
    assert code == 2 and "base_quant: nf4 is not planned by `sits-lora check`" in one_line_error(err, "check")
    unfit = tmp_path / "unfit.yaml"
    unfit.write_text("base_quant: int4\n")
    code, _, err = run_cli(capsys, "check", "--model", str(tiny_model_dir), "--config", str(unfit))
    assert code == 2 and "no INT4 group size of 128, 64, 32 divides" in one_line_error(err, "check")


def test_compile_tunes_the_sibling_groups_launches_at_their_summed_rank():
    """q / k / v and gate / up each run one shrink and one x pass over their shared input at the summed rank; the
    single-rank shrink and x pass of those layers never launch, so compile tunes the group's dims instead; each
    layer keeps its own expand and dy pass."""
    from peft import get_peft_model

    from sits_lora import SitsLoraConfig
    from sits_lora.cli.check import adapted_linear_shapes
    from sits_lora.cli.compile import kernel_launches, product_input_layers
    from sits_lora.layers.siblings import sibling_group_members

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with torch.device("meta"):
        model = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=96, num_hidden_layers=2),
                               SitsLoraConfig(r=16, target_modules=targets))
    groups = sibling_group_members(model)
    assert sorted(name.rsplit(".", 1)[-1] for name in groups[0] + groups[1]) == sorted(targets[:3] + targets[4:6])
    assert len(groups) == 4   # two a decoder layer
    wanted = kernel_launches(adapted_linear_shapes(model), groups)
    h, kv = 64, 64 // 4 * 2
    assert {dims: e["layers"] for (kernel, dims), e in wanted.items() if kernel == "shrink"} == {
        (h, 64): 6,      # q / k / v at rank 48, block 64
        (h, 32): 4,      # gate / up at rank 32
        (h, 16): 2,      # o_proj alone
        (96, 16): 2}     # down_proj alone
    assert {dims for (kernel, dims) in wanted if kernel == "x_pass"} == {(h, 64), (h, 32), (h, 16), (96, 16)}
    assert {dims: e["layers"] for (kernel, dims), e in wanted.items() if kernel == "dy_pass"} == {
        (h, 16): 6, (kv, 16): 4, (96, 16): 4}   # q, o, down / k, v / gate, up
    assert wanted[("shrink", (h, 64))]["shape"] == (h, h, 48)
    assert ("x_pass_product", (96, 16)) not in wanted   # without the layers whose input is two factors
    # the down projections read their input as the gate / up factors: their x pass has its own configuration
    products = product_input_layers(model, adapted_linear_shapes(model), groups)
    assert sorted(products) == [f"base_model.model.model.layers.{i}.mlp.down_proj" for i in range(2)]
    with_products = kernel_launches(adapted_linear_shapes(model), groups, products)
    assert with_products[("x_pass_product", (96, 16))] == {"layers": 2, "shape": (96, h, 16)}
    assert {k: v for k, v in with_products.items() if k[0] != "x_pass_product"} == wanted
    # without sibling fusion every layer launches its own
    with torch.device("meta"):
        alone = get_peft_model(tiny_llama(hidden_size=64, intermediate_size=96, num_hidden_layers=2),
                               SitsLoraConfig(r=16, target_modules=targets, fuse_siblings=False))
    assert sibling_group_members(alone) == []
    assert {dims for (kernel, dims) in kernel_launches(adapted_linear_shapes(alone), []) if kernel == "shrink"} == {
        (h, 16), (96, 16)}
