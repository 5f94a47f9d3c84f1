"""bench/longest_context.py: the bisection, and the planned search on the tiny shape (a CPU)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import bench_module


def test_bisect_finds_the_last_length_that_fits():
    longest_context = bench_module("longest_context")
    calls = []

    def fits(seq):
        calls.append(seq)
        return seq <= 5000

    assert longest_context.bisect(fits, 1024, 64 * 1024, 1024) == 4096
    assert len(calls) <= 8  # logarithmic, not a scan
    assert longest_context.bisect(lambda seq: False, 1024, 8192, 1024) == 0


def test_plan_search_writes_rows_and_orders_the_arms(tmp_path):
    pytest.importorskip("liger_kernel")
    longest_context = bench_module("longest_context")
    assert longest_context.main(["--plan", "--smoke", "--out", str(tmp_path)]) == 0
    rows = {r["arm"]: r for r in json.load(open(os.path.join(tmp_path, "longest_context.json")))["rows"]}
    assert set(rows) == set(longest_context.ARMS)
    planned = {arm: row["planned_tokens"] for arm, row in rows.items()}
    assert all(v > 0 and v % 64 == 0 for v in planned.values())
    # what each setting saves: rebuilt inputs over saved ones, checkpointing over none, sits over PEFT
    assert planned["sits+liger"] > planned["sits+liger+saved"]
    assert planned["sits+liger+gc"] > planned["sits+liger"]
    assert planned["sits+liger"] > planned["peft"]
    assert all(row["planned_gib_at_it"] <= 0.01 for row in rows.values())
    assert os.path.exists(os.path.join(tmp_path, "longest_context.png"))


def test_bad_settings_are_named(capsys):
    longest_context = bench_module("longest_context")
    with pytest.raises(SystemExit):
        longest_context.main(["--plan", "--arms", "qlora"])
    assert "--arms qlora: unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        longest_context.main(["--arms", "peft"])
    assert "give --plan" in capsys.readouterr().err
