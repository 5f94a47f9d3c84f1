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
reaches a smaller share of the GPU's copy bandwidth than this one on the 8B shapes (bench/bench_int4.py;
docs/quantization.md), and bitsandbytes' costs more host time per call. ``sits_lora.bases.bnb4`` uses it unless
``SITS_LORA_BNB4_DEQUANT`` says "bitsandbytes".
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


def bnb4_dequantize_scaled_reference(packed: Tensor, layout: Bnb4Layout, shape: tuple[int, int], w_scale: Tensor,
                                     dtype: torch.dtype, transpose: bool = False) -> Tensor:
    """The plain PyTorch :func:`bnb4_dequantize_scaled`: W (rows, cols) times ``w_scale`` ((1,) or one per row), in
    ``dtype`` (an fp8 dtype saturates at its largest value), transposed if asked."""
    rows, cols = shape
    w = bnb4_dequantize_reference(packed, layout, rows * cols).view(rows, cols)
    w = w * (w_scale.float().view(-1, 1) if w_scale.numel() > 1 else w_scale.float())
    if dtype in _FP8_MAX:
        w = w.clamp(-_FP8_MAX[dtype], _FP8_MAX[dtype])
    w = w.to(dtype)
    return w.t().contiguous() if transpose else w


_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}   # ops.fp8.FP8_MAX (that module loads Triton)


def bnb4_dequantize_scaled(packed: Tensor, layout: Bnb4Layout, shape: tuple[int, int], w_scale: Tensor, out: Tensor,
                           transpose: bool = False, tile: Optional[tuple[int, int, int]] = None) -> Tensor:
    """W (rows, cols) times ``w_scale`` (fp32, (1,) or (rows,)) written into ``out`` by the Triton kernel: (rows,
    cols), or (cols, rows) with ``transpose``. ``out`` may be an fp8 tensor (values saturate at its largest value,
    rounded to nearest-even): this is how an fp8 GEMM gets W from the 4-bit bytes in one pass, in either of the two
    layouts ``torch._scaled_mm`` needs (forward and backward). cols must be even. ``tile``: (rows, bytes of a row,
    warps) per program, for measuring others than the defaults."""
    rows, cols = shape
    if cols % 2:
        raise ValueError(f"bnb4_dequantize_scaled: {cols} columns: a row must start on a whole byte (an even count)")
    if layout.blocksize % 2:
        raise ValueError(f"bnb4_dequantize_scaled: blocksize {layout.blocksize} is odd")
    if not out.is_contiguous() or tuple(out.shape) != ((cols, rows) if transpose else (rows, cols)):
        raise ValueError(f"bnb4_dequantize_scaled: out must be contiguous of shape "
                         f"{(cols, rows) if transpose else (rows, cols)}, got {tuple(out.shape)}")
    if w_scale.numel() not in (1, rows) or w_scale.dtype != torch.float32:
        raise ValueError(f"bnb4_dequantize_scaled: w_scale must be float32 of 1 or {rows} values")
    packed = packed.reshape(-1).view(torch.uint8)
    if packed.numel() * 2 < rows * cols:
        raise ValueError(f"bnb4_dequantize_scaled: {packed.numel()} packed bytes hold fewer than {rows} x {cols} values")
    nested = layout.absmax2 is not None
    on_interpreter = packed.device.type == "cpu"
    if tile is not None:
        block_n, block_kb, warps = tile
    elif on_interpreter:
        block_n, block_kb, warps = 16, 16, 4
    else:
        # the fastest of nine tiles in both layouts (bench/bench_int4.py --fp8-tiles)
        block_n, block_kb, warps = 64, 64, 4
    from .bnb4_kernels import DEQUANTIZE_SCALED  # Triton loads on first use

    DEQUANTIZE_SCALED(((rows + block_n - 1) // block_n, (cols // 2 + block_kb - 1) // block_kb),
                      packed, layout.absmax, layout.code,
                      layout.absmax2 if nested else layout.absmax, layout.code2 if nested else layout.code,
                      layout.offset if nested else layout.code, w_scale, out, rows, cols,
                      BLOCKSIZE=layout.blocksize, BLOCKSIZE2=layout.blocksize2 if nested else 1, NESTED=nested,
                      ROW_SCALE=w_scale.numel() > 1 and rows > 1, TRANSPOSE=transpose,
                      CLAMP=_FP8_MAX.get(out.dtype, 0.0), TO_FP8=out.dtype in _FP8_MAX,
                      INDEX_64=rows * cols >= 2**31, BLOCK_N=block_n, BLOCK_KB=block_kb, num_warps=warps)
    return out
