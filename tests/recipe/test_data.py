"""The offline corpus (sits_lora.recipe.data): the same text in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sits_lora.recipe.data import _signature, build_stdlib_corpus

from conftest import REPO_ROOT

_SENTINEL = object()


def _with_sentinel_default(x, default=_SENTINEL):
    return x


def test_signatures_carry_no_memory_address():
    """A default like object() printed with its address changed the corpus from one process to the next."""
    assert "0x" not in repr(_signature(_with_sentinel_default))
    assert _signature(_with_sentinel_default) == "(x, default=<object object>)"


@pytest.mark.slow  # two interpreters that import torch: ~14 s
def test_corpus_is_identical_in_two_processes(tmp_path):
    """Built by two interpreters (different addresses, different hash seeds): byte for byte the same file."""
    modules = ["configparser", "collections", "json"]  # configparser and collections have object() defaults
    paths = []
    for run in range(2):
        code = (f"from sits_lora.recipe.data import build_stdlib_corpus; "
                f"print(build_stdlib_corpus({str(tmp_path / str(run))!r}, {modules!r}))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": os.path.join(REPO_ROOT, "src"),
                                                 "PYTHONHASHSEED": str(run + 1)})
        paths.append(out.stdout.strip().splitlines()[-1])
    first, second = (open(p, "rb").read() for p in paths)
    assert first == second
    rows = [json.loads(line) for line in first.decode().splitlines()]
    assert [r["module"] for r in rows] == sorted(modules) and all(r["text"] for r in rows)


def test_corpus_cache_key_changes_with_the_format(tmp_path, monkeypatch):
    import sits_lora.recipe.data as data

    old = build_stdlib_corpus(tmp_path, ["json"])
    monkeypatch.setattr(data, "_CORPUS_FORMAT", "test")
    assert build_stdlib_corpus(tmp_path, ["json"]) != old
