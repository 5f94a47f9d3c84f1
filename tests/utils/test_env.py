"""The environment recorded with every result: the git revision is this checkout's."""

from __future__ import annotations

import os
import subprocess

import pytest

from sits_lora.utils.env import git_revision

from conftest import REPO_ROOT


def test_git_revision_is_this_checkouts_head(monkeypatch):
    monkeypatch.delenv("SITS_LORA_GIT_REVISION", raising=False)
    if not os.path.isdir(os.path.join(REPO_ROOT, ".git")):
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True).stdout.strip()
    if not head:
        pytest.skip("git cannot read this checkout")
    assert git_revision().removesuffix("-dirty") == head


def test_a_named_revision_wins(monkeypatch):
    monkeypatch.setenv("SITS_LORA_GIT_REVISION", "abc1234-gpu")
    assert git_revision() == "abc1234-gpu"
