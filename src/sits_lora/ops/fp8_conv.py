"""fp8 2-D convolution for inference: an implicit-GEMM Triton kernel over e4m3 inputs and weights.

torch has no fp8 convolution (cuDNN's are bf16 / fp16): a diffusion U-Net's 3x3 convolutions and a
VAE decoder's stay at half the tensor cores' fp8 rate. This kernel runs one as a GEMM without materializing the
patches: output pixels are the rows (M = batch · H_out · W_out), output channels the columns (N = C_out), and the
reduction runs over the taps and the input channels (K = KH · KW · C_in), the A tile of a (tap, channel block) read
straight from the input at the tap's offset, zero where the tap falls in the padding.

Notation: x8 (B, C, H, W) e4m3 codes of x · x_scale (any strides; channels_last reads each tile's channels
contiguously, the layout it is fast in), w8 (C_out, KH, KW, C_in) e4m3 codes with one dequantization factor per
output channel (``w_inv``), so

    y[b, n, oh, ow] = x_inv · w_inv[n] · Σ_{kh, kw, c} x8[b, c, oh·s - p + kh, ow·s - p + kw] · w8[n, kh, kw, c] + bias[n]

accumulated in fp32, rounded once to the output dtype, written channels_last. Stride and padding are the same on
both axes; no dilation, no groups (what diffusion U-Nets and VAEs use). The kernel is dtype-generic: the same code
runs fp16 / fp32 codes on the Triton interpreter, which is how CPU tests check its indexing; fp8 numerics are
checked on the GPU against ``conv2d_fp8_reference``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

__all__ = ["conv2d_fp8", "conv2d_fp8_op", "conv2d_fp8_reference", "conv_config", "conv_k_block", "pack_conv_weight",
           "unpack_conv_weight"]


def pack_conv_weight(weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, KH, KW) -> (C_out, KH · KW · C_in) contiguous: the reduction dimension K-major, the order
    (kh, kw, c) the kernel walks, so each K block is one tap's run of input channels."""
    c_out = weight.shape[0]
    return weight.permute(0, 2, 3, 1).reshape(c_out, -1).contiguous()


def unpack_conv_weight(w_packed: torch.Tensor, kernel_size: tuple[int, int]) -> torch.Tensor:
    """The inverse of ``pack_conv_weight``: (C_out, KH · KW · C_in) -> (C_out, C_in, KH, KW)."""
    kh, kw = kernel_size
    return w_packed.reshape(w_packed.shape[0], kh, kw, -1).permute(0, 3, 1, 2)


def conv_k_block(c_in: int) -> int:
    """The largest K block (128, 64, 32 or 16) that divides C_in: a block never straddles two taps. 0 if none does (the
    caller keeps such a convolution in its dtype; fp8 tensor cores take K in multiples of 16 anyway)."""
    for block in (128, 64, 32, 16):
        if c_in % block == 0:
            return block
    return 0


@triton.jit
def _conv2d_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, x_inv_ptr, w_inv_ptr,
                   M, N, C, H, W, HO, WO,
                   sxb, sxc, sxh, sxw, syb, syc, syh, syw,
                   STRIDE: tl.constexpr, PAD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share their column tiles of W while those are in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    hw = HO * WO
    b = offs_m // hw
    rem = offs_m - b * hw
    oh = rem // WO
    ow = rem - oh * WO
    ih0 = oh * STRIDE - PAD
    iw0 = ow * STRIDE - PAD
    x_rows = x_ptr + b.to(tl.int64) * sxb
    offs_k = tl.arange(0, BLOCK_K)
    K = KH * KW * C
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one loop over K = (tap, channel block); BLOCK_K divides C, so a block lies in one tap
    for k0 in range(0, K, BLOCK_K):
        tap = k0 // C
        c0 = k0 - tap * C
        kh = tap // KW
        kw = tap - kh * KW
        ih = ih0 + kh
        iw = iw0 + kw
        inside = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a_ptrs = x_rows[:, None] + (ih * sxh + iw * sxw)[:, None] + (c0 + offs_k)[None, :] * sxc
        a = tl.load(a_ptrs, mask=inside[:, None], other=0.0)
        w_tile = tl.load(w_cols + (k0 + offs_k)[:, None], mask=mask_n[None, :], other=0.0)
        acc = tl.dot(a, w_tile, acc)

    scale = tl.load(x_inv_ptr) * tl.load(w_inv_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc * scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = (y_ptr + (b.to(tl.int64) * syb + oh * syh + ow * syw)[:, None] + offs_n[None, :] * syc)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 2, "num_warps": 1, "num_stages": 1}


def conv_config(m: int, block_k: int) -> dict:
    """The tile for M output pixels and K blocks of ``block_k`` on Hopper, from the fastest of ten configurations
    timed per shape at SDXL's U-Net and VAE convolutions (bench/fp8_conv.py): 128 x 128 tiles from
    16k pixels up (the VAE, the U-Net's 128² level), 64 x 128 below (the U-Net's 64² and 32² levels, where 128-row
    tiles leave SMs idle)."""
    wide = m >= 16384
    if block_k >= 128:
        return {"BLOCK_M": 128 if wide else 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
                "num_warps": 8 if wide else 4, "num_stages": 3}
    return {"BLOCK_M": 128 if wide else 64, "BLOCK_N": 128, "BLOCK_K": block_k, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 4}


