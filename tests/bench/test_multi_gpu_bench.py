"""bench/multi_gpu.py on the CPU: --smoke (the tiny shape on 1 and 2 gloo processes, DDP and FSDP2), the loss
curves of the recipe on 1 and 2 processes, and its refusals."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import bench_module, code_corpus, shared_across_workers


@pytest.fixture
def shared_one_process(monkeypatch, tmp_path_factory):
    """bench/multi_gpu.py's one-process reference (the unwrapped run every throughput call starts with) made once a
    session for the same arguments: the smoke run and the --world 1 run ask for the same one (arm sits, the smoke
    shape, batch, steps), the first to ask runs it and the other reads its row (conftest.shared_across_workers).
    The wrapped runs are each test's own."""
    bench = bench_module("multi_gpu")
    real = bench.run_setting

    def run_setting(shape, strategy, world, args, wrapped=True):
        if wrapped:
            return real(shape, strategy, world, args, wrapped)
        key = "-".join(str(v) for v in (shape, strategy, world, args.arm, args.batch, args.seq, args.warmup,
                                        args.steps, args.layers, args.smoke))
        return shared_across_workers(tmp_path_factory, f"multi-gpu-one-process-{key}",
                                     lambda folder: real(shape, strategy, world, args, wrapped))

    monkeypatch.setattr(bench, "run_setting", run_setting)


@pytest.mark.slow
def test_smoke_run_measures_one_process_and_both_strategies(tmp_path, shared_one_process):
    bench = bench_module("multi_gpu")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "multi_gpu.json").read_text())["rows"]
    assert [(r["strategy"], r["processes"]) for r in rows] == [("one process", 1), ("ddp", 2), ("fsdp2", 2)]
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(row["processes"] * 2 * 32 / row["step_s"])
        assert row["loss_first"] > 0 and len(row["peak_gib_per_rank"]) == row["processes"]
    one, ddp, fsdp2 = rows
    assert ddp["scaling_efficiency"] == pytest.approx(ddp["tokens_per_s"] / (2 * one["tokens_per_s"]))
    # every run starts from the same weights and rank 0's batch: the first losses agree
    assert ddp["loss_first"] == pytest.approx(one["loss_first"], rel=1e-5)
    assert fsdp2["loss_first"] == pytest.approx(one["loss_first"], rel=1e-5)
    assert (tmp_path / "multi_gpu.csv").is_file() and (tmp_path / "multi_gpu.png").is_file()


@pytest.mark.slow
def test_wrappers_on_one_rank_and_the_fp8_base_train_as_one_process_does(tmp_path, shared_one_process):
    """--world 1 (a machine with one GPU): each strategy's wrapper over a process group of one rank, against the
    unwrapped process; "ddp+static" (DDP with static_graph and gradient_as_bucket_view) changes no arithmetic either.
    --arm sits+fp8 (emulated on the CPU) advances the fp8 scales each step on every run; on 2 ranks every rank takes
    the same scales, so its first loss is the one process's."""
    bench = bench_module("multi_gpu")
    assert bench.main(["--smoke", "--world", "1", "--settings", "tiny:ddp", "tiny:fsdp2", "tiny:ddp+static",
                       "--out", str(tmp_path / "static")]) == 0
    rows = json.loads((tmp_path / "static" / "multi_gpu.json").read_text())["rows"]
    assert [(r["strategy"], r["processes"]) for r in rows] == [("one process", 1), ("ddp", 1), ("fsdp2", 1),
                                                               ("ddp+static", 1)]
    one, ddp, fsdp2, static = rows
    for row in (ddp, fsdp2, static):   # one rank, the same batch: the wrappers change no arithmetic
        assert row["loss_first"] == pytest.approx(one["loss_first"], rel=1e-6)
        assert row["loss_last"] == pytest.approx(one["loss_last"], rel=1e-4)
        assert row["scaling_efficiency"] == pytest.approx(row["tokens_per_s"] / one["tokens_per_s"])
    assert static["loss_last"] == pytest.approx(ddp["loss_last"], rel=1e-6)
    assert bench.main(["--smoke", "--arm", "sits+fp8", "--steps", "3", "--settings", "tiny:ddp", "tiny:fsdp2",
                       "--out", str(tmp_path / "fp8")]) == 0
    rows = json.loads((tmp_path / "fp8" / "multi_gpu.json").read_text())["rows"]
    assert [(r["arm"], r["strategy"], r["processes"]) for r in rows] == [
        ("sits+fp8", "one process", 1), ("sits+fp8", "ddp", 2), ("sits+fp8", "fsdp2", 2)]
    assert rows[0]["fp8_base_layers"] > 0 and all(r["fp8_base_layers"] == rows[0]["fp8_base_layers"] for r in rows)
    for row in rows[1:]:
        assert row["loss_first"] == pytest.approx(rows[0]["loss_first"], rel=1e-5)
        assert row["loss_last"] < row["loss_first"] * 1.5   # trained through delayed scales, nothing blew up


