"""bench/harness.py's one result schema: every script's rows in OUT/results.jsonl with script, suite, machine,
versions, revision and host share; a script's rewrites leave its latest rows once; bench/report.py reads the log."""

from __future__ import annotations

import json

import pytest

from conftest import bench_module

harness = bench_module("harness")
report = bench_module("report")


def _write_as(script: str, name: str, rows: list, out) -> None:
    """write_results called from a file named like a bench script (the log names the calling script)."""
    code = compile("harness.write_results(name, rows, out)", f"/somewhere/bench/{script}.py", "exec")
    exec(code, {"harness": harness, "name": name, "rows": rows, "out": str(out)})


def _rows(frozen_s=1.0, sits_s=1.2, host=None):
    return [{"model": "tiny", "arm": "frozen", "step_s": frozen_s, "tokens_per_s": 64 / frozen_s, "peak_gib": None,
             "host_s": host},
            {"model": "tiny", "arm": "sits", "step_s": sits_s, "tokens_per_s": 64 / sits_s, "peak_gib": None,
             "host_s": host}]


def test_rows_go_to_one_log_with_the_stamp_and_a_rewrite_leaves_the_latest_rows_once(tmp_path):
    _write_as("bench_model", "model_tiny", _rows()[:1], tmp_path)          # progress: the first arm
    _write_as("bench_model", "model_tiny", _rows(host=0.6), tmp_path)      # the finished result
    _write_as("serve", "serve", [{"arm": "merged", "ms_per_token": 3.0}], tmp_path)
    lines = harness.read_log(str(tmp_path / "results.jsonl"))
    assert [(line["script"], line["suite"], line["row"]["arm"]) for line in lines] == [
        ("bench_model", "step", "frozen"), ("bench_model", "step", "sits"), ("serve", "serving", "merged")]
    first = lines[0]
    assert first["schema"] == harness.RESULTS_SCHEMA and first["result"] == "model_tiny"
    assert set(first["machine"]) == {"gpu", "cpu", "cpu_cores"} and first["versions"]["torch"]
    assert first["revision"] and first["date"]
    assert first["host_share"] == pytest.approx(0.6) and lines[1]["host_share"] == pytest.approx(0.5)
    assert lines[2]["host_share"] is None
    assert (tmp_path / "model_tiny.json").exists() and (tmp_path / "serve.csv").exists()


def test_lines_of_other_runs_stay_and_another_schema_is_refused(tmp_path):
    log = tmp_path / "results.jsonl"
    other = {"schema": harness.RESULTS_SCHEMA, "run": "elsewhere", "script": "bench_model", "suite": "step",
             "result": "model_tiny", "date": "2026-12-01", "revision": "abc1234",
             "machine": {"gpu": "NVIDIA H100 80GB HBM3", "cpu": "x", "cpu_cores": 16}, "versions": {},
             "host_share": 0.1, "row": _rows(0.5, 0.55)[1]}
    log.write_text(json.dumps(other) + "\n")
    _write_as("bench_model", "model_tiny", _rows(), tmp_path)
    lines = harness.read_log(str(log))
    assert [line["run"] for line in lines][0] == "elsewhere" and len(lines) == 3
    log.write_text(json.dumps({**other, "schema": 99}) + "\n")
    with pytest.raises(ValueError, match="schema 99"):
        harness.read_log(str(log))


def test_the_report_reads_the_log_per_machine_and_revision(tmp_path, capsys):
    _write_as("bench_model", "model_tiny", _rows(1.0, 1.25, host=0.5), tmp_path)
    log = str(tmp_path / "results.jsonl")
    assert report.main([log, "--png", str(tmp_path / "steps.png")]) == 0
    out = capsys.readouterr().out
    assert "| tiny | sits | 51 | 1.250× | 0.40 |" in out and "| host share |" in out
    assert (tmp_path / "steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _write_as("serve", "serve", [{"arm": "merged", "ms_per_token": 3.0}], tmp_path / "other")
    assert report.main([str(tmp_path / "other" / "results.jsonl")]) == 1   # no step rows: said, not an empty table
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "missing.jsonl")])
