"""4-bit weight dequantization: the kernel the INT4 alignment benchmark (``sits-lora bench``) times.

Format: symmetric linear INT4 with one fp32 absmax per block of ``QBLOCK`` = 64 weights
(bitsandbytes' default block size), two weights per byte: the low nibble holds the even index, the
high nibble the odd one, each stored as q + 8 with q in [-7, 7]; w = q · absmax / 7.

The packed buffer may start anywhere: pass a view such as ``buffer[offset:offset + n]`` and the
kernel reads from that byte address. Triton specializes a pointer argument on whether its address
is a multiple of 16 bytes, so offsets 0, 16, 32, 64, 128 compile to the same code (128-bit loads)
and offsets such as 4 or 8 to a second variant (narrower loads); any other difference between
offsets comes from the memory system, which is what the benchmark measures.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .fused import cdiv

QBLOCK = 64


@triton.jit
def _int4_dequant_kernel(
    packed_ptr, absmax_ptr, out_ptr, n_bytes,
    BLOCK_BYTES: tl.constexpr, QBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = offs < n_bytes
    q = tl.load(packed_ptr + offs, mask=mask, other=0)                                  # (BB,) uint8
    # both nibbles of a byte lie in one absmax block: QBLOCK is even
    scale = tl.load(absmax_ptr + (offs * 2) // QBLOCK, mask=mask, other=0.0) / 7.0      # (BB,) fp32
    lo = ((q & 0xF).to(tl.int32) - 8).to(tl.float32) * scale
    hi = ((q >> 4).to(tl.int32) - 8).to(tl.float32) * scale
    vals = tl.interleave(lo, hi)                                                         # (2·BB,) even, odd
    out_offs = pid * 2 * BLOCK_BYTES + tl.arange(0, 2 * BLOCK_BYTES)
    tl.store(out_ptr + out_offs, vals.to(out_ptr.dtype.element_ty), mask=out_offs < 2 * n_bytes)


def int4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (numel / 2,), absmax fp32 (numel / QBLOCK,)) of a weight whose numel is a multiple of QBLOCK."""
    flat = weight.detach().reshape(-1).float()
    if flat.numel() % QBLOCK:
        raise ValueError(f"int4_quantize: the weight has {flat.numel()} values, not a multiple of the block size "
                         f"{QBLOCK}")
    blocks = flat.view(-1, QBLOCK)
    absmax = blocks.abs().amax(dim=1).clamp_min(1e-12)
    q = torch.round(blocks / absmax[:, None] * 7).clamp(-7, 7).to(torch.int16).reshape(-1) + 8   # [1, 15]
    packed = (q[0::2] | (q[1::2] << 4)).to(torch.uint8)
    return packed, absmax


def int4_dequantize_reference(packed: torch.Tensor, absmax: torch.Tensor,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The plain PyTorch dequantization: (2 · packed.numel(),) values in ``dtype`` (whole blocks of QBLOCK)."""
    per_block = packed.view(-1, QBLOCK // 2)                                             # (blocks, 32) bytes
    q = torch.stack((per_block & 0xF, per_block >> 4), dim=-1).view(-1, QBLOCK)          # even, odd nibbles
    values = (q.to(torch.float32) - 8) * (absmax[:, None] / 7.0)                         # (blocks, QBLOCK)
    return values.reshape(-1).to(dtype)


def int4_dequantize_into(packed: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The PyTorch dequantization into a preallocated float ``out`` (2 · packed.numel(),), allocating nothing
    of the buffer's size: on a CPU the allocator's page faults otherwise cost more than the work (55 ms
    against 1.3 ms for 1M weights, measured on this project's 2-core machine)."""
    per_block = packed.view(-1, QBLOCK // 2)                                             # (blocks, 32) bytes
    pairs = out.view(-1, QBLOCK // 2, 2)                                                 # (blocks, 32, even/odd)
    high, low = pairs[..., 1], pairs[..., 0]
    high.copy_(per_block).div_(16).floor_()
    low.copy_(per_block).add_(high, alpha=-16)
    out.view(-1, QBLOCK).sub_(8).mul_(absmax[:, None] / 7.0)
    return out


def int4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                    out: Optional[torch.Tensor] = None, block_bytes: Optional[int] = None) -> torch.Tensor:
    """The Triton dequantization of a packed buffer (a CUDA tensor, or a CPU one under TRITON_INTERPRET=1)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or not packed.is_contiguous():
        raise ValueError("int4_dequantize: packed must be a contiguous 1-D uint8 tensor (a view at any byte offset)")
    n_bytes = packed.numel()
    if out is None:
        out = torch.empty(2 * n_bytes, device=packed.device, dtype=dtype)
    # 2048 bytes a program with 4 warps: 16 bytes a thread, one 128-bit load when the address allows it.
    # The interpreter runs programs one by one in Python: small blocks keep it quick.
    block = block_bytes or (256 if packed.device.type == "cpu" else 2048)
    _int4_dequant_kernel[(cdiv(n_bytes, block),)](
        packed, absmax, out, n_bytes, BLOCK_BYTES=block, QBLOCK=QBLOCK, num_warps=4,
    )
    return out
