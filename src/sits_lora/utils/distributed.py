"""Reductions over the ranks of a distributed run (torch.distributed's default group), a no-op in one process."""

from __future__ import annotations

from typing import Optional

import torch


def world_size() -> int:
    """Ranks in the default process group; 1 when torch.distributed is absent or not initialized."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_max(tensor: torch.Tensor, work_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The elementwise max of ``tensor`` over the ranks, on ``tensor``'s device and in its dtype (``tensor``
    itself in one process). The reduction runs where the backend reduces (NCCL: CUDA tensors only, gloo: CPU
    tensors only), in ``work_dtype`` when given (a dtype the backend takes, e.g. int32 for bool flags)."""
    import torch.distributed as dist

    if world_size() == 1:
        return tensor
    work_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    work = tensor.to(device=work_device, dtype=work_dtype or tensor.dtype, copy=True)
    dist.all_reduce(work, op=dist.ReduceOp.MAX)
    return work.to(device=tensor.device, dtype=tensor.dtype)


__all__ = ["all_reduce_max", "world_size"]
