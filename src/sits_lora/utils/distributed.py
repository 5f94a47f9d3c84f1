"""Reductions over the ranks of a distributed run (torch.distributed's default group), a no-op in one process."""

from __future__ import annotations

import functools
import inspect
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


@functools.lru_cache(maxsize=None)
def fsdp2_shards_integer_parameters() -> bool:
    """Whether this torch's FSDP2 (``fully_shard``) takes a parameter of an integer dtype (frozen, no gradient).

    Before torch fixed it (2.13 has the fix) it built each sharded parameter as ``nn.Parameter(dtensor)``, which asks
    for a gradient, and stopped on "only Tensors of floating point dtype can require gradients" (seen with torch
    2.11); the fixed builder passes the parameter's own ``requires_grad``. Read from that builder's source, as no
    public flag tells; False where torch.distributed or the builder is missing."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        source = inspect.getsource(FSDPParam._init_sharded_param)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return "requires_grad=param.requires_grad" in source


__all__ = ["all_reduce_max", "fsdp2_shards_integer_parameters", "world_size"]
