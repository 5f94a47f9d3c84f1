"""``python -m bench``: one entry for the scripts in bench/, found by what they measure."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from conftest import REPO_ROOT

sys.path.insert(0, REPO_ROOT)
from bench.__main__ import LIBRARIES, SUITES  # noqa: E402


def _bench(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=timeout)


def test_every_script_is_in_exactly_one_suite():
    scripts = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO_ROOT, "bench", "*.py"))
                     if not os.path.basename(p).startswith("__"))
    listed = [s for suite in SUITES.values() for s in suite]
    assert len(listed) == len(set(listed)), "a script in two suites"
    assert sorted(listed + list(LIBRARIES)) == scripts


def test_the_listing_names_every_suite_and_script_with_its_summary():
    proc = _bench()
    assert proc.returncode == 0, proc.stderr
    for suite, scripts in SUITES.items():
        assert f"\n{suite}\n" in proc.stdout
        for script in scripts:
            assert f"  {script} " in proc.stdout
    assert "The GPU regression gate" in proc.stdout     # regress.py's docstring, first line


def test_a_suite_runs_its_first_script_or_the_one_named_and_a_bad_name_is_one_line():
    proc = _bench("gate", "--help")
    assert proc.returncode == 0 and "usage: regress.py" in proc.stdout, proc.stderr
    proc = _bench("memory", "memory_plan", "--help")
    assert proc.returncode == 0 and "usage: memory_plan.py" in proc.stdout, proc.stderr
    proc = _bench("speed")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "unknown suite 'speed'" in proc.stderr
    proc = _bench("gate", "bench_model")
    assert proc.returncode == 2 and "no script 'bench_model' in this suite; its scripts: regress" in proc.stderr
