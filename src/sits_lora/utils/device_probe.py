"""What a device can do, measured: copy bandwidth, pinned host<->device bandwidth, matmul rates.

Each function measures one number with the one timer (:mod:`sits_lora.utils.timing`) and returns it
with the time it came from, so a report can show both. On a CUDA device the GPU timer measures
(``gpu_seconds``: CUDA events, L2 flushed before each call); on the CPU the host timer does
(``host_seconds``, at most ``reps`` timed calls within a second). The caller picks the sizes: they
decide whether a measurement reaches the device's plateau and how long it takes. The hardware report
(``sits_lora.training.hardware``) and the benchmark (``sits-lora bench``) both measure through here.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .timing import gpu_seconds, host_seconds

# The fp8 formats torch._scaled_mm takes, in the order they are tried: NVIDIA's, then AMD MI300's.
FP8_FORMATS = ("float8_e4m3fn", "float8_e4m3fnuz")
DIRECTIONS = ("host->device", "device->host")


class Fp8MatmulError(RuntimeError):
    """torch._scaled_mm ran in none of the formats tried; ``errors`` holds (format name, exception) for each
    format this torch has, in the order tried."""

    def __init__(self, errors: list[tuple[str, BaseException]]):
        self.errors = list(errors)
        super().__init__("; ".join(f"{name}: {_first_line(error)}" for name, error in self.errors))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def _on(device: torch.device):
    """The device's CUDA context (events and the L2 flush then happen on it); nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _seconds(device: torch.device, fn: Callable[[], object], reps: int) -> float:
    return gpu_seconds(fn) if device.type == "cuda" else host_seconds(fn, reps=reps)


def copy_bandwidth(device, nbytes: int, *, reps: int = 10) -> tuple[float, float]:
    """(bytes/s, seconds) of copying an ``nbytes`` buffer to another on ``device``, read + write counted
    (2 x nbytes per copy): the ceiling of a memory-bound kernel. The host copy's source is written first so
    its pages are resident; pick ``nbytes`` well past the last-level cache."""
    device = torch.device(device)
    with _on(device):
        if device.type == "cuda":
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        seconds = _seconds(device, lambda: dst.copy_(src), reps)
    return 2 * nbytes / seconds, seconds


def pinned_bandwidth(device, nbytes: int, direction: str) -> tuple[float, float]:
    """(bytes/s, seconds) of one ``nbytes`` copy between pinned host memory and the CUDA ``device``,
    ``direction`` "host->device" or "device->host", timed on the GPU (an asynchronous copy, as a training
    step's transfers are)."""
    device = torch.device(device)
    if direction not in DIRECTIONS:
        raise ValueError(f"pinned_bandwidth(direction={direction!r}): use one of {', '.join(map(repr, DIRECTIONS))}")
    if device.type != "cuda":
        raise ValueError(f"pinned_bandwidth(device={str(device)!r}): pinned transfers need a CUDA device")
    with _on(device):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src, dst = (host, dev) if direction == "host->device" else (dev, host)
        seconds = gpu_seconds(lambda: dst.copy_(src, non_blocking=True))
    return nbytes / seconds, seconds


def matmul_rate(device, n: int, dtype: torch.dtype, *, reps: int = 5) -> tuple[float, float]:
    """(FLOP/s, seconds) of an ``n`` x ``n`` by ``n`` x ``n`` matmul of random ``dtype`` data on ``device``
    (2 n³ FLOP per product)."""
    device = torch.device(device)
    with _on(device):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = _seconds(device, lambda: a @ b, reps)
    return 2 * n**3 / seconds, seconds


def fp8_matmul_rate(a: torch.Tensor, b: torch.Tensor, formats: tuple[str, ...] = FP8_FORMATS, *,
                    reps: int = 5) -> tuple[float, float, str]:
    """(FLOP/s, seconds, format name) of ``torch._scaled_mm`` on ``a`` (m x k) and ``b`` (k x n) cast to fp8,
    unit scales, bf16 output, on the device the tensors are on (2 m k n FLOP per product).

    Tries each of ``formats`` this torch has, in order, and measures the first that runs; raises
    :class:`Fp8MatmulError` (with every format's error) when none does.
    """
    m, k = a.shape
    n = b.shape[1]
    errors: list[tuple[str, BaseException]] = []
    with _on(a.device):
        one = torch.ones((), device=a.device)
        for name in formats:
            dtype = getattr(torch, name, None)
            if dtype is None:
                continue
            try:
                a8 = a.to(dtype)
                b8 = b.to(dtype).t().contiguous().t()  # _scaled_mm wants b column-major
                fn = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
                fn()
                seconds = _seconds(a.device, fn, reps)
            except (RuntimeError, TypeError) as error:
                errors.append((name, error))
                continue
            return 2 * m * k * n / seconds, seconds, name
    raise Fp8MatmulError(errors)


__all__ = ["DIRECTIONS", "FP8_FORMATS", "Fp8MatmulError", "copy_bandwidth", "fp8_matmul_rate", "matmul_rate",
           "pinned_bandwidth"]
