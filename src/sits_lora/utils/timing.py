"""The timer every measurement of sits_lora uses: a median over repeated calls, in seconds.

- :func:`gpu_seconds` times work queued on the GPU with ``triton.testing.do_bench``: CUDA events around
  each call, so host launch jitter stays out, and the L2 cache flushed before each call, so a kernel
  reads its inputs from HBM as it does in training. The median is robust to the odd slow call.
- :func:`host_seconds` times wall-clock work with ``time.perf_counter``: the CPU, and on a GPU whatever
  includes host time (a PCIe copy from pageable memory, loading a file), with ``sync=True`` so queued
  GPU work is counted.
- :func:`median_seconds` picks: the GPU timer when CUDA is available, else the host timer.

Triton is optional: it is imported only when :func:`gpu_seconds` runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

# At least this many timed calls: the median of fewer says nothing about the spread.
MIN_TIMED_CALLS = 3


def gpu_seconds(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median seconds of one ``fn()`` on the GPU (``triton.testing.do_bench``: CUDA events, L2 flushed before
    every call, warm-up calls for about ``warmup_ms`` then as many calls as fit in about ``rep_ms``)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) / 1e3


def host_seconds(fn: Callable[[], object], *, reps: Optional[int] = 5, budget_s: float = 1.0,
                 sync: bool = False) -> float:
    """Median wall-clock seconds of one ``fn()``.

    One untimed warm-up call first (allocations, page faults, lazy initialization), then at least three
    timed calls, and more while the ``budget_s`` seconds after the warm-up last, up to ``reps`` timed calls
    in all (``reps=None``: as many as the budget allows). ``sync=True`` synchronizes CUDA before and after
    each call, so the time includes the GPU work ``fn`` queued.
    """
    def once() -> float:
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    once()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < MIN_TIMED_CALLS or ((reps is None or len(times) < reps) and time.perf_counter() < deadline):
        times.append(once())
    return statistics.median(times)


def median_seconds(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100,
                   reps: Optional[int] = None) -> float:
    """Median seconds of one ``fn()``: :func:`gpu_seconds` when CUDA is available, else :func:`host_seconds`
    with ``rep_ms`` as its budget (at most ``reps`` timed calls; None: as many as fit)."""
    if torch.cuda.is_available():
        return gpu_seconds(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return host_seconds(fn, reps=reps, budget_s=rep_ms / 1e3)


__all__ = ["gpu_seconds", "host_seconds", "median_seconds"]
