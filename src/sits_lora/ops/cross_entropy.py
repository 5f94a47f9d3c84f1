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

``linear_cross_entropy_rows`` gives each row's loss instead of their sum (the per-sequence log-probabilities a
preference loss needs), with the statistics TRL's trainers log, read off the same pass over the logits: the
entropy of the row's softmax, whether the label is its first argmax, and the mean logit. Its backward scales each
row's saved gradient by that row's upstream gradient.

Two paths share the chunk loop, chosen by ``_use_kernel``: the Triton kernel on CUDA tensors (and on CPU
tensors under ``TRITON_INTERPRET=1``, for the tests), and the same arithmetic in PyTorch elsewhere.
``linear_cross_entropy_reference`` is the oracle: whole fp32 logits through plain autograd.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .choice import triton_interpreter_on

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the chunked PyTorch path runs without it
    triton = None

__all__ = ["LinearCrossEntropyFunction", "LinearCrossEntropyRowsFunction", "RowStatistics", "linear_cross_entropy",
           "linear_cross_entropy_reference", "linear_cross_entropy_rows", "row_statistics_reference"]

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


def row_statistics_reference(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100) -> tuple:
    """(loss, entropy, is_top1, mean_logit) per row of hidden Wᵀ in fp32 through plain autograd: -log softmax at
    the label, the softmax's entropy, whether the label is the first argmax, and the mean logit; 0 / False on an
    ignored row."""
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()        # (N, V) fp32
    labels = labels.reshape(-1)
    keep = labels != ignore_index
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    log_p = torch.log_softmax(logits.detach(), dim=1)
    entropy = -(log_p.exp() * log_p).sum(1)
    top1 = logits.detach().argmax(1) == labels
    mean = logits.detach().mean(1)
    return loss, entropy.where(keep, 0.0), top1 & keep, mean.where(keep, 0.0)


# ----------------------------------------------------------------------------- the kernel

if triton is not None:

    @triton.jit
    def _cross_entropy_grad_kernel(
        logits_ptr, labels_ptr, loss_ptr, entropy_ptr, top1_ptr, logit_sum_ptr,
        V, ignore_index, stride_row, stride_label,
        BLOCK_V: tl.constexpr, WITH_STATS: tl.constexpr, WRITE_GRAD: tl.constexpr,
    ):
        """Row ``program_id``: loss = lse(z) - z[label], and z overwritten by softmax(z) - onehot(label), the
        gradient of the summed loss (``WRITE_GRAD``); an ignored row gets loss 0 and a zero gradient, after one pass
        (a write). ``WITH_STATS``: also the softmax's entropy, whether the label is the first argmax and the sum
        of the logits, from the first pass (no further read)."""
        row = tl.program_id(0).to(tl.int64)            # 64-bit: a chunk of rows x V may pass 2**31 elements
        z_ptr = logits_ptr + row * stride_row
        label = tl.load(labels_ptr + row * stride_label)
        offs = tl.arange(0, BLOCK_V)
        if label == ignore_index:
            if WRITE_GRAD:
                for v0 in range(0, V, BLOCK_V):
                    tl.store(z_ptr + v0 + offs, tl.zeros((BLOCK_V,), tl.float32).to(z_ptr.dtype.element_ty),
                             mask=v0 + offs < V)
            tl.store(loss_ptr + row, 0.0)
            if WITH_STATS:
                tl.store(entropy_ptr + row, 0.0)
                tl.store(top1_ptr + row, 0)
                tl.store(logit_sum_ptr + row, 0.0)
        else:
            # 1. the running max m and sum d of exp(z - m) over the blocks of V, in fp32; with the statistics,
            #    the running sum of exp(z - m)·z (the entropy's), the largest logit before the label's column and
            #    the plain sum of the logits
            m = float("-inf")
            d = 0.0
            zd = 0.0
            m_before = float("-inf")
            z_sum = 0.0
            for v0 in range(0, V, BLOCK_V):
                v = v0 + offs
                z = tl.load(z_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(z, 0))
                rescale = tl.exp(m - m_new)
                e = tl.exp(z - m_new)                  # 0 past V
                d = d * rescale + tl.sum(e, 0)
                if WITH_STATS:
                    z0 = tl.where(v < V, z, 0.0)       # -inf past V would make e·z NaN
                    zd = zd * rescale + tl.sum(e * z0, 0)
                    z_sum += tl.sum(z0, 0)
                    m_before = tl.maximum(m_before, tl.max(tl.where(v < label, z, float("-inf")), 0))
                m = m_new
            lse = m + tl.log(d)
            # 2. the loss, from the target's logit read before step 3 overwrites it; an out-of-range label
            #    reads nothing and makes the loss NaN
            in_range = (label >= 0) & (label < V)
            z_label = tl.load(z_ptr + tl.where(in_range, label, 0)).to(tl.float32)
            tl.store(loss_ptr + row, tl.where(in_range, lse - z_label, float("nan")))
            if WITH_STATS:
                tl.store(entropy_ptr + row, lse - zd / d)
                # argmax takes the first maximum: a tie with an earlier column is not the label's
                tl.store(top1_ptr + row, (in_range & (z_label >= m) & (z_label > m_before)).to(tl.int8))
                tl.store(logit_sum_ptr + row, z_sum)
            # 3. the gradient, in place, in the logits' dtype
            if WRITE_GRAD:
                for v0 in range(0, V, BLOCK_V):
                    v = v0 + offs
                    z = tl.load(z_ptr + v, mask=v < V, other=0.0).to(tl.float32)
                    p = tl.exp(z - lse)
                    grad = tl.where(v == label, p - 1.0, p)
                    tl.store(z_ptr + v, grad.to(z_ptr.dtype.element_ty), mask=v < V)