@pytest.mark.slow
def test_loss_curves_of_one_and_two_processes_agree(tmp_path, tiny_model_dir):
    bench = bench_module("multi_gpu")
    corpus = code_corpus(tmp_path)
    assert bench.main(["--loss-curve", "--out", str(tmp_path / "out"), "--curve-steps", "3", "--curve-seq", "32",
                       "--curve-model", str(tiny_model_dir), "--curve-dataset", str(corpus)]) == 0
    result = json.loads((tmp_path / "out" / "multi_gpu_loss_curve.json").read_text())
    assert [r["step"] for r in result["rows"]] == [1, 2, 3]
    assert result["max_rel_diff"] < 1e-3, result["rows"]
    assert result["runs"]["1"]["batch_per_process"] == 4 and result["runs"]["2"]["batch_per_process"] == 2


def test_a_run_past_its_time_limit_leaves_a_row_with_the_error(tmp_path):
    bench = bench_module("multi_gpu")
    assert bench.main(["--smoke", "--out", str(tmp_path), "--settings", "tiny:ddp", "--run-timeout", "0.5"]) == 1
    rows = json.loads((tmp_path / "multi_gpu.json").read_text())["rows"]
    assert len(rows) == 2 and all("ran out of its --run-timeout" in r["error"] for r in rows)


def test_a_failed_run_names_the_ranks_exception_not_the_launchers_summary(tmp_path):
    bench = bench_module("multi_gpu")
    # torch.distributed.run ends stderr with its summary; the exception comes before it
    stderr = ("Traceback (most recent call last):\n  ...\nRuntimeError: Connection closed by peer\n"
              "E1204 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 1)\n" + "=" * 40 + "\n")
    assert bench._error_line(1, stderr) == "exited with 1: RuntimeError: Connection closed by peer"
    # a rank that failed left its traceback beside the result: that wins
    (tmp_path / "row.json.rank1.error").write_text("Traceback (most recent call last):\n  ...\n"
                                                   "ValueError: shard sizes differ\n")
    assert bench._error_line(1, stderr, str(tmp_path)) == "exited with 1: rank 1: ValueError: shard sizes differ"
    assert bench._error_line(124, "", str(tmp_path)).startswith("ran out of its --run-timeout: rank 1")


@pytest.mark.parametrize("args, needle", [
    (["--smoke", "--world", "0"], "--world must be >= 1"),
    (["--smoke", "--settings", "70b:ddp"], "a setting is SHAPE:STRATEGY"),
    pytest.param(["--smoke", "--arm", "sits+liger"], "needs Liger-Kernel", marks=pytest.mark.skipif(
        importlib.util.find_spec("liger_kernel") is not None, reason="Liger-Kernel is installed: the run would start")),
    pytest.param(["--settings", "1b:ddp"], "needs 2 GPUs", marks=pytest.mark.skipif(
        torch.cuda.device_count() >= 2, reason="this machine has the GPUs: the run would start")),
])
def test_refusals_name_the_flag(args, needle, capsys, tmp_path):
    bench = bench_module("multi_gpu")
    with pytest.raises(SystemExit):
        bench.main(args + ["--out", str(tmp_path)])
    assert needle in capsys.readouterr().err
