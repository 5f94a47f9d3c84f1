"""Triton kernel of ``sits_lora.ops.bnb4_dequant`` (bitsandbytes' 4-bit layout into a dense W), with its direct
launcher (``launch.TritonLauncher``)."""

import triton
import triton.language as tl

from .launch import TritonLauncher


@triton.jit
def bnb4_dequantize_kernel(
    packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr, n_bytes, numel,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, BLOCK_BYTES: tl.constexpr,
):
    """out[0 : numel] = code[nibble] * scale of the nibble's block, the even element from the high nibble."""
    pid = tl.program_id(0)
    offs = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    block = (offs * 2) // BLOCKSIZE                    # both codes of a byte share it: BLOCKSIZE is even
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = (tl.load(code2_ptr + q, mask=mask, other=0.0)
                 * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0.0)
                 + tl.load(offset_ptr))
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0).to(tl.float32)
    high = tl.load(code_ptr + (byte >> 4), mask=mask, other=0.0) * scale
    low = tl.load(code_ptr + (byte & 0xF), mask=mask, other=0.0) * scale
    values = tl.interleave(high, low)                  # (2 * BLOCK_BYTES,): even element, odd element
    out_offs = pid * 2 * BLOCK_BYTES + tl.arange(0, 2 * BLOCK_BYTES)
    tl.store(out_ptr + out_offs, values.to(out_ptr.dtype.element_ty), mask=out_offs < numel)


DEQUANTIZE = TritonLauncher(bnb4_dequantize_kernel)
