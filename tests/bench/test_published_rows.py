"""The published figures: one file of rows in one schema (docs/measurements.jsonl) that the README and the docs cite,
every row listed in docs/results.md, every command in the docs a ``python -m bench`` one, and no link into the raw
results folders, which are out of the tree."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from conftest import REPO_ROOT, bench_module

ROWS_FILE = os.path.join(REPO_ROOT, "docs", "measurements.jsonl")
FIELDS = ["id", "figure", "date", "command", "revision", "gpu", "host", "values", "source"]
PAGES = sorted([os.path.join(REPO_ROOT, "README.md"), *glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")),
                *glob.glob(os.path.join(REPO_ROOT, "docs", "design", "*.md"))])


def _rows():
    with open(ROWS_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_every_row_has_the_one_schema():
    rows = _rows()
    ids = [row["id"] for row in rows]
    assert len(ids) == len(set(ids)), "an id used twice"
    for row in rows:
        assert list(row) == FIELDS, row["id"]
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", row["id"])
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", row["date"]), row["id"]
        assert row["source"].startswith("bench/results/"), row["id"]
        assert all(isinstance(row[key], str) and row[key] for key in ("figure", "command", "revision", "gpu", "host"))
        assert isinstance(row["values"], dict) and row["values"], f"{row['id']}: no figures"
        for command in re.findall(r"\bpython3? (?:-m \S+|\S+)", row["command"]):
            assert command.startswith(("python -m bench", "python tests/", "python recipes/")), (row["id"], command)


def test_results_page_lists_every_row_and_no_other():
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", _text(os.path.join(REPO_ROOT, "docs", "results.md")), flags=re.M)
    assert sorted(listed) == sorted(row["id"] for row in _rows())


def test_every_cited_row_exists():
    ids = {row["id"] for row in _rows()}
    for page in PAGES:
        text = _text(page)
        cited = set(re.findall(r"\brow `([a-z0-9][a-z0-9-]*)`", text))
        if os.path.basename(page) == "README.md" and os.path.dirname(page) == REPO_ROOT:
            # the measured table's last column: one or more row ids
            cited |= {i for line in text.splitlines() if line.startswith("| ") and line.endswith("` |")
                      for i in re.findall(r"`([a-z0-9-]+)`", line.rsplit(" | ", 1)[-1])}
        assert cited <= ids, (os.path.relpath(page, REPO_ROOT), sorted(cited - ids))


def test_no_page_links_into_the_raw_results_and_every_command_is_python_m_bench():
    for page in PAGES:
        text = _text(page)
        name = os.path.relpath(page, REPO_ROOT)
        assert not re.search(r"\]\([^)]*bench/results", text), f"{name}: a link into bench/results (out of the tree)"
        assert not re.search(r"\b(python3?|bash) bench/", text), f"{name}: a command outside python -m bench"


def test_the_raw_folders_are_ignored_and_each_row_names_an_archived_one():
    assert "/bench/results/" in _text(os.path.join(REPO_ROOT, ".gitignore")).split()
    archive = bench_module("archive")
    try:
        archive.check_clone()
    except archive.ArchiveError as refusal:
        pytest.skip(str(refusal))
    names = set(archive.archived_names())
    for row in _rows():
        assert row["source"].removeprefix("bench/results/") in names, row["id"]
