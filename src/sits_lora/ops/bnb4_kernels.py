"""Triton kernel of ``sits_lora.ops.bnb4_dequant`` (bitsandbytes' 4-bit layout into a dense W), with its direct
launcher (``launch.TritonLauncher``)."""

import triton
import triton.language as tl

from .launch import TritonLauncher


@triton.jit
def _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, mask, BLOCKSIZE2: tl.constexpr,
                 NESTED: tl.constexpr):
    """The fp32 scale of each block: absmax, or with double quantization code2[byte] · absmax2 + offset."""
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        scale = (tl.load(code2_ptr + q, mask=mask, other=0.0)
                 * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=mask, other=0.0)
                 + tl.load(offset_ptr))
    else:
        scale = tl.load(absmax_ptr + block, mask=mask, other=0.0).to(tl.float32)
    return scale


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
    scale = _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, mask, BLOCKSIZE2, NESTED)
    high = tl.load(code_ptr + (byte >> 4), mask=mask, other=0.0) * scale
    low = tl.load(code_ptr + (byte & 0xF), mask=mask, other=0.0) * scale
    values = tl.interleave(high, low)                  # (2 * BLOCK_BYTES,): even element, odd element
    out_offs = pid * 2 * BLOCK_BYTES + tl.arange(0, 2 * BLOCK_BYTES)
    tl.store(out_ptr + out_offs, values.to(out_ptr.dtype.element_ty), mask=out_offs < numel)


DEQUANTIZE = TritonLauncher(bnb4_dequantize_kernel)


@triton.jit
def bnb4_dequantize_scaled_kernel(
    packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, wscale_ptr, out_ptr, N, K,
    BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, ROW_SCALE: tl.constexpr,
    TRANSPOSE: tl.constexpr, CLAMP: tl.constexpr, TO_FP8: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    """W (N, K) times wscale (one value, or one per row with ROW_SCALE) into out: (N, K), or (K, N) with TRANSPOSE.

    Each program forms a tile of BLOCK_N rows x 2·BLOCK_KB columns from BLOCK_KB bytes of each row (K even: a row
    starts on a byte). CLAMP: values clipped to +-CLAMP before the cast (fp8 saturates instead of overflowing);
    TO_FP8 rounds to nearest-even, as the fp8 casts of ``sits_lora.ops.fp8`` do. INDEX_64: W has 2**31 values or
    more (64-bit offsets; below that, 32-bit ones: the block index is a division per value, 64-bit division is slow).
    The products run in the reference's order (code · block scale, then · wscale): fp32 rounds alike.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = pid_k * BLOCK_KB + tl.arange(0, BLOCK_KB)                        # byte column within the row
    row_ok = rows < N
    ok = row_ok[:, None] & (kb[None, :] < K // 2)
    if INDEX_64:
        byte_index = rows[:, None].to(tl.int64) * (K // 2) + kb[None, :]
    else:
        byte_index = rows[:, None] * (K // 2) + kb[None, :]
    byte = tl.load(packed_ptr + byte_index, mask=ok, other=0).to(tl.int32)
    block = byte_index // (BLOCKSIZE // 2)                                # both codes of a byte share it
    scale = _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, ok, BLOCKSIZE2, NESTED)
    high = tl.load(code_ptr + (byte >> 4), mask=ok, other=0.0) * scale
    low = tl.load(code_ptr + (byte & 0xF), mask=ok, other=0.0) * scale
    values = tl.interleave(high, low)                                     # (BLOCK_N, 2·BLOCK_KB)
    if ROW_SCALE:
        values = values * tl.load(wscale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    else:
        values = values * tl.load(wscale_ptr)
    if CLAMP > 0:
        values = tl.minimum(tl.maximum(values, -CLAMP), CLAMP)
    if TO_FP8:
        values = values.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        values = values.to(out_ptr.dtype.element_ty)
    cols = pid_k * 2 * BLOCK_KB + tl.arange(0, 2 * BLOCK_KB)
    out_ok = row_ok[:, None] & (cols[None, :] < K)
    if INDEX_64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    if TRANSPOSE:
        tl.store(out_ptr + cols[:, None] * N + rows[None, :], tl.trans(values), mask=tl.trans(out_ok))
    else:
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], values, mask=out_ok)


DEQUANTIZE_SCALED = TritonLauncher(bnb4_dequantize_scaled_kernel)
