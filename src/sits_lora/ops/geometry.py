"""Launch geometry of the fused LoRA kernels (ops.fused, ops.fused_backward): rank blocks, grids, splits.

Plain Python on host integers (no Triton): the kernels' modules, the decode and mixed-batch kernels and the
compile-time tuner all size their launches here.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import tuning


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host integers (grids, splits).

    Not triton.cdiv: newer Triton makes it a ConstexprFunction whose host call costs microseconds,
    and a layer step computes a dozen of these on the path that issues its kernels.
    """
    return -(-a // b)


def block_rank(r: int) -> int:
    """The rank block the kernels run rank ``r`` at (the R in the tuning cache's dims)."""
    # tl.dot needs every dimension >= 16; ranks that are not powers of two are masked.
    return max(16, 1 << (r - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 activations: exact fp32 products (the interpreter tests compare at 1e-5);
    # bf16 / fp16: the inputs are cast to the activation dtype, precision flag unused.
    return "ieee" if dtype == torch.float32 else "tf32"


def _split(length: int, block: int, other_programs: int, target_programs: int) -> tuple[int, int]:
    """(splits, per_split): cut ``length`` into whole blocks so that splits x other_programs is
    about ``target_programs`` (enough programs to keep every SM streaming), at least one split."""
    splits = max(1, min(cdiv(length, block), cdiv(target_programs, other_programs)))
    per_split = cdiv(cdiv(length, splits), block) * block
    return cdiv(length, per_split), per_split


# The launch geometry of each kernel at a shape is remembered (tuning.remember): a layer launches at the same few
# shapes step after step, and recomputing blocks, grids and splits is host time on the path that issues its kernels.
# A configuration passed in (tests, tuning) is used as given and not remembered.

def _grid_layout(kernel: str, T: int, width: int, dtype, cfg: dict, BLOCK_R: int) -> tuple:
    t_blocks = cdiv(T, cfg["BLOCK_T"])
    grid = (t_blocks,) if kernel == "shrink" else (t_blocks, cdiv(width, cfg["BLOCK_N"]))
    return grid, BLOCK_R, dot_precision(dtype)


def _split_layout(kernel: str, T: int, width: int, dtype, cfg: dict, BLOCK_R: int) -> tuple:
    if kernel == "dy_pass":
        # About two programs per SM of a Hopper GPU (132 SMs): split N when there are few token blocks.
        t_blocks = cdiv(T, cfg["BLOCK_T"])
        splits, per_split = _split(width, cfg["BLOCK_N"], t_blocks, 264)
        grid = (t_blocks, splits)
    else:
        # About four programs per SM in all, each summing its own token range: a few partial sums of dA instead
        # of one per token block.
        k_blocks = cdiv(width, cfg["BLOCK_K"])
        splits, per_split = _split(T, cfg["BLOCK_T"], k_blocks, 528)
        grid = (splits, k_blocks)
    return grid, BLOCK_R, dot_precision(dtype), per_split


def _geometry(layout: Callable[..., tuple], kernel: str, device, T: int, width: int, R: int, dtype,
              config: Optional[dict]) -> tuple:
    """(config, *layout) for the kernel at this shape, remembered unless ``config`` is given."""
    BLOCK_R = block_rank(R)
    cfg = config or tuning.config_for(kernel, device, (width, BLOCK_R), dtype)
    found = (cfg, *layout(kernel, T, width, dtype, cfg, BLOCK_R))
    if not config:
        tuning.remember((kernel, device, T, width, R, dtype), found)
    return found


def grid_geometry(kernel: str, device, T: int, width: int, R: int, dtype, config: Optional[dict]) -> tuple:
    """(config, grid, BLOCK_R, dot precision) of the shrink (width K) or the expand (width N)."""
    found = None if config else tuning.remembered((kernel, device, T, width, R, dtype))
    return found if found is not None else _geometry(_grid_layout, kernel, device, T, width, R, dtype, config)


def split_geometry(kernel: str, device, T: int, width: int, R: int, dtype, config: Optional[dict]) -> tuple:
    """(config, grid, BLOCK_R, dot precision, per split) of the dy pass (width N, split along N) or the x pass
    (width K, split along T)."""
    found = None if config else tuning.remembered((kernel, device, T, width, R, dtype))
    return found if found is not None else _geometry(_split_layout, kernel, device, T, width, R, dtype, config)
