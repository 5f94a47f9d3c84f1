"""Which implementation runs: the kernel a config asks for, resolved against the input, and the GEMM
behind the Triton path."""

from __future__ import annotations

import os

import torch
from torch import Tensor

KERNELS = ("auto", "triton", "torch")


class KernelUnavailableError(RuntimeError):
    """The requested kernel cannot run on this machine."""


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_kernel(requested: str, x: Tensor) -> str:
    """The implementation SitsLoraConfig.kernel=requested runs for input x: "triton" or "torch".

    "auto": Triton on CUDA for bf16 / fp16, the reference otherwise (fp32 on a GPU keeps exact
    fp32 products; the reference is cuBLAS there). "triton": CUDA, or the CPU only under the Triton
    interpreter (TRITON_INTERPRET=1, for tests). "torch": the reference, anywhere.
    """
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) else "torch"
    if requested == "triton":
        if x.is_cuda or triton_interpreter_on():
            return "triton"
        raise KernelUnavailableError(
            f"SitsLoraConfig.kernel='triton' needs a CUDA GPU, but the input is on {x.device}. Use "
            "kernel='auto' (Triton on GPU, the PyTorch reference on CPU) or kernel='torch'; to run the "
            "Triton kernels on the CPU for testing, set TRITON_INTERPRET=1 before importing sits_lora."
        )
    raise ValueError(f"SitsLoraConfig.kernel={requested!r} is invalid: allowed values are {', '.join(map(repr, KERNELS))}.")


# Which GEMM carries the base product: "cublas" (addmm epilogue) or "triton" (our GEMM with a fused
# low-rank epilogue). Chosen per GPU by measurement; see bench/NOTES.md.
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
