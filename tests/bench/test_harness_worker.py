"""bench/harness.py's run_worker: the one way the scripts run a worker process and read its RESULT line."""

from __future__ import annotations

import sys

from conftest import bench_module


def test_a_worker_s_last_result_line_or_its_failure_with_the_identity(capsys):
    harness = bench_module("harness")
    printed = [sys.executable, "-c", "print('  probe 1'); print('RESULT {\"a\": 1}'); print('RESULT {\"a\": 2}')"]
    assert harness.run_worker(printed, 60, {"arm": "x"}, echo=lambda line: line.startswith("  ")) == {"a": 2}
    assert capsys.readouterr().out == "  probe 1\n"
    failed = [sys.executable, "-c", "import sys; print('RESULT {}'); sys.exit('the reason, last')"]
    assert harness.run_worker(failed, 60, {"arm": "x", "seed": 0}) == \
        {"arm": "x", "seed": 0, "error": "the reason, last"}
    silent = [sys.executable, "-c", "pass"]
    assert harness.run_worker(silent, 60, {"arm": "x"}) == {"arm": "x", "error": "no output"}
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]
    assert harness.run_worker(slow, 0.5, {"arm": "x"}) == {"arm": "x", "error": "timed out after 0 s"}
