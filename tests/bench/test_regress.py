"""bench/regress.py, the GPU regression gate: its checks on made-up rows, its baseline, and a CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, bench_module

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
              {"config": "dynamic rank, random router", "graph_breaks": 22}, {"config": "some other", "graph_breaks": 5}]
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
def test_smoke_run_on_the_cpu(tmp_path):
    """The whole gate on a CPU at a tiny size: arms in their own processes, graph breaks counted, files written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "regress.py"), "--smoke", "--out",
                           str(tmp_path), "--arms", "frozen", "sits", "sits+compile"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "regress.json").read_text())
    assert [r["arm"] for r in result["rows"]] == ["frozen", "sits", "sits+compile"]
    assert all(r["tokens_per_s"] > 0 and r["vs_floor"] > 0 for r in result["rows"])
    assert result["rows"][0]["vs_floor"] == 1.0  # frozen is this run's only floor arm (a compiled arm may beat it)
    assert {c["config"]: c["graph_breaks"] for c in result["graph_breaks"]} == {c: 0 for c in regress.GATED_COMPILE_CONFIGS}
    assert (tmp_path / "regress.csv").exists() and (tmp_path / "regress.png").stat().st_size > 1000
    assert "0 failed check(s)" in proc.stdout


def test_refuses_a_gpu_run_without_a_gpu_and_unknown_shapes():
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal of a machine without a GPU")
    script = os.path.join(REPO_ROOT, "bench", "regress.py")
    proc = subprocess.run([sys.executable, script, "--out", "unused"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA GPU here" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--smoke", "--shapes", "70b"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--shapes ['70b'] unknown" in proc.stderr


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
