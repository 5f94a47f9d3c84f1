"""SITS_LORA_TEST_ORDER (tests/conftest.py): the collected tests in reverse or shuffled order, and a bad value
refused with the values it takes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import conftest
from conftest import REPO_ROOT


class _Item:
    keywords: dict = {}

    def __init__(self, name: str):
        self.name = name


def _ordered(monkeypatch, order: str) -> list:
    monkeypatch.setenv("SITS_LORA_TEST_ORDER", order)
    items = [_Item(f"test_{i}") for i in range(12)]
    conftest.pytest_collection_modifyitems(None, items)
    return [item.name for item in items]


def test_the_order_is_reversed_or_shuffled_by_its_seed_and_a_bad_order_is_refused(monkeypatch):
    plain = _ordered(monkeypatch, "")
    assert plain == [f"test_{i}" for i in range(12)]
    assert _ordered(monkeypatch, "reverse") == plain[::-1]
    shuffled = _ordered(monkeypatch, "shuffle:1")
    assert sorted(shuffled) == sorted(plain) and shuffled != plain and shuffled == _ordered(monkeypatch, "shuffle:1")
    assert _ordered(monkeypatch, "shuffle:2") != shuffled
    with pytest.raises(pytest.UsageError, match="use 'reverse' or 'shuffle:SEED'"):
        _ordered(monkeypatch, "sideways")


def test_a_test_marked_starts_first_leads_the_default_order(monkeypatch):
    monkeypatch.setenv("SITS_LORA_TEST_ORDER", "")
    items = [_Item(f"test_{i}") for i in range(5)]
    items[3].keywords = {"starts_first": True}
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.name for item in items] == ["test_3", "test_0", "test_1", "test_2", "test_4"]


def test_pytest_collects_in_the_order_asked():
    """The hook is the one pytest calls: a collection in its own process comes out reversed."""
    def collect(order):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               os.path.join("tests", "utils", "test_timing.py")], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "SITS_LORA_TEST_ORDER": order})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [line for line in proc.stdout.splitlines() if "::" in line]

    plain = collect("")
    assert len(plain) > 2 and collect("reverse") == plain[::-1]
