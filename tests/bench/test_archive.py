"""``python -m bench tools archive``: a raw results folder comes back from the archive revision byte for byte; a wrong
name is refused with the list of folders, and so is a copy of the repository that is not a git clone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, bench_module

archive = bench_module("archive")

SMALL_FOLDER = "2026-11-30-cpu-rank-budget-trace"   # a few files: a quick extraction


def _bench(*args, cwd=REPO_ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "bench", "tools", "archive", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


@pytest.fixture(scope="module")
def clone_with_archive():
    """Skip where the checkout cannot hold the archive (no .git, or a shallow clone without the revision)."""
    try:
        archive.check_clone()
    except archive.ArchiveError as refusal:
        pytest.skip(str(refusal))


def _at_archive(path: str) -> bytes:
    return subprocess.run(["git", "show", f"{archive.ARCHIVE_REV}:{path}"], cwd=REPO_ROOT, capture_output=True,
                          check=True).stdout


def test_a_folder_comes_back_as_it_was(clone_with_archive, tmp_path):
    out = tmp_path / "folder"
    proc = _bench(SMALL_FOLDER, str(out))
    assert proc.returncode == 0, proc.stderr
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", archive.ARCHIVE_REV,
                             f"bench/results/{SMALL_FOLDER}/"], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    written = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    assert written == sorted(p.removeprefix(f"bench/results/{SMALL_FOLDER}/") for p in listed)
    assert (out / "README.md").read_bytes() == _at_archive(f"bench/results/{SMALL_FOLDER}/README.md")
    again = _bench(SMALL_FOLDER, str(out))   # nothing is written over
    assert again.returncode == 2 and "exists" in again.stderr


def test_a_loose_file_comes_back_to_the_path_given(clone_with_archive, tmp_path):
    out = tmp_path / "faults.json"
    assert _bench("fault_matrix.json", str(out)).returncode == 0
    assert out.read_bytes() == _at_archive("bench/results/fault_matrix.json")


def test_a_wrong_name_is_refused_with_the_folders(clone_with_archive, tmp_path):
    proc = _bench("2026-13-01-no-such-run", str(tmp_path / "x"))
    assert proc.returncode == 2 and "no archived results folder '2026-13-01-no-such-run'" in proc.stderr
    assert f"\n  {SMALL_FOLDER}\n" in proc.stderr and not (tmp_path / "x").exists()
    listing = _bench()
    assert listing.returncode == 0 and SMALL_FOLDER in listing.stdout.split()


def test_outside_a_git_clone_it_says_so(tmp_path):
    copy = tmp_path / "sits_lora"
    shutil.copytree(os.path.join(REPO_ROOT, "bench"), copy / "bench",
                    ignore=shutil.ignore_patterns("results", "__pycache__", "baseline"))
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    proc = _bench(SMALL_FOLDER, cwd=copy, env=env)
    assert proc.returncode == 2 and "is not a git clone" in proc.stderr and archive.ARCHIVE_REV[:12] in proc.stderr


def test_the_archive_revision_is_named_once():
    """One constant: the docs name the revision, the code reads it from bench/archive.py."""
    if not os.path.isdir(os.path.join(REPO_ROOT, ".git")):
        pytest.skip("not a git checkout")
    hits = subprocess.run(["git", "grep", "--untracked", "-l", archive.ARCHIVE_REV, "--", "*.py"], cwd=REPO_ROOT,
                          capture_output=True, text=True).stdout.split()
    assert hits == ["bench/archive.py"]
