"""bench/serve.py on the CPU (--smoke: a tiny Llama): a row per arm and batch, the files, and its refusals."""

from __future__ import annotations

import json

import pytest
from conftest import bench_module


def test_smoke_run_writes_every_arm(tmp_path):
    serve = bench_module("serve")
    assert serve.main(["--smoke", "--out", str(tmp_path), "--batches", "2", "3"]) == 0
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert sorted((r["batch"], r["arm"]) for r in rows) == sorted((b, a) for b in (2, 3) for a in serve.ARMS)
    assert all(r["new_tokens"] == 3 and len(r["rounds_ms"]) == 1 for r in rows)
    assert (tmp_path / "serve.csv").is_file()
    stream = next(r for r in rows if r["arm"] == "sits+stream")
    assert stream["pool_stats"]["loads"] > 2 and stream["request_ms"] > 0   # 8 adapters through 2 slots


def test_plan_writes_the_measured_costs_and_crossover_per_batch(tmp_path):
    serve = bench_module("serve")
    assert serve.main(["--smoke", "--out", str(tmp_path), "--batches", "1", "2", "--arms", "merged", "sits",
                       "--plan"]) == 0
    rows = json.loads((tmp_path / "serve_plan.json").read_text())["rows"]
    assert [(r["shape"], r["batch"], r["graphs"]) for r in rows] == [("tiny", 1, False), ("tiny", 2, False)]
    for r in rows:
        assert r["dispatch_ms"] > 0 and r["merged_ms"] > 0 and r["merge_ms"] > 0
        saved = r["dispatch_ms"] - r["merged_ms"]
        assert r["crossover_tokens"] == (pytest.approx(r["merge_ms"] / saved) if saved > 0 else None)
    assert (tmp_path / "serve_plan.csv").is_file()


def test_refusals_name_the_flag(capsys):
    serve = bench_module("serve")
    with pytest.raises(SystemExit):
        serve.main(["--smoke", "--out", "x", "--new-tokens", "1"])
    assert "--new-tokens must be >= 2" in capsys.readouterr().err


def test_the_replay_timer_times_replays_only_while_active_and_puts_replay_back():
    serve = bench_module("serve")
    clock = iter(range(100))

    class Event:
        def record(self):
            self.at = next(clock)

        def elapsed_time(self, end):
            return float(end.at - self.at)

    class Graph:
        def replay(self):
            next(clock)            # the replay's own work: one tick between its two events

    original = Graph.replay
    timer = serve.ReplayTimer(Graph, Event).install()
    Graph().replay()               # not active: no events
    timer.active = True
    Graph().replay()
    Graph().replay()
    assert timer.take_ms() == [2.0, 2.0] and timer.take_ms() == []
    with timer.paused():           # a profiled request: its replays are not timed
        Graph().replay()
    assert timer.active and timer.take_ms() == []
    timer.uninstall()
    assert Graph.replay is original


def test_rows_without_graph_arms_carry_no_gpu_step(tmp_path):
    serve = bench_module("serve")
    assert serve.main(["--smoke", "--out", str(tmp_path), "--batches", "2", "--arms", "merged", "sits"]) == 0
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert [(r["arm"], r["gpu_step_ms"], r["gpu_vs_merged"]) for r in rows] == [("merged", None, None),
                                                                                 ("sits", None, None)]


def test_kernels_a_step_are_the_long_request_less_the_short_one():
    serve = bench_module("serve")
    prefill = [("gemm", 50.0), ("attention", 20.0)]
    step = [("gemm", 5.0), ("lora", 2.0), ("gemm", 5.0)]
    long = prefill + step * 4                    # 4 decode steps more than the short request
    got = serve.per_step_kernels(long, prefill, 4)
    assert got == [("gemm", 2.0, 10.0), ("lora", 1.0, 2.0)]   # the prefill's kernels cancel; longest first


def test_profile_needs_a_gpu(capsys):
    serve = bench_module("serve")
    with pytest.raises(SystemExit):
        serve.main(["--smoke", "--out", "x", "--profile"])
    assert "--profile lists CUDA kernels: it needs a CUDA GPU" in capsys.readouterr().err