def _output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def conv2d_fp8(x8: torch.Tensor, w_packed: torch.Tensor, x_inv: torch.Tensor, w_inv: torch.Tensor,
               bias: Optional[torch.Tensor], kernel_size: tuple[int, int], stride: int, padding: int,
               out_dtype: torch.dtype, config: Optional[dict] = None) -> torch.Tensor:
    """y = conv2d(x8 · x_inv, w8 · w_inv) + bias in ``out_dtype`` (channels_last), by the Triton kernel.

    x8 (B, C_in, H, W) codes (fp8 on the GPU), w_packed (C_out, KH · KW · C_in) from ``pack_conv_weight``, x_inv
    fp32 (1,), w_inv fp32 (C_out,), bias (C_out,) or None. C_in must be a multiple of 16 (``conv_k_block``)."""
    batch, c_in, height, width = x8.shape
    kh, kw = kernel_size
    c_out = w_packed.shape[0]
    if w_packed.shape[1] != kh * kw * c_in:
        raise ValueError(f"conv2d_fp8: packed weight has {w_packed.shape[1]} columns, expected KH·KW·C_in = "
                         f"{kh}·{kw}·{c_in}")
    block_k = conv_k_block(c_in)
    if not block_k:
        raise ValueError(f"conv2d_fp8: C_in={c_in} is not a multiple of 16; keep this convolution in bf16")
    ho, wo = _output_size(height, kh, stride, padding), _output_size(width, kw, stride, padding)
    y = torch.empty((batch, c_out, ho, wo), device=x8.device, dtype=out_dtype, memory_format=torch.channels_last)
    if y.numel() == 0:
        return y
    m = batch * ho * wo
    cfg = dict(config or (INTERPRETER_CONFIG if not x8.is_cuda else conv_config(m, block_k)))
    cfg["BLOCK_K"] = min(cfg.pop("BLOCK_K", block_k), block_k)
    if c_in % cfg["BLOCK_K"]:
        raise ValueError(f"conv2d_fp8: BLOCK_K={cfg['BLOCK_K']} does not divide C_in={c_in}")

    def launch(cfg: dict) -> None:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(c_out, cfg["BLOCK_N"]),)
        _conv2d_kernel[grid](
            x8, w_packed, y, bias if bias is not None else w_inv, x_inv, w_inv,
            m, c_out, c_in, height, width, ho, wo,
            *x8.stride(), *y.stride(),
            STRIDE=stride, PAD=padding, KH=kh, KW=kw, HAS_BIAS=bias is not None, **cfg,
        )

    try:
        launch(cfg)
    except OutOfResources:
        if config is not None:
            raise
        # the Hopper tiles' 3 stages of 128 x 128 fp8 tiles need ~100 KB of shared memory; Ada's SMs offer 99 KB
        launch({**cfg, "BLOCK_M": 64, "BLOCK_K": min(cfg["BLOCK_K"], 64), "num_warps": 4, "num_stages": 2})
    return y


def conv2d_fp8_reference(x8: torch.Tensor, w8: torch.Tensor, x_inv: torch.Tensor, w_inv: torch.Tensor,
                         bias: Optional[torch.Tensor], stride: int, padding: int,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """The same result in plain PyTorch: codes dequantized to fp32, F.conv2d in fp32, rounded once.
    w8 (C_out, C_in, KH, KW) unpacked."""
    x = x8.float() * x_inv.float()
    w = w8.float() * w_inv.float().reshape(-1, 1, 1, 1)
    y = torch.nn.functional.conv2d(x, w, None if bias is None else bias.float(), stride=stride, padding=padding)
    return y.to(out_dtype).contiguous(memory_format=torch.channels_last)


@torch.library.custom_op("sits_lora::conv2d_fp8", mutates_args=())
def conv2d_fp8_op(x8: torch.Tensor, w_packed: torch.Tensor, x_inv: torch.Tensor, w_inv: torch.Tensor,
                  bias: Optional[torch.Tensor], kh: int, kw: int, stride: int, padding: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """``conv2d_fp8`` as one opaque operator for torch.compile and CUDA graphs (the Triton kernel on a GPU; on the
    CPU the reference, which emulates the same numerics)."""
    if x8.is_cuda:
        return conv2d_fp8(x8, w_packed, x_inv, w_inv, bias, (kh, kw), stride, padding, out_dtype)
    return conv2d_fp8_reference(x8, unpack_conv_weight(w_packed, (kh, kw)), x_inv, w_inv, bias, stride, padding,
                                out_dtype)


@conv2d_fp8_op.register_fake
def _conv2d_fp8_fake(x8, w_packed, x_inv, w_inv, bias, kh, kw, stride, padding, out_dtype):
    batch, _, height, width = x8.shape
    shape = (batch, w_packed.shape[0], _output_size(height, kh, stride, padding),
             _output_size(width, kw, stride, padding))
    return torch.empty(shape, device=x8.device, dtype=out_dtype, memory_format=torch.channels_last)
