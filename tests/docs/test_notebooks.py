"""Every notebook runs top to bottom on the CPU."""

from __future__ import annotations

import glob
import os

import pytest

from conftest import REPO_ROOT

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    # notebook tooling is a test extra: without it (the GPU image) these tests skip, the rest of the module runs
    nbformat = pytest.importorskip("nbformat")
    NotebookClient = pytest.importorskip("nbclient").NotebookClient
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Traceback" not in outputs


def test_there_is_a_quickstart():
    assert any(p.endswith("quickstart.ipynb") for p in NOTEBOOKS)
