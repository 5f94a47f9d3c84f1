"""bench/regress.py, the GPU regression gate: its checks on made-up rows, its baseline, and a CPU run."""

from __future__ import annotations

import json

import pytest

from conftest import bench_module

regress = bench_module("regress")


def _rows(shape, **steps):
    rows = [{"shape": shape, "arm": arm.replace("_", "+"), "step_s": s, "layers": 2} for arm, s in steps.items()]
    bench_module("bench_model").add_floor_ratios(rows)
    return rows


def _by_what(checks, kind):
    return {(c["shape"], c["what"]): c for c in checks if c["kind"] == kind}


def test_a_sits_arm_more_than_five_percent_over_its_baseline_fails():
    baseline = {"rows": _rows("1b", frozen=1.0, frozen_liger=0.8, sits=1.2, sits_liger=1.0)}
    now = _rows("1b", frozen=1.0, frozen_liger=0.8, sits=1.2 * 1.04, sits_liger=1.0 * 1.06)
    checks = _by_what(regress.compare(now, baseline, [], {}), "regression")
    assert checks[("1b", "sits")]["ok"] is True          # 4 % over: inside the tolerance
    assert checks[("1b", "sits+liger")]["ok"] is False   # 6 % over
    assert "1.325x floor, baseline 1.250x" in checks[("1b", "sits+liger")]["detail"]
    # ratios to the floor, not times: a machine 10 % slower in every arm passes
    slower = _rows("1b", frozen=1.1, frozen_liger=0.88, sits=1.32, sits_liger=1.1)
    assert all(c["ok"] for c in regress.compare(slower, baseline, [], {}))


def test_a_host_bound_arm_is_named_so_and_judged_the_same():
    baseline = {"rows": _rows("1b", frozen_liger=0.8, sits_liger=1.0)}
    now = _rows("1b", frozen_liger=0.8, sits_liger=1.1)
    now[0]["host_s"], now[1]["host_s"] = 0.6, 1.09                  # the floor GPU-bound, sits' host ~ its step
    check = _by_what(regress.compare(now, baseline, [], {}), "regression")[("1b", "sits+liger")]
    assert check["ok"] is False
    assert "host-bound (the host took 1090.0 of the step's 1100.0 ms)" in check["detail"]
    now[1]["host_s"] = 0.5
    check = _by_what(regress.compare(now, baseline, [], {}), "regression")[("1b", "sits+liger")]
    assert check["ok"] is False and "host-bound" not in check["detail"]


def test_failed_arms_graph_breaks_and_missing_baselines_are_reported():
    rows = _rows("8b", frozen=1.0, sits=1.1) + [{"shape": "8b", "arm": "sits+fp8", "error": "CUDA out of memory"}]
    breaks = [{"config": "static", "graph_breaks": 0}, {"config": "fp8 hybrid", "graph_breaks": 3},
              {"config": "dynamic rank, random router", "graph_breaks": 22},
              {"config": "some other", "graph_breaks": 5}]
    checks = regress.compare(rows, None, breaks, {})
    regression = _by_what(checks, "regression")
    assert regression[("8b", "sits")]["ok"] is None and regression[("8b", "sits")]["detail"] == "no baseline"
    assert regression[("8b", "sits+fp8")]["ok"] is False
    compiled = _by_what(checks, "graph breaks")
    assert compiled[("-", "static")]["ok"] is True and compiled[("-", "fp8 hybrid")]["ok"] is False
    assert compiled[("-", "dynamic rank, random router")]["ok"] is False  # gated since it traces whole
    assert ("-", "some other") not in compiled  # a configuration outside the gated list: in the JSON only
    # a configuration that compiles again at every call fails like a break
    again = [{"config": "static", "graph_breaks": 0, "recompiles": 2}]
    check = _by_what(regress.compare(rows, None, again, {}), "graph breaks")[("-", "static")]
    assert check["ok"] is False and check["detail"] == "0 breaks, 2 recompiles on the next calls"