_LAUNCHER = None


class _Statistics(NamedTuple):
    """Per-row outputs besides the loss, written by the row pass when asked for: (n,) each."""
    entropy: Tensor       # fp32
    top1: Tensor          # int8 (0 / 1)
    logit_sum: Tensor     # fp32


def cross_entropy_grad_(logits: Tensor, labels: Tensor, ignore_index: int, losses: Tensor,
                        stats: Optional[_Statistics] = None, write_grad: bool = True) -> None:
    """Each row of ``logits`` (n, V) (rows contiguous) overwritten by softmax - onehot(label) (zero for an ignored
    row; left as it is without ``write_grad``), its loss written to ``losses`` (n,) fp32, and ``stats`` filled
    when given, by the Triton kernel."""
    global _LAUNCHER
    if _LAUNCHER is None:
        from .launch import TritonLauncher

        _LAUNCHER = TritonLauncher(_cross_entropy_grad_kernel)
    n, V = logits.shape
    if n == 0:
        return
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(V))
    entropy, top1, logit_sum = stats if stats is not None else (losses, losses, losses)   # unused pointers
    _LAUNCHER((n,), logits, labels, losses, entropy, top1, logit_sum, V, ignore_index, logits.stride(0),
              labels.stride(0), BLOCK_V=block_v, WITH_STATS=stats is not None, WRITE_GRAD=write_grad,
              num_warps=8 if block_v >= 2048 else 4, num_stages=1)


def cross_entropy_grad_torch_(logits: Tensor, labels: Tensor, ignore_index: int, losses: Tensor,
                              stats: Optional[_Statistics] = None, write_grad: bool = True) -> None:
    """:func:`cross_entropy_grad_` in PyTorch (the path without the kernel): the same results in place, and no host
    sync either (masks, no boolean indexing). The log-sum-exp is spelled m + log Σ exp(z - m) and the entropy
    lse - Σ exp(z - m)·z / Σ exp(z - m), as TRL's chunked log-probabilities compute them, so that in fp32 on the
    CPU the two agree bit for bit at vocabularies of one TRL chunk (at most 32,768)."""
    V = logits.shape[1]
    z = logits.float()                                                       # (n, V) fp32
    m = z.amax(dim=1)                                                        # (n,)
    e = torch.exp(z - m.unsqueeze(1))                                        # (n, V)
    d = e.sum(dim=1)
    lse = m + torch.log(d)
    labelled = labels != ignore_index                                        # (n,)
    in_range = (labels >= 0) & (labels < V)
    target = torch.where(in_range, labels, 0).unsqueeze(1)                   # (n, 1)
    z_label = z.gather(1, target).squeeze(1)
    row_loss = torch.where(in_range, lse - z_label, float("nan"))
    losses.copy_(torch.where(labelled, row_loss, 0.0))
    if stats is not None:
        entropy = lse - (e * z).sum(dim=1) / d
        before = torch.arange(V, device=z.device) < labels.unsqueeze(1)      # (n, V): columns before the label
        m_before = z.masked_fill(~before, float("-inf")).amax(dim=1)
        top1 = in_range & (z_label >= m) & (z_label > m_before) & labelled
        stats.entropy.copy_(torch.where(labelled, entropy, 0.0))
        stats.top1.copy_(top1)
        stats.logit_sum.copy_(torch.where(labelled, z.sum(dim=1), 0.0))
    if not write_grad:
        return
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


