"""The package's text says what the code does and why, not what a run measured or which issue asked for it: no GPU
model names, results folders, lab-notebook pointers, session numbers, run dates, timings, measured speed-ups or issue
numbers in src/ (comments, docstrings, help texts, labels and messages alike). Figures go stale in code and a reader
cannot tell a rule from a snapshot; they live in docs/ beside the command that made them."""

from __future__ import annotations

import os
import re

import pytest

import sits_lora

PACKAGE_DIR = os.path.dirname(os.path.abspath(sits_lora.__file__))

# (what, pattern): each names a kind of run record
RUN_RECORDS = [
    ("a GPU model (where a run was measured)", r"\b[HABL]\d00\b"),
    ("the lab notebook", r"NOTES\.md"),
    ("a results folder", r"bench/results|results/20\d\d"),
    ("a session number", r"\bsession ?\d"),
    ("a run's date", r"\b20\d\d-\d\d-\d\d\b"),
    ("a timing", r"\d(\.\d+)? ?(µs|us|ms)\b"),
    ("a measured speed-up or slow-down", r"\d(\.\d+)? ?[x×] (slower|faster)|measured [+-]?\d"),
    ("an issue number", r"\b[Ii]ssue ?#?\d"),
]


def _source_files():
    for folder, _, names in os.walk(PACKAGE_DIR):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _findings(text: str) -> list:
    return [(what, number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
            for what, pattern in RUN_RECORDS if re.search(pattern, line)]


def test_the_source_holds_no_run_records():
    found = [f"{os.path.relpath(path, PACKAGE_DIR)}:{number}: {what}: {line[:120]}"
             for path in _source_files() for what, number, line in _findings(open(path, encoding="utf-8").read())]
    assert not found, "run records in src/ (move the figure to docs/, keep the reason):\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "# the sort costs ~31 µs on the H200",
    "measured on the H200 (bench/results/2026-11-30-h200-session6/layer)",
    "see bench/NOTES.md",
    'help="ran 2.8x slower with twice the memory"',
    "(measured +14 % on the 1B shape)",
    "# Issue 6 asks for a Triton GEMM",
])
def test_each_kind_of_run_record_is_caught(line):
    assert _findings(line)


@pytest.mark.parametrize("line", [
    "# halves the bytes read: one pass over x instead of two",
    "print(f'{seconds * 1000:.1f} ms a step')",
    "timeout_ms: int = 30_000",
    "# one launch instead of six, and no sync",
])
def test_rules_and_units_in_code_are_not_run_records(line):
    assert not _findings(line)
