"""Where sits_lora keeps what it measures or builds once: ``$SITS_LORA_CACHE`` or ``~/.cache/sits_lora``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$SITS_LORA_CACHE`` when set, else ``~/.cache/sits_lora`` (read on every call: tests and jobs set it)."""
    return Path(os.environ.get("SITS_LORA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sits_lora"))