def _row_pass(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_rows: int,
              need_hidden_grad: bool, need_weight_grad: bool, use_kernel: bool, with_stats: bool) -> tuple:
    """The chunk loop both Functions share: (losses (N,) fp32, dhidden of the summed loss (N, H) or None, dW of
    the summed loss (V, H) fp32 or None, the per-row statistics or None)."""
    n_rows = hidden.shape[0]
    V = weight.shape[0]
    grad_rows_ = cross_entropy_grad_ if use_kernel else cross_entropy_grad_torch_
    write_grad = need_hidden_grad or need_weight_grad
    losses = torch.empty(n_rows, device=hidden.device, dtype=torch.float32)                   # (N,)
    stats = None
    if with_stats:
        stats = _Statistics(torch.empty_like(losses), torch.empty(n_rows, device=hidden.device, dtype=torch.int8),
                            torch.empty_like(losses))
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
            stats_c = None if stats is None else _Statistics(*(t[start:stop] for t in stats))
            grad_rows_(logits_c, labels[start:stop], ignore_index, losses[start:stop], stats_c, write_grad)
            if grad_hidden is not None:                                                       # logits_c is dL/dz
                torch.mm(logits_c, weight, out=grad_hidden[start:stop])
            if grad_weight is not None:
                grad_weight += logits_c.t() @ hidden_c                                        # (V, H)
    return losses, grad_hidden, grad_weight, stats


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Forward computes the loss and the gradients chunk by chunk; backward scales them by grad_output / D."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, num_items, chunk_rows: int,
                need_hidden_grad: bool, need_weight_grad: bool, use_kernel: bool):
        losses, grad_hidden, grad_weight, _ = _row_pass(hidden, weight, labels, ignore_index, chunk_rows,
                                                        need_hidden_grad, need_weight_grad, use_kernel, False)
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


