"""The environment stamped on every result the command line writes: device, versions, git revision.

The same idea as ``bench/harness.environment``, inside the package (the command line must not
import from ``bench/``).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from typing import Optional

import torch


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/sits_lora


def _version(distribution: str) -> Optional[str]:
    """The installed version, read from the package's metadata: importing peft or transformers to ask would
    cost seconds in a process that does not otherwise load them. A module already imported answers itself (a
    build installed under another distribution name, such as pytorch-triton, included)."""
    loaded = sys.modules.get(distribution)
    if loaded is not None and getattr(loaded, "__version__", None):
        return loaded.__version__
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_revision() -> str:
    """Short revision of the checkout this package runs from, "-dirty" when tracked files changed.

    ``SITS_LORA_GIT_REVISION`` wins (a copy of the tree without ``.git``, such as the GPU machine's,
    names its revision there); an installed copy outside a checkout is "unknown".
    """
    named = os.environ.get("SITS_LORA_GIT_REVISION", "")
    if named:
        return named
    repo = os.path.dirname(os.path.dirname(_PACKAGE_DIR))  # src/sits_lora -> the checkout
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        # only our own checkout: a site-packages folder inside some other repository is not one
        if not top or not os.path.isdir(os.path.join(top, "src", "sits_lora")) or \
                not os.path.samefile(os.path.join(top, "src", "sits_lora"), _PACKAGE_DIR):
            return "unknown"
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=top, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=top,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("-dirty" if dirty else "")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment() -> dict:
    """GPU, CPU, versions and git revision."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "sits_lora": _version("sits_lora"),  # the package is imported before any of its modules
        "python": platform.python_version(),
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
