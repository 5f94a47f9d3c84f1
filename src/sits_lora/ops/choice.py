"""Which implementation runs: the kernel a config asks for, resolved against the input, and the GEMM
behind the Triton path."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import Tensor

logger = logging.getLogger("sits_lora")

KERNELS = ("auto", "triton", "torch")


class KernelUnavailableError(RuntimeError):
    """The requested kernel cannot run on this machine."""


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The Triton kernels address a (tokens, features) tensor with 32-bit offsets: from 2**31 elements on, an
# offset wraps and the kernel reads and writes out of bounds (the 8B MLP's T x 14336 tensors pass it at 149,797
# tokens in one batch). Such a call runs the reference, which is correct at any size.
INT32_ELEMENTS = 2**31
_warned_large = False


_fused = None


def fused_kernels():
    """ops.fused, imported on first use (it imports Triton, which is optional) and kept: an import statement in a
    launch path costs the import machinery's lookups on every call."""
    global _fused
    if _fused is None:
        from . import fused
        _fused = fused
    return _fused


def tensor_too_large(x: Tensor, out_features: int) -> bool:
    """Whether x (tokens x features) or the output of out_features reaches 2**31 elements (INT32_ELEMENTS)."""
    tokens = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
    return tokens * max(x.shape[-1] if x.dim() else 1, out_features) >= INT32_ELEMENTS


def _reference_for_large(x: Tensor, out_features: int) -> str:
    global _warned_large
    if not _warned_large:
        _warned_large = True
        logger.warning(
            "sits_lora: a LoRA layer's input or output has %d tokens x %d features, 2**31 elements or more: the fused "
            "kernels address it with 32-bit offsets, so this call (and any like it) runs the PyTorch reference "
            "instead (correct, slower). sits_lora.activations.tile_mlp(model) keeps the MLP's tensors under it.",
            x.numel() // max(x.shape[-1], 1), max(x.shape[-1], out_features))
    return "torch"


def resolve_kernel(requested: str, x: Tensor, out_features: int = 0, dtype: Optional[torch.dtype] = None) -> str:
    """The implementation SitsLoraConfig.kernel=requested runs for input x (computed in ``dtype``, x's own when
    None: a quantized base casts x to the dtype it rebuilds W in): "triton" or "torch".

    "auto": Triton on CUDA for bf16 / fp16, the reference otherwise (fp32 on a GPU keeps exact
    fp32 products; the reference is cuBLAS there). "triton": CUDA, or the CPU only under the Triton
    interpreter (TRITON_INTERPRET=1, for tests). "torch": the reference, anywhere. Either way a call
    whose input or output (``out_features`` wide) reaches 2**31 elements runs the reference (the kernels'
    offsets are 32-bit), with one warning.
    """
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if not (x.is_cuda and (dtype or x.dtype) in (torch.bfloat16, torch.float16)):
            return "torch"
        return _reference_for_large(x, out_features) if tensor_too_large(x, out_features) else "triton"
    if requested == "triton":
        if x.is_cuda or triton_interpreter_on():
            return _reference_for_large(x, out_features) if tensor_too_large(x, out_features) else "triton"
        raise KernelUnavailableError(
            f"SitsLoraConfig.kernel='triton' needs a CUDA GPU, but the input is on {x.device}. Use "
            "kernel='auto' (Triton on GPU, the PyTorch reference on CPU) or kernel='torch'; to run the "
            "Triton kernels on the CPU for testing, set TRITON_INTERPRET=1 before importing sits_lora."
        )
    raise ValueError(f"SitsLoraConfig.kernel={requested!r} is invalid: allowed values are {', '.join(map(repr, KERNELS))}.")


# Calls whose base GEMM is smaller than this many FLOPs (2·tokens·in·out) take the few-matmul ATen path
# (sits_lora.ops.aten) when the config says kernel="auto": below it the fused path's launches cost the host
# more than its fewer passes save the GPU (docs/diffusion.md, "Small calls"). SITS_LORA_ATEN_BELOW_FLOPS sets it;
# 0 keeps every call on the fused kernels.
_ATEN_BELOW_FLOPS = float(os.environ.get("SITS_LORA_ATEN_BELOW_FLOPS", 16e9))


def set_aten_below_flops(flops: float) -> None:
    """Calls of fewer base-GEMM FLOPs than ``flops`` run on ATen matmuls under kernel="auto" (0: never)."""
    if not flops >= 0:
        raise ValueError(f"the ATen path's FLOP threshold must be >= 0, got {flops!r}")
    global _ATEN_BELOW_FLOPS
    _ATEN_BELOW_FLOPS = float(flops)


def aten_below_flops() -> float:
    return _ATEN_BELOW_FLOPS


def small_call(requested: str, x: Tensor, in_features: int, out_features: int) -> bool:
    """Whether a call that resolved to the Triton path runs the few-matmul ATen path instead: under
    kernel="auto" (an explicit "triton" is honoured), when its base GEMM has fewer FLOPs than
    :func:`aten_below_flops`. Under torch.compile only with nothing to differentiate: a compiled training step
    keeps the fused op (no host cost to save there, and its backward is one op), while an inference call as small
    as a cross-attention's to_k / to_v on 77 text tokens is a few hundred rows, where cuBLAS's GEMMs, which
    inductor then sees as plain matmuls, beat a fused kernel whose tiles are sized for thousands."""
    if requested != "auto" or (torch.compiler.is_compiling() and torch.is_grad_enabled()):
        return False
    tokens = x.numel() // max(in_features, 1)
    return 2.0 * tokens * in_features * out_features < _ATEN_BELOW_FLOPS


# Calls of at most this many rows with nothing to differentiate run the one-kernel decode path (ops.decode).
DECODE_MAX_ROWS = 64
_DECODE_KERNEL = os.environ.get("SITS_LORA_DECODE_KERNEL", "1") != "0"


def set_decode_kernel(enabled: bool) -> None:
    """Whether no-grad calls of at most DECODE_MAX_ROWS rows take the one-kernel decode path (default on;
    SITS_LORA_DECODE_KERNEL=0 turns it off)."""
    global _DECODE_KERNEL
    _DECODE_KERNEL = bool(enabled)


def decode_call(x: Tensor, in_features: int) -> bool:
    """Whether a call that resolved to the Triton path runs the one-kernel decode path: nothing to differentiate
    (torch.no_grad / inference mode), eager (torch.compile schedules the custom op), at most DECODE_MAX_ROWS rows.
    Under either kernel setting ("auto" or "triton"): the decode kernel is a Triton kernel too."""
    return (_DECODE_KERNEL and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and x.numel() // max(in_features, 1) <= DECODE_MAX_ROWS)


# Which GEMM carries the base product: "cublas" (addmm epilogue) or "triton" (our GEMM with a fused
# low-rank epilogue). Chosen per GPU by measurement; see docs/kernels.md.
GEMM_BACKENDS = ("cublas", "triton")
_GEMM_BACKEND = os.environ.get("SITS_LORA_GEMM", "cublas")


def set_gemm_backend(name: str) -> None:
    """Select the GEMM behind the Triton path: "cublas" or "triton"."""
    if name not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend {name!r} is invalid: allowed values are {', '.join(map(repr, GEMM_BACKENDS))}")
    global _GEMM_BACKEND
    _GEMM_BACKEND = name


def gemm_backend() -> str:
    return _GEMM_BACKEND