class LinearCrossEntropyRowsFunction(torch.autograd.Function):
    """Each row's loss and, when asked, its statistics; the lm_head's weight gets no gradient here (a sum over rows
    cannot be scaled row by row afterwards).

    The Triton path computes each row's gradient with respect to its hidden state in forward, and backward scales
    it by the row's upstream gradient. The PyTorch path keeps the inputs instead and recomputes the logits in
    backward, in the order TRL's chunked log-probabilities do (the upstream gradient applied to the logits'
    gradient before the GEMM, accumulated in fp32): on the CPU in fp32 its gradients equal TRL's bit for bit."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk_rows: int, need_hidden_grad: bool,
                use_kernel: bool, with_stats: bool):
        recompute = need_hidden_grad and not use_kernel
        losses, grad_hidden, _, stats = _row_pass(hidden, weight, labels, ignore_index, chunk_rows,
                                                  need_hidden_grad and use_kernel, False, use_kernel, with_stats)
        ctx.recompute = recompute
        ctx.chunk_rows, ctx.ignore_index = chunk_rows, ignore_index
        if recompute:
            ctx.save_for_backward(hidden, weight, labels)
        else:
            ctx.save_for_backward(grad_hidden)
        if stats is None:
            return losses, None, None, None
        top1 = stats.top1.view(torch.bool)
        ctx.mark_non_differentiable(stats.entropy, top1, stats.logit_sum)
        return losses, stats.entropy, top1, stats.logit_sum

    @staticmethod
    def backward(ctx, grad_losses, *_):
        nones = (None,) * 7
        if grad_losses is None:
            return (None,) + nones
        if ctx.recompute:
            return (_recomputed_hidden_grad(*ctx.saved_tensors, grad_losses.float(), ctx.ignore_index,
                                            ctx.chunk_rows),) + nones
        (grad_hidden,) = ctx.saved_tensors
        if grad_hidden is None:
            return (None,) + nones
        if getattr(ctx, "scaled", False):
            raise RuntimeError("linear_cross_entropy_rows: a second backward through the same call (retain_graph) "
                               "is not supported: the first one scaled the saved gradient in place")
        ctx.scaled = True
        # (N, H) × (N, 1) fp32 in place: computed in fp32, rounded once into the hidden states' dtype, and no
        # second (N, H) buffer
        return (grad_hidden.mul_(grad_losses.float().unsqueeze(1)),) + nones


def _recomputed_hidden_grad(hidden: Tensor, weight: Tensor, labels: Tensor, grad_losses: Tensor, ignore_index: int,
                            chunk_rows: int) -> Tensor:
    """dhidden of Σ grad_losses · loss, the logits recomputed a chunk at a time (the PyTorch path's backward)."""
    V = weight.shape[0]
    grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)          # (N, H)
    log_p_grad = -grad_losses                                                                   # d/d log p(label)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden.shape[0])
            z = (hidden[start:stop] @ weight.t()).float()                                       # (n, V)
            lse = z.amax(dim=1) + torch.log(torch.exp(z - z.amax(dim=1, keepdim=True)).sum(dim=1))
            p = torch.exp(z - lse.unsqueeze(1))
            target = torch.arange(V, device=z.device) == labels[start:stop].unsqueeze(1)      # (n, V); -100 none
            g = log_p_grad[start:stop].where(labels[start:stop] != ignore_index, 0.0)
            grad = torch.zeros_like(z)
            grad += g.unsqueeze(1) * (target.float() - p)
            grad_hidden[start:stop].addmm_(grad.to(hidden.dtype).float(), weight.float())
    return grad_hidden.to(hidden.dtype)


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


class RowStatistics(NamedTuple):
    """:func:`linear_cross_entropy_rows`'s result, each (...) like the labels: ``loss`` -log softmax(z)[label]
    (fp32, differentiable with respect to hidden), and with ``stats=True`` ``entropy`` (fp32), ``is_top1`` (bool:
    the label is the first argmax) and ``mean_logit`` (fp32), all 0 / False on an ignored row."""

    loss: Tensor
    entropy: Optional[Tensor]
    is_top1: Optional[Tensor]
    mean_logit: Optional[Tensor]


def linear_cross_entropy_rows(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100,
                              stats: bool = False, chunk_rows: Optional[int] = None) -> RowStatistics:
    """Each row's loss of ``hidden @ weight.T`` against ``labels`` (0 on an ignored row), without the whole logits
    and without a host sync, and with ``stats`` the entropy, top-1 and mean logit of each row from the same pass.

    hidden (..., H), labels (...), weight (V, H) frozen (a weight that requires a gradient is refused: its
    gradient is a sum over rows, which this function's backward cannot scale row by row; use
    :func:`linear_cross_entropy` for a summed loss with a trained lm_head)."""
    _check_inputs(hidden, weight, labels, None, chunk_rows)
    if torch.is_grad_enabled() and weight.requires_grad:
        raise ValueError("linear_cross_entropy_rows: weight requires a gradient, which this function does not "
                         "compute (its backward scales each row's gradient); freeze the lm_head, or use "
                         "linear_cross_entropy for a summed loss that trains it.")
    H = hidden.shape[-1]
    hidden2 = hidden.reshape(-1, H)                                                # (N, H)
    labels1 = labels.reshape(-1)                                                   # (N,)
    n_rows = hidden2.shape[0]
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(n_rows, weight.shape[0], H, hidden.element_size())
    loss, entropy, top1, logit_sum = LinearCrossEntropyRowsFunction.apply(
        hidden2, weight, labels1, int(ignore_index), max(1, min(chunk_rows, n_rows)),
        torch.is_grad_enabled() and hidden.requires_grad, _use_kernel(hidden), bool(stats))
    lead = labels.shape
    if not stats:
        return RowStatistics(loss.view(lead), None, None, None)
    return RowStatistics(loss.view(lead), entropy.view(lead), top1.view(lead), (logit_sum / weight.shape[0]).view(lead))