def test_targets_use_the_floor_of_the_same_run():
    rows = _rows("1b", frozen=1.2, frozen_compile=1.0, frozen_liger=0.9, peft_compile=1.8,
                 sits=1.3, sits_compile=1.08, sits_liger=1.0, sits_fp8=1.1)
    checks = _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")
    assert checks[("1b", "best sits bf16 <= 1.10x floor")]["ok"] is False      # 1.0 / 0.9 = 1.11
    assert checks[("1b", "sits+compile <= 1.10x frozen+compile")]["ok"] is True  # 1.08
    assert checks[("1b", "best sits bf16 >= 1.6x peft+compile")]["ok"] is True   # 1.8 / 1.0
    assert checks[("1b", "best sits fp8 no slower than best sits bf16")]["ok"] is False
    assert "sits+liger 1.111x the floor" in checks[("1b", "best sits bf16 <= 1.10x floor")]["detail"]
    assert not any(c["shape"] == "8b" for c in regress.compare(rows, None, [], regress.TARGETS))


def test_the_memory_target_compares_with_the_peak_of_the_floor_arm():
    """The floor is the fastest frozen arm; its peak, not the leanest frozen arm's, is what sits + Liger may pass by
    at most 1 GiB."""
    rows = _rows("8b", frozen=1.2, frozen_compile=1.0, frozen_liger=0.9, sits_liger=0.95)
    peaks = {"frozen": 5.0, "frozen+compile": 9.0, "frozen+liger": 7.0}
    for row in rows:
        row["peak_gib"] = peaks.get(row["arm"], 7.9)
    target = "sits+liger peak <= floor peak + 1 GiB"
    check = _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")[("8b", target)]
    assert check["ok"] is True and "floor (frozen+liger) 7.00 GiB (+0.90" in check["detail"]
    next(r for r in rows if r["arm"] == "sits+liger")["peak_gib"] = 8.1
    assert _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")[("8b", target)]["ok"] is False
    del next(r for r in rows if r["arm"] == "sits+liger")["peak_gib"]
    assert _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")[("8b", target)]["ok"] is None


def test_the_4bit_targets_compare_speed_peak_and_weight_bytes_in_the_same_run():
    rows = _rows("8b", frozen_liger=1.0, sits_liger=1.05, peft_nf4=2.0, sits_nf4=1.3, sits_nf4_liger=1.1,
                 sits_int4=1.4, sits_int4_liger=1.25)
    info = {"peft+nf4": (50.0, 0.26), "sits+nf4": (30.0, 0.26), "sits+nf4+liger": (31.0, 0.26),
            "sits+int4": (30.0, 0.27), "sits+int4+liger": (28.0, 0.36)}
    for row in rows:
        row["peak_gib"], row["adapted_weight_ratio"] = info.get(row["arm"], (20.0, None))
    checks = _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")
    speed = checks[("8b", "best sits nf4 >= 1.8x peft+nf4 (PEFT QLoRA)")]
    assert speed["ok"] is True and "sits+nf4+liger 1.82x as fast as peft+nf4" in speed["detail"]
    peak = checks[("8b", "fastest sits nf4 peak <= 0.6x peft+nf4 peak")]
    assert peak["ok"] is False and "sits+nf4+liger peak 31.0 GiB, 0.62x" in peak["detail"]   # the fastest one's
    assert checks[("8b", "best sits nf4 <= 1.15x best sits bf16")]["ok"] is True               # 1.1 / 1.05
    assert checks[("8b", "best sits int4 <= 1.15x best sits bf16")]["ok"] is False             # 1.25 / 1.05
    weights = checks[("8b", "adapted weights of sits nf4 / int4 <= 0.35x bf16")]
    assert weights["ok"] is False and "sits+int4+liger 0.360x" in weights["detail"]
    # a run without the 4-bit arms (bitsandbytes missing, or --arms) reports them as not measured
    bare = _by_what(regress.compare(_rows("8b", frozen=1.0, sits=1.1), None, [], regress.TARGETS), "target")
    assert bare[("8b", "best sits nf4 >= 1.8x peft+nf4 (PEFT QLoRA)")]["ok"] is None


def test_the_full_8b_shape_checks_whole_model_weights():
    rows = _rows("8b-full", frozen_liger=1.0, sits_liger=1.05, sits_nf4_liger=1.1, sits_int4_liger=1.12)
    for row, gib in zip(rows, (15.0, 15.1, 5.2, 5.6)):
        row["weights_gib"] = gib
    checks = _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")
    nf4 = checks[("8b-full", "whole-model weights, fastest sits nf4 <= 0.35x fastest sits bf16")]
    assert nf4["ok"] is True and "sits+nf4+liger 5.20 GiB, 0.344x sits+liger's 15.10" in nf4["detail"]
    assert checks[("8b-full", "whole-model weights, fastest sits int4 <= 0.35x fastest sits bf16")]["ok"] is False


