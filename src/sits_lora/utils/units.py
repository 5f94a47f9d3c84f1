"""Byte units and how rates are printed."""

from __future__ import annotations

from typing import Optional

KIB, MIB, GIB = 2**10, 2**20, 2**30


def format_rate(value: Optional[float], unit: str, missing: str = "not measured") -> str:
    """``1.23 TB/s``, ``456.00 GFLOP/s``: the value with an SI prefix down to k, three significant digits
    below; ``missing`` for None."""
    if value is None:
        return missing
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_bytes(n: float) -> str:
    """GiB above 1 GiB, MiB below (the tiny test models plan a few MiB)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.2f} MiB"
