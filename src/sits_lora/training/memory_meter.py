"""Measuring the peak memory of a piece of code: on CUDA the allocator's peak, on the CPU (tests) a tensor tracker."""

from __future__ import annotations

import weakref

import torch


class PeakMemoryMeter:
    """Measure the peak memory of the code inside ``with PeakMemoryMeter(device) as meter:``.

    On CUDA: ``torch.cuda.max_memory_allocated`` after a reset, so ``meter.peak`` counts every
    tensor alive at the peak, the model included. On the CPU (for tests): a dispatch mode counts
    the storage bytes of every tensor the code creates, plus those passed to :meth:`track` (the
    model's parameters, say), freed when their storage dies.
    """

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.peak = 0
        self._mode = None

    def __enter__(self) -> "PeakMemoryMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _HostTensorTracker()
            self._mode.__enter__()
        return self

    def track(self, *tensors: torch.Tensor) -> None:
        if self._mode is not None:
            for t in tensors:
                self._mode.add(t)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak = self._mode.peak


class _HostTensorTracker(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size = self.live.pop(key, None)
        if size is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            self.add(t)
        return out


__all__ = ["PeakMemoryMeter"]