def test_a_baseline_split_over_two_calls_keeps_the_other_shape(tmp_path):
    path = tmp_path / "baseline.json"
    regress.write_baseline(str(path), _rows("1b", frozen=1.0, sits=1.2), None, "first call")
    first = json.loads(path.read_text())
    regress.write_baseline(str(path), _rows("8b", frozen=2.0, sits=2.1), first, "second call")
    both = json.loads(path.read_text())
    assert sorted({(r["shape"], r["arm"]) for r in both["rows"]}) == [("1b", "frozen"), ("1b", "sits"),
                                                                      ("8b", "frozen"), ("8b", "sits")]
    assert [r["command"] for r in both["runs"]] == ["first call", "second call"]
    regress.write_baseline(str(path), _rows("1b", frozen=1.0, sits=1.3), both, "third call")
    again = json.loads(path.read_text())
    assert [r["command"] for r in again["runs"]] == ["second call", "third call"]
    assert next(r for r in again["rows"] if r["shape"] == "1b" and r["arm"] == "sits")["vs_floor"] == pytest.approx(1.3)


@pytest.mark.slow
def test_smoke_run_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The whole gate on a CPU at a tiny size: arms in their own processes, each twice, graph breaks counted, files
    written. Eager arms: the gated compile configurations are compiled once, by the graph-break count. The script's
    main runs here (this module imported it): the arms and the graph-break count start their own processes as
    ever, without TRITON_INTERPRET (the PyTorch path); a process of its own for main would import all again."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code = regress.main(["--smoke", "--out", str(tmp_path), "--arms", "frozen", "sits", "--repeats", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.out[-2000:] + captured.err[-2000:]
    result = json.loads((tmp_path / "regress.json").read_text())
    assert [r["arm"] for r in result["rows"]] == ["frozen", "sits"]
    assert all(r["tokens_per_s"] > 0 and r["vs_floor"] > 0 for r in result["rows"])
    assert all(len(r["repeats_step_s"]) == 2 and r["failures"] == 0 for r in result["rows"])
    assert "repeat 2 of 2" in captured.out and "host_share" in captured.out
    assert result["rows"][0]["vs_floor"] == 1.0  # frozen is this run's only floor arm
    assert {c["config"]: c["graph_breaks"] for c in result["graph_breaks"]} == \
        {c: 0 for c in regress.GATED_COMPILE_CONFIGS}
    assert (tmp_path / "regress.csv").exists() and (tmp_path / "regress.png").stat().st_size > 1000
    assert "0 failed check(s)" in captured.out


