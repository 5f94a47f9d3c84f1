"""Kernels for the LoRA linear layer, and the choice between them.

This package imports torch and triton only. ``reference`` is the plain PyTorch oracle and the
CPU path; the Triton kernels live beside it.
"""

from __future__ import annotations

import os

import torch

from .reference import lora_linear_reference, lora_linear_torch

__all__ = ["lora_linear", "lora_linear_reference", "resolve_kernel", "KernelUnavailableError"]


class KernelUnavailableError(RuntimeError):
    """The requested kernel cannot run on this machine."""


def _triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_kernel(requested: str, device: torch.device) -> str:
    """Map SitsLoraConfig.kernel to the implementation that runs on ``device``.

    "auto" is the fastest one available ("torch" today); "torch" always works; "triton" needs a
    CUDA device, or the Triton interpreter (TRITON_INTERPRET=1) on the CPU.
    """
    if requested in ("auto", "torch"):
        return "torch"
    if requested == "triton":
        raise KernelUnavailableError(
            "SitsLoraConfig.kernel='triton' is not available in this version of sits_lora; "
            "use kernel='auto' or kernel='torch'."
        )
    raise ValueError(f"SitsLoraConfig.kernel={requested!r} is invalid: allowed values are 'auto', 'triton', 'torch'.")


def lora_linear(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, kernel: str = "torch"):
    """y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ with the chosen kernel (see ``reference`` for notation)."""
    if kernel == "torch":
        return lora_linear_torch(x, x_lora, weight, bias, lora_A, lora_B, scaling)
    raise KernelUnavailableError(f"unknown kernel {kernel!r}")
