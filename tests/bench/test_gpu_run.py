"""bench/gpu_run.py, the one runner of a device call: its table names real scripts and test files, a bad run, part or
missing model is refused before OUT is made, a dry run fills the placeholders, and a part that outlives its time
limit is stopped (its whole process group) while the parts after it still run."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT, bench_module

gpu_run = bench_module("gpu_run")


def test_every_part_names_a_script_or_tests_that_exist():
    for name, run in gpu_run.RUNS.items():
        assert run.doc and run.parts, name
        for part_name, part in run.parts.items():
            words = " ".join(part.command).split()
            scripts = [w for w in words if w.startswith("bench/") and w.endswith(".py")]
            paths = [w for w in words if w.startswith("tests")]
            assert scripts or paths, (name, part_name)
            for path in scripts + paths:
                assert os.path.exists(os.path.join(REPO_ROOT, path)), (name, part_name, path)


def _bench(*args, cwd=REPO_ROOT):
    return subprocess.run([sys.executable, "-m", "bench", "run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


def test_bad_arguments_are_refused_before_out_is_made(tmp_path):
    out = tmp_path / "out"
    proc = _bench("gate", str(out), "warmup")
    assert proc.returncode == 2 and "run 'gate' has no part 'warmup'; its parts: fp8-crossover, tests" in proc.stderr
    proc = _bench("dynamic-rank", str(out), "routed")
    assert proc.returncode == 2 and "part 'routed' trains a model: give it with --model PATH" in proc.stderr
    proc = _bench("nightly", str(out))
    assert proc.returncode == 2 and "invalid choice: 'nightly'" in proc.stderr
    assert not out.exists()


def test_dry_run_fills_out_args_and_model(tmp_path):
    proc = _bench("gate", str(tmp_path), "--dry-run", "--", "--shapes", "1b", "--repeats", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["tests", "host", "gate"]  # the marked parts, in order
    assert lines[-1] == (f"gate (590 s): {sys.executable} bench/regress.py --out {tmp_path}/regress --shapes 1b "
                         "--repeats 3")
    proc = _bench("int4", str(tmp_path), "full", "--dry-run")  # no ARGS: the part's default arms
    assert proc.stdout.strip().endswith("--arms sits+liger peft+nf4 sits+nf4+liger sits+nf4+bnbdq+liger "
                                        "sits+int4+liger")
    proc = _bench("dynamic-rank", str(tmp_path), "static", "--model", "m.gguf", "--dry-run")
    assert "--model m.gguf" in proc.stdout and f"--out {tmp_path}/static" in proc.stdout
    assert not any(tmp_path.iterdir())
    listing = _bench().stdout
    assert all(f"{name}: " in listing for name in gpu_run.RUNS)


def test_a_part_past_its_limit_is_stopped_and_the_next_still_runs(tmp_path, monkeypatch):
    slow = gpu_run.Part(["bash", "-c", "echo started; sleep 30 & wait"], timeout=1)
    quick = gpu_run.Part([sys.executable, "-c", "print('second ran')"], timeout=30)
    monkeypatch.setitem(gpu_run.RUNS, "probe", gpu_run.Run("a test run", {"slow": slow, "quick": quick}))
    monkeypatch.setattr(gpu_run, "environment", lambda: dict(os.environ))
    assert gpu_run.main(["probe", str(tmp_path / "out")]) == 124
    slow_log = (tmp_path / "out" / "slow.log").read_text()
    assert slow_log.startswith("started") and "[stopped after 1 s]" in slow_log
    assert (tmp_path / "out" / "quick.log").read_text() == "second ran\n"
    crash = gpu_run.Part([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], timeout=30)
    crashing = gpu_run.Run("a part killed by a signal", {"crash": crash, "quick": quick})
    monkeypatch.setitem(gpu_run.RUNS, "crash", crashing)
    assert gpu_run.main(["crash", str(tmp_path / "crashed")]) == 128 + 9   # not the quick part's 0
    assert gpu_run.main(["probe", str(tmp_path / "packed"), "quick", "--pack"]) == 0
    assert (tmp_path / "packed.tgz").exists() and not (tmp_path / "packed").exists()