def test_refuses_a_gpu_run_without_a_gpu_and_unknown_shapes(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal of a machine without a GPU")
    with pytest.raises(SystemExit) as stop:
        regress.main(["--out", "unused"])
    assert stop.value.code == 2 and "no CUDA GPU here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        regress.main(["--smoke", "--shapes", "70b"])
    assert stop.value.code == 2 and "--shapes ['70b'] unknown" in capsys.readouterr().err


def test_a_run_of_a_few_arms_updates_only_those(tmp_path):
    path = tmp_path / "baseline.json"
    regress.write_baseline(str(path), _rows("1b", frozen=1.0, sits=1.2, sits_compile=1.1), None, "full")
    full = json.loads(path.read_text())
    regress.write_baseline(str(path), _rows("1b", frozen=1.0, sits=1.1), full, "eager arms only")
    now = json.loads(path.read_text())
    by_arm = {r["arm"]: r["vs_floor"] for r in now["rows"]}
    assert by_arm["sits"] == pytest.approx(1.1) and by_arm["sits+compile"] == pytest.approx(1.1)
    assert [r["command"] for r in now["runs"]] == ["full", "eager arms only"]  # the compiled row is still full's


def test_graphed_arms_are_compared_with_the_graphed_frozen_arm_not_the_floor():
    rows = _rows("1b", frozen=1.2, frozen_liger=0.9, frozen_liger_graph=0.8, sits_liger=1.2, sits_liger_graph=0.86)
    assert rows[0]["vs_floor"] == pytest.approx(1.2 / 0.9)   # the floor: eager / compiled frozen arms only
    checks = _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")
    graphed = checks[("1b", "best graphed sits <= 1.10x frozen+liger+graph")]
    assert graphed["ok"] is True and "sits+liger+graph 1.075x frozen+liger+graph" in graphed["detail"]
    assert checks[("1b", "best sits bf16 <= 1.10x floor")]["ok"] is False   # sits+liger 1.2 / 0.9: not a graph arm
    rows = _rows("8b", frozen_liger=0.9, frozen_liger_graph=0.8, sits_liger_graph=0.86)
    checks = _by_what(regress.compare(rows, None, [], regress.TARGETS), "target")
    assert checks[("8b", "best graphed sits <= 1.05x frozen+liger+graph")]["ok"] is False   # 1.075 > 1.05


def test_a_graph_arm_without_a_gpu_fails_with_the_reason():
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal on a machine without a GPU")
    row = bench_module("bench_model").run_arm("tiny", "sits+graph", smoke=True, timeout_s=120)
    assert "needs a CUDA GPU" in row["error"], row


def _run(arm, step_s, host_s=None, peak_gib=None, model="1b"):
    """One run of an arm as bench_model.run_arm returns it (bs 4 x 2048)."""
    return {"model": model, "arm": arm, "layers": 2, "batch": 4, "seq": 2048, "step_s": step_s, "host_s": host_s,
            "peak_gib": peak_gib, "warmup_s": 10 * step_s, "wall_s": 30.0, "loss": 12.0}


def test_a_row_is_the_median_of_its_repeats_never_the_best():
    row = regress.median_row("1b", [_run("sits", 1.30, 0.5, 9.0), _run("sits", 1.00, 0.4, 9.2),
                                    _run("sits", 1.10, 0.6, 9.1)])
    assert (row["step_s"], row["host_s"], row["peak_gib"]) == (1.10, 0.5, 9.1)   # each its own median
    assert row["repeats_step_s"] == [1.30, 1.00, 1.10] and row["repeats_host_s"] == [0.5, 0.4, 0.6]
    assert row["repeats_peak_gib"] == [9.0, 9.2, 9.1]
    assert row["tokens_per_s"] == pytest.approx(4 * 2048 / 1.10)
    assert row["host_share"] == pytest.approx(0.5 / 1.10)                         # median host / median step
    assert row["shape"] == "1b" and row["failures"] == 0 and row["repeats"] == 3 and "error" not in row
    # an even count: the mean of the middle two; a CPU run has no host time, no peak
    two = regress.median_row("tiny", [_run("sits", 1.0), _run("sits", 2.0)])
    assert two["step_s"] == 1.5 and two["host_s"] is None and two["peak_gib"] is None and two["host_share"] is None


def test_a_failed_repeat_is_counted_and_only_all_failed_fail_the_row():
    oom = {"model": "1b", "arm": "sits+liger", "error": "CUDA out of memory"}
    row = regress.median_row("1b", [_run("sits+liger", 1.2), oom, _run("sits+liger", 1.0)])
    assert "error" not in row and row["step_s"] == pytest.approx(1.1) and row["repeats_step_s"] == [1.2, 1.0]
    assert row["failures"] == 1 and row["repeat_errors"] == ["CUDA out of memory"]
    baseline = {"rows": [dict(row, vs_floor=1.2)]}
    check = _by_what(regress.compare([dict(row, vs_floor=1.2)], baseline, [], {}), "regression")[("1b", "sits+liger")]
    assert check["ok"] is True and check["detail"].endswith("; 1 of 3 runs failed (CUDA out of memory)")
    row = regress.median_row("1b", [oom, dict(oom, error="timed out after 240 s")])
    assert row["error"] == "timed out after 240 s" and row["failures"] == 2 and "step_s" not in row
    # a row failed in every run fails its regression check, like a single failed run did
    check = _by_what(regress.compare([row], None, [], {}), "regression")[("1b", "sits+liger")]
    assert check["ok"] is False and check["detail"] == "timed out after 240 s"


def test_floor_ratios_are_those_of_the_medians():
    runs = {"frozen": [_run("frozen", 1.0), _run("frozen", 0.5), _run("frozen", 1.2)],   # the best would be 0.5
            "sits": [_run("sits", 1.1), _run("sits", 1.2), _run("sits", 1.15)],
            "peft": []}                                                                     # not run yet
    rows = regress.reduce_repeats("1b", runs)
    assert [r["arm"] for r in rows] == ["frozen", "sits"]
    assert rows[0]["vs_floor"] == 1.0 and rows[1]["vs_floor"] == pytest.approx(1.15)


def test_repeats_run_interleaved_each_in_its_own_call(monkeypatch):
    assert regress.interleaved(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    calls, progress = [], []
    steps = {"frozen": iter([1.0, 1.2, 1.1]), "sits": iter([1.3, 1.1, 1.2])}

    def fake_run_arm(model, arm, *, layers, **options):
        calls.append((model, arm, layers, options["steps"]))
        return _run(arm, next(steps[arm]), model=model)

    monkeypatch.setattr(regress, "run_arm", fake_run_arm)
    rows = regress.measure_shape("0.5b", regress.SHAPES["0.5b"], ["frozen", "sits"], 3,
                                 lambda rows: progress.append([r["arm"] for r in rows]), steps=6)
    assert calls == [("0.5b", arm, 24, 6) for arm in ("frozen", "sits")] * 3
    assert progress[:2] == [["frozen"], ["frozen", "sits"]] and len(progress) == 6   # on disk after every run
    assert [(r["arm"], r["step_s"], r["vs_floor"]) for r in rows] == [("frozen", 1.1, 1.0),
                                                                      ("sits", 1.2, pytest.approx(1.2 / 1.1))]


def test_the_repeats_option_reaches_every_arm(monkeypatch, tmp_path):
    """main() with --repeats 2 (no subprocess: run_arm is replaced): the interleaved order, the medians on disk and
    host_share in the printed table."""
    calls = []

    def fake_run_arm(model, arm, **options):
        calls.append(arm)
        return _run(arm, {"frozen": 1.0, "sits": 1.2}[arm] * (1 + 0.1 * calls.count(arm)), host_s=0.3, model=model)

    monkeypatch.setattr(regress, "run_arm", fake_run_arm)
    assert regress.main(["--smoke", "--no-graph-breaks", "--out", str(tmp_path), "--repeats", "2",
                         "--arms", "frozen", "sits"]) == 0
    assert calls == ["frozen", "sits", "frozen", "sits"]
    rows = json.loads((tmp_path / "regress.json").read_text())["rows"]
    assert [(r["arm"], r["repeats_step_s"]) for r in rows] == [("frozen", [1.1, 1.2]), ("sits", [1.32, 1.44])]
    assert rows[1]["step_s"] == pytest.approx(1.38) and rows[1]["host_share"] == pytest.approx(0.3 / 1.38)


def test_host_share_is_given_next_to_every_ratio():
    baseline = {"rows": _rows("1b", frozen=1.0, sits=1.2)}
    now = _rows("1b", frozen=1.0, sits=1.2, peft_compile=2.5)
    now[1]["host_s"] = 0.3
    regression = _by_what(regress.compare(now, baseline, [], {}), "regression")[("1b", "sits")]
    assert regression["detail"] == "1.200x floor, baseline 1.200x (limit 1.260); host share 0.25"
    targets = _by_what(regress.compare(now, None, [], regress.TARGETS), "target")
    assert targets[("1b", "best sits bf16 <= 1.10x floor")]["detail"].endswith("(<= 1.1); host share 0.25")
    assert targets[("1b", "best sits bf16 >= 1.6x peft+compile")]["detail"].endswith("; host share 0.25")


def _default_rows(shape, default_s, **peaks):
    rows = _rows(shape, frozen=1.0, frozen_liger=0.9, peft_compile=2.0, sits_liger=1.0, sits_default=default_s)
    for row in rows:
        row["peak_gib"] = peaks.get(row["arm"].replace("+", "_"))
    return rows


@pytest.mark.parametrize("shape, default_s, ok", [
    ("1b", 0.99, True), ("1b", 1.0, False),          # 1.10 x the floor (frozen+liger, 0.9): 0.99
    ("0.5b", 1.035, True), ("0.5b", 1.04, False),    # 1.15 x 0.9 = 1.035
    ("8b", 0.936, True), ("8b", 0.94, False),        # 1.04 x 0.9 = 0.936
])
def test_the_default_step_is_bound_by_the_floor_per_shape(shape, default_s, ok):
    bound = {"1b": "1.10", "0.5b": "1.15", "8b": "1.04"}[shape]
    checks = _by_what(regress.compare(_default_rows(shape, default_s), None, [], regress.TARGETS), "target")
    check = checks[(shape, f"default step <= {bound}x floor")]
    assert check["ok"] is ok and check["detail"].startswith("sits+default ")


def test_the_default_step_against_peft_compile_and_the_memory_of_sits_liger():
    checks = _by_what(regress.compare(_default_rows("1b", 1.1, sits_liger=10.0, sits_default=10.9), None, [],
                                      regress.TARGETS), "target")
    speed = checks[("1b", "default step >= 1.8x as fast as peft+compile")]
    assert speed["ok"] is True and "sits+default 1.82x as fast as peft+compile" in speed["detail"]    # 2.0 / 1.1
    memory = checks[("1b", "default step peak <= sits+liger peak + 1 GiB")]
    assert memory["ok"] is True and "sits+default peak 10.90 GiB, sits+liger 10.00 GiB (+0.90" in memory["detail"]
    checks = _by_what(regress.compare(_default_rows("8b", 1.2, sits_liger=10.0, sits_default=11.2), None, [],
                                      regress.TARGETS), "target")
    assert checks[("8b", "default step peak <= sits+liger peak + 1 GiB")]["ok"] is False
    assert ("8b", "default step >= 1.8x as fast as peft+compile") not in checks   # the 1B shape's target only
    checks = _by_what(regress.compare(_default_rows("0.5b", 1.2), None, [], regress.TARGETS), "target")
    assert checks[("0.5b", "default step peak <= sits+liger peak + 1 GiB")]["ok"] is None   # no peaks: a CPU
    # a run without the arm (a package without default_train_step yet) reports its targets as not measured
    bare = _by_what(regress.compare(_rows("1b", frozen=1.0, sits=1.1), None, [], regress.TARGETS), "target")
    assert bare[("1b", "default step <= 1.10x floor")]["ok"] is None
    assert "sits+default" in regress.ARMS and "sits+default" not in regress.SMOKE_ARMS
    assert "sits+nf4+default" in regress.NF4_SITS   # the NF4 targets (against PEFT's and Unsloth's QLoRA) count it


@pytest.mark.parametrize("arm", ["sits+default", "sits+nf4+default"])
def test_the_default_arm_refuses_with_its_reason_before_building(arm):
    """Without sits_lora.training.default_train_step the arm says so; with it, on a CPU, that it needs CUDA (over a
    bf16 or an NF4 base). In this process: the refusal comes before the model is built."""
    import argparse

    import torch

    import sits_lora.training

    if torch.cuda.is_available():
        pytest.skip("the refusals on a machine without a GPU")
    args = argparse.Namespace(arm=arm, model="tiny", layers=0, batch=2, seq=32, smoke=True)
    with pytest.raises(SystemExit) as refused:
        bench_module("bench_model").worker(args)
    reason = ("needs a CUDA GPU" if hasattr(sits_lora.training, "default_train_step")
              else "sits_lora.training has no default_train_step")
    assert reason in str(refused.value)


def test_the_half_billion_shape_has_qwen2_5_0_5b_widths():
    import torch
    from transformers import LlamaForCausalLM

    config = bench_module("bench_model").llama_config("0.5b")
    assert config.head_dim == 64 and config.num_hidden_layers == 24 and config.vocab_size == 151936
    assert (config.num_key_value_heads, config.intermediate_size, config.tie_word_embeddings) == (2, 4864, True)
    assert config.rope_parameters["rope_theta"] == 1e6 and not config.attention_bias
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    attention = model.model.layers[0].self_attn
    assert (attention.q_proj.out_features, attention.k_proj.out_features) == (896, 128)   # 14 x 64, 2 x 64
    # Qwen2.5-0.5B's 494M parameters less its q / k / v biases (24 x (896 + 128 + 128)); the head tied
    assert sum(p.numel() for p in model.parameters()) == 494_032_768 - 24 * (896 + 128 + 128)
    assert regress.SHAPES["0.5b"] == {"model": "0.5b", "layers": 24} and "0.5b" not in regress.DEFAULT_SHAPES
