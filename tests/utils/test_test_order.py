"""SITS_LORA_TEST_ORDER (tests/conftest.py): the collected tests in reverse or shuffled order, and a bad value
refused with the values it takes."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT


def _collect(order: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           os.path.join("tests", "utils", "test_timing.py")], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "SITS_LORA_TEST_ORDER": order})


def _ids(proc) -> list:
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_tests_run_reversed_or_shuffled_and_a_bad_order_is_refused():
    plain = _collect("")
    assert plain.returncode == 0 and len(_ids(plain)) > 2, plain.stdout + plain.stderr
    assert _ids(_collect("reverse")) == _ids(plain)[::-1]
    shuffled = _ids(_collect("shuffle:1"))
    assert sorted(shuffled) == sorted(_ids(plain)) and shuffled == _ids(_collect("shuffle:1"))
    bad = _collect("sideways")
    assert bad.returncode != 0 and "use 'reverse' or 'shuffle:SEED'" in bad.stdout + bad.stderr
