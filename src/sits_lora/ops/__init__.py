"""Kernels for the LoRA linear layer, one module per op, and the choice between them.

``reference`` holds the plain PyTorch oracles (and the CPU path); ``fused`` the Triton kernels the ops
share (shrink, expand, the dy and x passes, partial sums, the GEMM with a low-rank epilogue) with their
launchers (``launch``) and tuned configurations (``tuning``); ``linear``, ``siblings``,
``dynamic_rank`` and ``fp8`` each drive them for one op, with its autograd Function (and, for the layer,
its ``torch.library`` custom op); ``aten`` is the layer's op as few ATen matmuls, for calls too small for
the kernels' launches to pay; ``decode`` the whole op in one kernel for the few rows of a decode step (forward
only); ``cross_entropy`` the lm_head's loss in chunks of rows without a host sync (so a CUDA graph can record
it); ``choice`` resolves ``SitsLoraConfig.kernel`` and picks between those paths. Importing this package
imports torch only: the Triton kernels load when an op first runs on them.
"""

from __future__ import annotations

from .aten import lora_linear_aten
from .choice import (DECODE_MAX_ROWS, KERNELS, KernelUnavailableError, aten_below_flops, decode_call, gemm_backend,
                     resolve_kernel, set_aten_below_flops, set_decode_kernel, set_gemm_backend, small_call,
                     tensor_too_large, triton_interpreter_on)
from .dynamic_rank import lora_linear_dynamic_rank_triton
from .linear import lora_linear, lora_linear_triton
from .reference import ProductInput, lora_linear_reference, lora_linear_torch
from .siblings import lora_siblings_triton


def lora_linear_decode(x, weight, bias, lora_A, lora_B, scaling: float, config=None):
    """y = x Wᵀ + b + s·(x Aᵀ) Bᵀ in one Triton kernel for at most DECODE_MAX_ROWS rows, forward only
    (sits_lora.ops.decode; Triton loads on the first call)."""
    from .decode import lora_linear_decode as run

    return run(x, weight, bias, lora_A, lora_B, scaling, config)


def lora_linear_decode_siblings(x, siblings, config=None):
    """The decode kernel for two or three projections of one x (q / k / v, gate / up): ``siblings`` a list of
    (W, b, A, B, s), one output each, from one launch (sits_lora.ops.decode)."""
    from .decode import lora_linear_decode_siblings as run

    return run(x, siblings, config)


def decode_siblings_fuse(siblings) -> bool:
    """Whether projections (W, b, A, B, s) of one x can share one decode kernel (same dtypes, layouts and rank)."""
    from .decode import siblings_fuse

    return siblings_fuse(siblings)


def lora_linear_decode_mixed_siblings(x, siblings, row_adapter, config=None):
    """The mixed-batch decode kernel for two or three projections of one x: ``siblings`` a list of (W, b, A, B,
    scalings) with each projection's stacks of the same adapters, one output each (sits_lora.ops.decode)."""
    from .decode import lora_linear_decode_mixed_siblings as run

    return run(x, siblings, row_adapter, config)


def lora_linear_decode_mixed(x, weight, bias, A, B, scalings, row_adapter, config=None):
    """The decode kernel for a batch whose rows take different adapters (stacked by ops.mixed_batch.stack_adapters;
    row_adapter: each row's adapter index, -1 for none), forward only (sits_lora.ops.decode)."""
    from .decode import lora_linear_decode_mixed as run

    return run(x, weight, bias, A, B, scalings, row_adapter, config)


def linear_cross_entropy(hidden, weight, labels, ignore_index=-100, num_items=None, chunk_rows=None):
    """The loss of hidden @ weight.T against labels (0-dim fp32) in chunks of rows, forward and backward without a
    host sync (sits_lora.ops.cross_entropy; Triton loads on the first call)."""
    from .cross_entropy import linear_cross_entropy as run

    return run(hidden, weight, labels, ignore_index, num_items, chunk_rows)


__all__ = [
    "DECODE_MAX_ROWS",
    "KERNELS",
    "KernelUnavailableError",
    "ProductInput",
    "aten_below_flops",
    "decode_call",
    "decode_siblings_fuse",
    "gemm_backend",
    "linear_cross_entropy",
    "lora_linear",
    "lora_linear_aten",
    "lora_linear_decode",
    "lora_linear_decode_mixed",
    "lora_linear_decode_mixed_siblings",
    "lora_linear_decode_siblings",
    "lora_linear_dynamic_rank_triton",
    "lora_linear_reference",
    "lora_linear_torch",
    "lora_linear_triton",
    "lora_siblings_triton",
    "resolve_kernel",
    "set_aten_below_flops",
    "set_decode_kernel",
    "set_gemm_backend",
    "small_call",
    "tensor_too_large",
    "triton_interpreter_on",
]
