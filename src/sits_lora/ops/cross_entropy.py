"""Linear cross-entropy (the lm_head's logits and the loss) in chunks of rows, without a host sync.

Notation (leading dims flattened into N rows):
    hidden  (N, H)   the last hidden states, in the model's dtype
    W       (V, H)   the lm_head weight (frozen under LoRA, sometimes trained)
    labels  (N,)     the target token of each row, ``ignore_index`` for a row without one
    z = hidden Wᵀ    (N, V) the logits, never held whole: V is 128,256 (Llama 3) or 151,936 (Qwen 2), so at
                     N = 32,768 rows the bf16 logits alone take 8 GiB, twice that with their gradient
    loss  = Σ_rows (lse(z_i) - z_i[label_i]) / D,  D = num_items, or the count of labelled rows (at least 1)

The forward computes the gradients as well, a chunk of rows at a time: logits_c = hidden_c Wᵀ (cuBLAS), one
Triton program per row turns logits_c in place into the gradient of the summed loss, softmax - onehot(label),
and writes the row's loss; then dhidden_c = dlogits_c W and, when W trains, dW += dlogits_cᵀ hidden_c. Backward
only scales what forward saved by grad_output / D. The peak is one chunk of logits besides the gradients.

Why ours and not Liger-Kernel's: Liger's fused linear cross-entropy reads the count of labelled rows on the host
(``.item()``), which waits for the GPU and cannot be recorded in a CUDA graph. Here D stays a device tensor from
start to end, the chunks are cut from the shapes alone, and nothing reads a tensor's value on the host, so the
whole forward and backward can be captured (tests/ops/test_cross_entropy.py records one in a ``CUDAGraph``).
The price: a label outside [0, V) other than ``ignore_index`` cannot be refused (that needs its value on the
host); its row's loss is NaN instead, so the step's loss shows it.

Two paths share the chunk loop, chosen by ``_use_kernel``: the Triton kernel on CUDA tensors (and on CPU
tensors under ``TRITON_INTERPRET=1``, for the tests), and the same arithmetic in PyTorch elsewhere.
``linear_cross_entropy_reference`` is the oracle: whole fp32 logits through plain autograd.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .choice import triton_interpreter_on

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the chunked PyTorch path runs without it
    triton = None

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "LinearCrossEntropyFunction"]

# A chunk's logits take at most max(the hidden states' bytes, LOGITS_CHUNK_BYTES). 256 MiB is 1,046 rows of
# V = 128,256 in bf16: a GEMM of that many rows runs at cuBLAS's full rate, and the chunk is a small part of the
# 8 GiB the whole logits would take at 32,768 rows. Tying it to the hidden states keeps the number of chunks (and
# of launches) bounded when N grows: the peak then grows no faster than the activations already do.
LOGITS_CHUNK_BYTES = 2**28

# The widest block of V a program holds at once: 4096 fp32 values are 16 a thread at 8 warps, in registers.
MAX_BLOCK_V = 4096

# ----------------------------------------------------------------------------- the oracle


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                                   num_items: Union[Tensor, float, None] = None) -> Tensor:
    """Σ_rows CE(hidden Wᵀ in fp32, labels) / num_items, or the mean over labelled rows (0 when there are none),
    through plain autograd."""
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()        # (N, V) fp32
    labels = labels.reshape(-1)
    total = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    if num_items is None:
        return total / (labels != ignore_index).sum().clamp(min=1)
    return total / num_items


# ----------------------------------------------------------------------------- the kernel

if triton is not None:

    @triton.jit
    def _cross_entropy_grad_kernel(
        logits_ptr, labels_ptr, loss_ptr,
        V, ignore_index, stride_row, stride_label,
        BLOCK_V: tl.constexpr,
    ):
        """Row ``program_id``: loss = lse(z) - z[label], and z overwritten by softmax(z) - onehot(label), the
        gradient of the summed loss; an ignored row gets loss 0 and a zero gradient, after one pass (a write)."""
        row = tl.program_id(0).to(tl.int64)            # 64-bit: a chunk of rows x V may pass 2**31 elements
        z_ptr = logits_ptr + row * stride_row
        label = tl.load(labels_ptr + row * stride_label)
        offs = tl.arange(0, BLOCK_V)
        if label == ignore_index:
            for v0 in range(0, V, BLOCK_V):
                tl.store(z_ptr + v0 + offs, tl.zeros((BLOCK_V,), tl.float32).to(z_ptr.dtype.element_ty),
                         mask=v0 + offs < V)
            tl.store(loss_ptr + row, 0.0)
        else:
            # 1. the running max m and sum d of exp(z - m) over the blocks of V, in fp32
            m = float("-inf")
            d = 0.0
            for v0 in range(0, V, BLOCK_V):
                z = tl.load(z_ptr + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(z, 0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
                m = m_new
            lse = m + tl.log(d)
            # 2. the loss, from the target's logit read before step 3 overwrites it; an out-of-range label
            #    reads nothing and makes the loss NaN
            in_range = (label >= 0) & (label < V)
            z_label = tl.load(z_ptr + tl.where(in_range, label, 0)).to(tl.float32)
            tl.store(loss_ptr + row, tl.where(in_range, lse - z_label, float("nan")))
            # 3. the gradient, in place, in the logits' dtype
            for v0 in range(0, V, BLOCK_V):
                v = v0 + offs
                z = tl.load(z_ptr + v, mask=v < V, other=0.0).to(tl.float32)
                p = tl.exp(z - lse)
                grad = tl.where(v == label, p - 1.0, p)
                tl.store(z_ptr + v, grad.to(z_ptr.dtype.element_ty), mask=v < V)

_LAUNCHER = None


def cross_entropy_grad_(logits: Tensor, labels: Tensor, ignore_index: int, losses: Tensor) -> None:
    """Each row of ``logits`` (n, V) (rows contiguous) overwritten by softmax - onehot(label) (zero for an ignored
    row), and its loss written to ``losses`` (n,) fp32, by the Triton kernel."""
    global _LAUNCHER
    if _LAUNCHER is None:
        from .launch import TritonLauncher

        _LAUNCHER = TritonLauncher(_cross_entropy_grad_kernel)
    n, V = logits.shape
    if n == 0:
        return
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(V))
    _LAUNCHER((n,), logits, labels, losses, V, ignore_index, logits.stride(0), labels.stride(0),
              BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4, num_stages=1)


def cross_entropy_grad_torch_(logits: Tensor, labels: Tensor, ignore_index: int, losses: Tensor) -> None:
    """:func:`cross_entropy_grad_` in PyTorch (the path without the kernel): the same arithmetic in fp32, the same
    result in place, and no host sync either (masks, no boolean indexing)."""
    V = logits.shape[1]
    z = logits.float()                                                       # (n, V) fp32
    lse = torch.logsumexp(z, dim=1)                                          # (n,)
    labelled = labels != ignore_index                                        # (n,)
    in_range = (labels >= 0) & (labels < V)
    target = torch.where(in_range, labels, 0).unsqueeze(1)                   # (n, 1)
    row_loss = torch.where(in_range, lse - z.gather(1, target).squeeze(1), float("nan"))
    losses.copy_(torch.where(labelled, row_loss, 0.0))
    grad = torch.exp(z.sub_(lse.unsqueeze(1)))                               # softmax, in z's storage
    grad.scatter_add_(1, target, -in_range.to(grad.dtype).unsqueeze(1))      # - onehot(label)
    logits.copy_(grad.mul_(labelled.unsqueeze(1)))


def _use_kernel(hidden: Tensor) -> bool:
    """The Triton kernel on CUDA tensors, and on CPU tensors under the interpreter (the tests); the PyTorch path
    otherwise, and wherever Triton is not installed."""
    if triton is None:
        return False
    return hidden.is_cuda or (hidden.device.type == "cpu" and triton_interpreter_on())


def chunk_rows_for(n_rows: int, vocab: int, hidden_size: int, element_size: int) -> int:
    """Rows per chunk, from the shapes only: the chunk's logits take at most max(the hidden states' bytes,
    LOGITS_CHUNK_BYTES), and the chunks are cut even (37 rows at most 16 a chunk: 13, 13, 11 rather than
    16, 16, 5)."""
    if n_rows <= 0:
        return 1   # no rows: no chunk runs
    budget = max(n_rows * hidden_size * element_size, LOGITS_CHUNK_BYTES)
    most = max(1, min(n_rows, budget // (vocab * element_size)))
    chunks = -(-n_rows // most)
    return -(-n_rows // chunks)


# ----------------------------------------------------------------------------- the autograd Function


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Forward computes the loss and the gradients chunk by chunk; backward scales them by grad_output / D."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, num_items, chunk_rows: int,
                need_hidden_grad: bool, need_weight_grad: bool, use_kernel: bool):
        n_rows = hidden.shape[0]
        V = weight.shape[0]
        grad_rows_ = cross_entropy_grad_ if use_kernel else cross_entropy_grad_torch_
        losses = torch.empty(n_rows, device=hidden.device, dtype=torch.float32)                   # (N,)
        logits = torch.empty(min(chunk_rows, n_rows), V, device=hidden.device, dtype=hidden.dtype)  # (C, V)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None                      # (N, H)
        # dW sums the chunks' parts in fp32: in the weights' dtype (addmm_) the running sum would be rounded
        # once a chunk (bf16 keeps 8 bits), and the unscaled sum of a frequent token's rows can pass fp16's
        # 65,504. It costs V·H·4 bytes, paid only when the lm_head trains (under LoRA it is frozen).
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_weight_grad else None
        # The matmuls run in the inputs' dtype, which the buffers above are allocated in: under autocast an fp32
        # caller would get bf16 logits and the out= products would refuse them.
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n_rows, chunk_rows):
                stop = min(start + chunk_rows, n_rows)
                hidden_c = hidden[start:stop]                                                     # (n, H)
                logits_c = logits[: stop - start]                                                 # (n, V)
                torch.mm(hidden_c, weight.t(), out=logits_c)
                grad_rows_(logits_c, labels[start:stop], ignore_index, losses[start:stop])       # now dL/dz
                if grad_hidden is not None:
                    torch.mm(logits_c, weight, out=grad_hidden[start:stop])
                if grad_weight is not None:
                    grad_weight += logits_c.t() @ hidden_c                                        # (V, H)
        if num_items is None:
            denominator = (labels != ignore_index).sum().clamp(min=1).float()
        elif isinstance(num_items, Tensor):
            denominator = num_items.detach().to(device=hidden.device, dtype=torch.float32)
        else:
            # a fill, not a copy from the host: a graph records it as a constant
            denominator = torch.full((), float(num_items), device=hidden.device, dtype=torch.float32)
        ctx.save_for_backward(grad_hidden, grad_weight, denominator)
        ctx.weight_dtype = weight.dtype
        return losses.sum() / denominator

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, denominator = ctx.saved_tensors
        scale = grad_output.float() / denominator                  # 0-dim fp32, on the device
        # a 0-dim fp32 factor keeps the dtype of the tensor it scales: one rounding, no second pass
        dhidden = grad_hidden * scale if grad_hidden is not None else None
        dweight = (grad_weight * scale).to(ctx.weight_dtype) if grad_weight is not None else None
        return dhidden, dweight, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- the entry point

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, num_items, chunk_rows) -> None:
    if not hidden.dtype.is_floating_point:
        raise TypeError(f"linear_cross_entropy: hidden has dtype {hidden.dtype}; pass the hidden states as a "
                        "floating-point tensor (bf16, fp16 or fp32).")
    if weight.dim() != 2:
        raise ValueError(f"linear_cross_entropy: weight has shape {tuple(weight.shape)}; pass the lm_head "
                         "weight as (vocab, hidden_size).")
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden has shape {tuple(hidden.shape)} but weight "
                         f"{tuple(weight.shape)}: hidden's last dim must equal weight's hidden_size "
                         f"({weight.shape[1]}); pass weight as (vocab, hidden_size), not transposed.")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; cast "
                        "one to the other's dtype.")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(f"linear_cross_entropy: hidden is on {hidden.device}, weight on {weight.device}, "
                         f"labels on {labels.device}; move them to one device.")
    if labels.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"linear_cross_entropy: labels has dtype {labels.dtype}; pass token ids as an integer "
                        "tensor (torch.long).")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"linear_cross_entropy: labels has shape {tuple(labels.shape)} but hidden "
                         f"{tuple(hidden.shape)}: labels must have hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])} (one label a row; shift them before the call).")
    if isinstance(num_items, Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"linear_cross_entropy: num_items has shape {tuple(num_items.shape)}; pass one "
                             "number (a 0-dim tensor or a Python number).")
    elif num_items is not None and not num_items > 0:
        raise ValueError(f"linear_cross_entropy: num_items={num_items!r}; pass a positive count, or None to "
                         "divide by the number of labelled rows.")
    if chunk_rows is not None and (type(chunk_rows) is not int or chunk_rows < 1):
        raise ValueError(f"linear_cross_entropy: chunk_rows={chunk_rows!r}; pass a positive int, or None to "
                         "size the chunks from the shapes.")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                         num_items: Union[Tensor, float, None] = None, chunk_rows: Optional[int] = None) -> Tensor:
    """The loss of ``hidden @ weight.T`` against ``labels`` as a 0-dim fp32 tensor, without the whole logits.

    hidden (..., H) and labels (...) with the same leading dims; weight (V, H). The sum over labelled rows is
    divided by ``num_items`` (a tensor, best on the device already: a CPU tensor is copied over, which a CUDA
    graph cannot record; or a Python number), or else by the count of labelled rows (at least 1, so a batch
    without labels gives 0). ``chunk_rows`` overrides the rows per chunk, which otherwise come from the shapes
    (:func:`chunk_rows_for`). Nothing here reads a tensor's value on the host, so a step using it can be
    recorded as a CUDA graph.
    """
    _check_inputs(hidden, weight, labels, num_items, chunk_rows)
    H = hidden.shape[-1]
    hidden2 = hidden.reshape(-1, H)                                                # (N, H)
    labels1 = labels.reshape(-1)                                                   # (N,)
    n_rows = hidden2.shape[0]
    grad_on = torch.is_grad_enabled()
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(n_rows, weight.shape[0], H, hidden.element_size())
    return LinearCrossEntropyFunction.apply(
        hidden2, weight, labels1, int(ignore_index), num_items, max(1, min(chunk_rows, n_rows)),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad, _use_kernel(hidden))
