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


def test_refusals_name_the_flag(capsys):
    serve = bench_module("serve")
    with pytest.raises(SystemExit):
        serve.main(["--smoke", "--out", "x", "--new-tokens", "1"])
    assert "--new-tokens must be >= 2" in capsys.readouterr().err
