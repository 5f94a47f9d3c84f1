"""Kernels for the LoRA linear layer, and the choice between them.

This package imports torch and triton only. ``reference`` is the plain PyTorch oracle and the CPU
path; ``fused`` holds the Triton kernels. Here they become one torch custom op,
``sits_lora::lora_linear`` (forward) with ``sits_lora::lora_linear_backward``, registered with
``torch.library`` so that ``torch.compile`` sees one opaque node per layer instead of breaking the
graph.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from .reference import lora_linear_reference, lora_linear_torch

__all__ = [
    "KernelUnavailableError",
    "lora_linear",
    "lora_linear_dynamic_rank_triton",
    "lora_linear_reference",
    "resolve_kernel",
    "set_gemm_backend",
]

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
_GEMM_BACKEND = os.environ.get("SITS_LORA_GEMM", "cublas")


def set_gemm_backend(name: str) -> None:
    """Select the GEMM behind the Triton path: "cublas" or "triton"."""
    from .fused import GEMM_BACKENDS

    if name not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend {name!r} is invalid: allowed values are {', '.join(map(repr, GEMM_BACKENDS))}")
    global _GEMM_BACKEND
    _GEMM_BACKEND = name


def gemm_backend() -> str:
    return _GEMM_BACKEND


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("sits_lora::lora_linear", mutates_args=())
def _lora_linear_op(
    x: Tensor, x_lora: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
    lora_A: Tensor, lora_B: Tensor, scaling: float, gemm: str,
) -> tuple[Tensor, Tensor]:
    from .fused import lora_linear_forward

    K = x.shape[-1]
    y, h = lora_linear_forward(
        x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
        weight, bias, lora_A, lora_B, scaling, gemm,
    )
    return y.view(*x.shape[:-1], weight.shape[0]), h


@_lora_linear_op.register_fake
def _(x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm):
    tokens = x.numel() // x.shape[-1]
    return x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(tokens, lora_A.shape[0], dtype=torch.float32)


@torch.library.custom_op("sits_lora::lora_linear_backward", mutates_args=())
def _lora_linear_backward_op(
    grad_out: Tensor, x: Optional[Tensor], x_lora: Optional[Tensor], weight: Tensor,
    lora_A: Tensor, lora_B: Tensor, h: Tensor, scaling: float, gemm: str, need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dx_lora, dA, dB); an output that was not asked for is an empty tensor."""
    from .fused import lora_linear_backward

    N = grad_out.shape[-1]
    K = weight.shape[1]
    lead = grad_out.shape[:-1]
    dx, dx_lora, dA, dB = lora_linear_backward(
        grad_out.reshape(-1, N), None if x is None else x.reshape(-1, K),
        None if x_lora is None else x_lora.reshape(-1, K),
        weight, lora_A, lora_B, h, scaling, gemm, need_dx,
    )
    return (
        grad_out.new_empty(0) if dx is None else dx.view(*lead, K),
        grad_out.new_empty(0) if dx_lora is None else dx_lora.view(*lead, K),
        dA.to(lora_A.dtype),
        dB.to(lora_B.dtype),
    )


@_lora_linear_backward_op.register_fake
def _(grad_out, x, x_lora, weight, lora_A, lora_B, h, scaling, gemm, need_dx):
    lead = grad_out.shape[:-1]
    K = weight.shape[1]
    return (
        grad_out.new_empty(*lead, K) if need_dx else grad_out.new_empty(0),
        grad_out.new_empty(*lead, K) if x_lora is not None else grad_out.new_empty(0),
        lora_A.new_empty(lora_A.shape),
        lora_B.new_empty(lora_B.shape),
    )


def _setup_context(ctx, inputs, output):
    x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm = inputs
    _, h = output
    # Saved: the LoRA input once (x, or x_lora under dropout), the weights (no copies) and h (T x r).
    ctx.save_for_backward(x if x_lora is None else None, x_lora, weight, lora_A, lora_B, h)
    ctx.scaling = scaling
    ctx.gemm = gemm


def _backward(ctx, grad_y, grad_h):
    x, x_lora, weight, lora_A, lora_B, h = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    dx, dx_lora, dA, dB = _lora_linear_backward_op(
        grad_y.contiguous(), x, x_lora, weight, lora_A, lora_B, h, ctx.scaling, ctx.gemm, need_dx
    )
    return (
        dx if need_dx else None,
        dx_lora if x_lora is not None else None,
        None, None,
        dA if ctx.needs_input_grad[4] else None,
        dB if ctx.needs_input_grad[5] else None,
        None, None,
    )


_lora_linear_op.register_autograd(_backward, setup_context=_setup_context)


