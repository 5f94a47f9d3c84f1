"""Dequantization of bitsandbytes' 4-bit layout (NF4 / FP4, with or without double quantization) into a dense W.

The layout, as ``bitsandbytes.functional.quantize_4bit`` writes it (read here from tensors: this module does not
import bitsandbytes):

- ``packed``: two codes per byte over W flattened row-major, the even element in the high nibble;
- ``code``: the 16 values a code stands for (the NF4 or FP4 table), float32;
- ``absmax``: one scale per ``blocksize`` consecutive elements: float32, or with double quantization one byte per
  block that stands for ``code2[byte] * absmax2[block // blocksize2] + offset`` (a second, 8-bit blockwise
  quantization of the scales, float32 ``code2`` table and ``absmax2``, a float32 ``offset`` tensor).

w = code[nibble] * scale, computed in float32 and written in ``out``'s dtype, as bitsandbytes' own kernel does. The
Triton kernel reads the packed bytes once and each scale from cache; it exists because bitsandbytes' ``dequantize_4bit``
reaches 44-51 % of the H200's copy bandwidth on the 8B shapes and this one 68-70 % (bench/bench_int4.py), and
bitsandbytes' costs more host time per call. ``sits_lora.bases.bnb4`` uses it unless ``SITS_LORA_BNB4_DEQUANT``
says "bitsandbytes".
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor


class Bnb4Layout(NamedTuple):
    """The tensors of one bitsandbytes 4-bit weight (its ``QuantState``), as the kernel reads them."""

    absmax: Tensor             # float32 per block, or uint8 per block with double quantization
    code: Tensor               # (16,) float32
    blocksize: int
    absmax2: Optional[Tensor]  # double quantization: float32 per blocksize2 blocks, else None
    code2: Optional[Tensor]    # double quantization: (256,) float32
    offset: Optional[Tensor]   # double quantization: a float32 tensor of one value
    blocksize2: int = 256


def bnb4_scales_reference(layout: Bnb4Layout) -> Tensor:
    """The float32 scale of every block (double quantization undone), by PyTorch."""
    if layout.absmax2 is None:
        return layout.absmax.float()
    blocks = torch.arange(layout.absmax.numel(), device=layout.absmax.device) // layout.blocksize2
    return layout.code2[layout.absmax.long()] * layout.absmax2[blocks] + layout.offset


def bnb4_dequantize_reference(packed: Tensor, layout: Bnb4Layout, numel: int,
                              dtype: torch.dtype = torch.float32) -> Tensor:
    """The plain PyTorch dequantization: the first ``numel`` values of W flattened, in ``dtype``."""
    packed = packed.reshape(-1).view(torch.uint8)
    codes = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1)[:numel].long()   # even: high nibble
    scales = bnb4_scales_reference(layout)
    values = layout.code.float()[codes] * scales[torch.arange(numel, device=packed.device) // layout.blocksize]
    return values.to(dtype)


def bnb4_dequantize(packed: Tensor, layout: Bnb4Layout, out: Tensor) -> Tensor:
    """W written into ``out`` (contiguous, W's numel, a float dtype) by the Triton kernel: a CUDA tensor, or a CPU
    one under TRITON_INTERPRET=1. ``packed`` may hold its bytes in another dtype (bitsandbytes' quant_storage)."""
    if not out.is_contiguous():
        raise ValueError("bnb4_dequantize: out must be contiguous")
    packed = packed.reshape(-1).view(torch.uint8)
    numel = out.numel()
    if packed.numel() * 2 < numel:
        raise ValueError(f"bnb4_dequantize: {packed.numel()} packed bytes hold fewer than out's {numel} values")
    if layout.blocksize % 2:
        raise ValueError(f"bnb4_dequantize: blocksize {layout.blocksize} is odd: a byte's two codes would need two scales")
    nested = layout.absmax2 is not None
    n_bytes = (numel + 1) // 2
    on_interpreter = packed.device.type == "cpu"
    block_bytes = 128 if on_interpreter else 1024
    from .bnb4_kernels import DEQUANTIZE  # Triton loads on first use

    DEQUANTIZE(((n_bytes + block_bytes - 1) // block_bytes,), packed, layout.absmax, layout.code,
               layout.absmax2 if nested else layout.absmax, layout.code2 if nested else layout.code,
               layout.offset if nested else layout.code, out, n_bytes, numel,
               BLOCKSIZE=layout.blocksize, BLOCKSIZE2=layout.blocksize2 if nested else 1, NESTED=nested,
               BLOCK_BYTES=block_bytes)
    return out