def _input_grads(ctx, lead, K: int, dx, dx_lora, dA, dB, lora_A, lora_B) -> tuple:
    """Gradients of (x, x_lora, weight, bias, lora_A, lora_B), the inputs the LoRA Functions start with."""
    return (
        dx.view(*lead, K) if ctx.needs_input_grad[0] else None,
        dx_lora.view(*lead, K) if dx_lora is not None else None,
        None, None,
        dA.to(lora_A.dtype) if ctx.needs_input_grad[4] else None,
        dB.to(lora_B.dtype) if ctx.needs_input_grad[5] else None,
    )


def _forward_2d(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, gemm: str):
    """(y with x's leading dims, h): ``fused.lora_linear_forward`` on x flattened to 2-D."""
    from .fused import lora_linear_forward

    K = x.shape[-1]
    y, h = lora_linear_forward(x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
                               weight, bias, lora_A, lora_B, scaling, gemm)
    return y.view(*x.shape[:-1], weight.shape[0]), h


def _backward_2d(ctx, grad_y, x, x_lora, weight, lora_A, lora_B, h, gemm: str):
    """Gradients of the LoRA Functions' first six inputs: ``fused.lora_linear_backward`` on 2-D views."""
    from .fused import lora_linear_backward

    N, K = weight.shape
    dx, dx_lora, dA, dB = lora_linear_backward(
        grad_y.reshape(-1, N), None if x is None else x.reshape(-1, K),
        None if x_lora is None else x_lora.reshape(-1, K),
        weight, lora_A, lora_B, h, ctx.scaling, gemm, ctx.needs_input_grad[0],
    )
    return _input_grads(ctx, grad_y.shape[:-1], K, dx, dx_lora, dA, dB, lora_A, lora_B)


class LoraLinearFunction(torch.autograd.Function):
    """The same forward and backward as the custom op, without the op dispatcher in between.

    Eager mode calls this: torch.library's Python dispatch costs tens of microseconds per call,
    which is not hidden behind a layer's GPU time when the layer is small. Under torch.compile the
    custom op is used instead (dynamo needs an op it can put in the graph).
    """

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm):
        y, h = _forward_2d(x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm)
        _setup_context(ctx, (x, x_lora, weight, bias, lora_A, lora_B, scaling, gemm), (None, h))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, x_lora, weight, lora_A, lora_B, h = ctx.saved_tensors
        grads = _backward_2d(ctx, grad_y, x, x_lora, weight, lora_A, lora_B, h, ctx.gemm)
        return (*grads, None, None)


class LoraSiblingsFunction(torch.autograd.Function):
    """Several LoRA linears that read the same x (q/k/v, gate/up) as one autograd node.

    Forward: one shrink pass over x for all of them. Backward: one x pass for every dA and one dx
    that every sibling's dy W is added into, instead of one dx per sibling summed by autograd.
    x is saved once. Inputs after x: n, then for each sibling (weight, bias, lora_A, lora_B), then
    the n scalings and the GEMM backend.
    """

    @staticmethod
    def forward(ctx, x, n, *args):
        from .fused import lora_siblings_forward

        tensors, scales, gemm = args[:4 * n], args[4 * n:5 * n], args[5 * n]
        weights, biases, As, Bs = tensors[0::4], tensors[1::4], tensors[2::4], tensors[3::4]
        K = x.shape[-1]
        outputs, h, A_all = lora_siblings_forward(x.reshape(-1, K), weights, biases, As, Bs, scales, gemm)
        ctx.save_for_backward(x, h, A_all, *weights, *As, *Bs)
        ctx.n, ctx.scales, ctx.gemm = n, scales, gemm
        return tuple(y.view(*x.shape[:-1], W.shape[0]) for y, W in zip(outputs, weights))

    @staticmethod
    def backward(ctx, *grads):
        from .fused import lora_siblings_backward

        n = ctx.n
        x, h, A_all, *rest = ctx.saved_tensors
        weights, As, Bs = rest[:n], rest[n:2 * n], rest[2 * n:]
        K = x.shape[-1]
        flat = [None if g is None else g.reshape(-1, g.shape[-1]) for g in grads]
        dx, dAs, dBs = lora_siblings_backward(flat, x.reshape(-1, K), weights, As, Bs, h, ctx.scales, ctx.gemm,
                                              ctx.needs_input_grad[0], A_all)
        per_sibling = []
        for i in range(n):
            per_sibling += [None, None, dAs[i].to(As[i].dtype), dBs[i].to(Bs[i].dtype)]
        return (dx.view(x.shape) if dx is not None else None, None, *per_sibling, *([None] * n), None)


class DynamicRankLoraFunction(torch.autograd.Function):
    """The LoRA linear with a rank per token (sits_lora.dynamic_rank) on the fused kernels.

    Token t uses the first rank_limit[t] rank dimensions. With ``bucket_weights`` (T, K) (the
    router's straight-through one-hot; value ignored here, rank_limit carries the choice) its
    gradient s·Σ_{i < b_k} h[t, i] g[t, i] is returned, which reads h and g beyond each token's
    limit: only then is the unlimited h kept as well (one more (T, r) fp32 tensor per layer). Eager
    only: under torch.compile the layer runs the PyTorch reference.
    """

    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_A, lora_B, bucket_weights, scaling, rank_limit, bucket_ends,
                token_order):
        from .fused import dynamic_rank_forward

        K = x.shape[-1]
        y, h, h_full = dynamic_rank_forward(x.reshape(-1, K), None if x_lora is None else x_lora.reshape(-1, K),
                                            weight, bias, lora_A, lora_B, scaling, rank_limit,
                                            keep_full=ctx.needs_input_grad[6], token_order=token_order)
        ctx.save_for_backward(x if x_lora is None else None, x_lora, weight, lora_A, lora_B, h, h_full, rank_limit,
                              bucket_ends)
        ctx.scaling = scaling
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        from .fused import dynamic_rank_backward

        x, x_lora, weight, lora_A, lora_B, h, h_full, rank_limit, bucket_ends = ctx.saved_tensors
        N, K = weight.shape
        dx, dx_lora, dA, dB, d_weights = dynamic_rank_backward(
            grad_y.reshape(-1, N), None if x is None else x.reshape(-1, K),
            None if x_lora is None else x_lora.reshape(-1, K), weight, lora_A, lora_B, h, ctx.scaling,
            ctx.needs_input_grad[0], rank_limit, h_full, bucket_ends)
        grads = _input_grads(ctx, grad_y.shape[:-1], K, dx, dx_lora, dA, dB, lora_A, lora_B)
        return (*grads, d_weights, None, None, None, None)


def lora_linear_dynamic_rank_triton(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, rank_limit: Tensor,
                                    bucket_ends: Tensor, bucket_weights: Optional[Tensor] = None,
                                    group_tokens: bool = False) -> Tensor:
    """y = x Wᵀ + b + s·((x_lora Aᵀ) ⊙ [r < rank_limit]) Bᵀ on the fused kernels (see DynamicRankLoraFunction).

    rank_limit (T,) int32 on x's device; bucket_ends (K,) int64, the ranks of the buckets; x_lora None:
    the LoRA input is x. ``group_tokens`` sorts the tokens by limit for the expand kernel (one sort
    per layer call) so that its blocks skip the rank tiles above their bucket. Off by default: on the
    H200 the sort (~31 µs of GPU time) costs more than the tiles save (the expand is bound by writing
    its output, not by its rank-64 arithmetic). GPU kernel time × the static kernel at r_max, training
    (router gradient), mixed buckets, T = 8192, four Llama shapes: 1.06 / 1.01 / 1.03 / 1.05 grouped,
    1.01 / 0.97 / 1.01 / 1.00 in token order (bench/results/2026-11-30-h200-session6/layer).
    """
    order = torch.argsort(rank_limit).to(torch.int32) if group_tokens else None
    return DynamicRankLoraFunction.apply(x, x_lora, weight, bias, lora_A, lora_B, bucket_weights, float(scaling),
                                         rank_limit, bucket_ends, order)


def lora_siblings_triton(x, weights, biases, lora_As, lora_Bs, scalings, gemm: Optional[str] = None) -> tuple:
    """Outputs of n LoRA linears that all read x, through one LoraSiblingsFunction (eager only)."""
    n = len(weights)
    tensors = [t for quad in zip(weights, biases, lora_As, lora_Bs) for t in quad]
    return LoraSiblingsFunction.apply(x, n, *tensors, *[float(s) for s in scalings], gemm or _GEMM_BACKEND)


def lora_linear_triton(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, gemm: Optional[str] = None) -> Tensor:
    """The fused Triton path. x_lora None: the LoRA input is x (no dropout)."""
    gemm = gemm or _GEMM_BACKEND
    if torch.compiler.is_compiling():
        y, _ = _lora_linear_op(x, x_lora, weight, bias, lora_A, lora_B, float(scaling), gemm)
        return y
    return LoraLinearFunction.apply(x, x_lora, weight, bias, lora_A, lora_B, float(scaling), gemm)


def lora_linear(x, x_lora, weight, bias, lora_A, lora_B, scaling: float, kernel: str = "torch") -> Tensor:
    """y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ with the resolved kernel ("torch" or "triton").

    Pass ``x_lora=x`` (the same tensor) when there is no dropout; the Triton path then fuses the
    LoRA gradient into dx and keeps one saved activation.
    """
    if kernel == "torch":
        return lora_linear_torch(x, x_lora, weight, bias, lora_A, lora_B, scaling)
    if kernel == "triton":
        return lora_linear_triton(x, None if x_lora is x else x_lora, weight, bias, lora_A, lora_B, scaling)
    raise KernelUnavailableError(f"unknown kernel {kernel!r}")
