"""Triton kernels of the INT4 base (``sits_lora.ops.int4_linear`` holds the format and the launchers): the
dequantization into a dense W, and the GEMMs that read W packed and dequantize it in registers, each with its
direct launcher (``launch.TritonLauncher``: a fraction of ``kernel[grid]``'s host time per call)."""

import triton
import triton.language as tl

from .launch import TritonLauncher


@triton.jit
def _load_w_tile(packed_ptr, scales_ptr, mins_ptr, n_idx, k_start, N, K_PACKED_BYTES, GROUPS,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[n_idx, k_start : k_start + BLOCK_K] (BLOCK_N, BLOCK_K) fp32, dequantized in registers.

    BLOCK_K divides GROUP and k_start is a multiple of BLOCK_K: one (scale, min) per row of the tile."""
    byte_offs = k_start // 2 + tl.arange(0, BLOCK_K // 2)
    n_mask = n_idx < N
    b = tl.load(packed_ptr + n_idx[:, None] * K_PACKED_BYTES + byte_offs[None, :],
                mask=n_mask[:, None], other=0)                                          # (BN, BK/2) uint8
    lo = (b & 0xF).to(tl.float32)
    hi = (b >> 4).to(tl.float32)
    q = tl.interleave(lo, hi)                                                           # (BN, BK) even, odd
    group = k_start // GROUP
    s = tl.load(scales_ptr + n_idx * GROUPS + group, mask=n_mask, other=0.0).to(tl.float32)
    m = tl.load(mins_ptr + n_idx * GROUPS + group, mask=n_mask, other=0.0).to(tl.float32)
    return q * s[:, None] + m[:, None]


@triton.jit
def int4_matmul_nt_kernel(
    a_ptr, packed_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, K, K_PADDED, K_PACKED_BYTES, GROUPS,
    ACCUMULATE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out (M, N) (+)= a (M, K) Wᵀ, W read packed."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m_idx < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K_PADDED, BLOCK_K):
        k_idx = k_start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + m_idx[:, None] * K + k_idx[None, :], mask=m_mask[:, None] & (k_idx[None, :] < K),
                    other=0.0)
        w = _load_w_tile(packed_ptr, scales_ptr, mins_ptr, n_idx, k_start, N, K_PACKED_BYTES, GROUPS,
                         GROUP, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PRECISION)
    out_offs = m_idx[:, None] * N + n_idx[None, :]
    mask = m_mask[:, None] & (n_idx[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(out_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def int4_matmul_nn_kernel(
    a_ptr, packed_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, K, K_PACKED_BYTES, GROUPS,
    ACCUMULATE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out (M, K) (+)= a (M, N) W, W (N, K) read packed."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = pid_k * BLOCK_K
    k_idx = k_start + tl.arange(0, BLOCK_K)
    m_mask = m_idx < M
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n_start in range(0, N, BLOCK_N):
        n_idx = n_start + tl.arange(0, BLOCK_N)
        a = tl.load(a_ptr + m_idx[:, None] * N + n_idx[None, :], mask=m_mask[:, None] & (n_idx[None, :] < N),
                    other=0.0)
        w = _load_w_tile(packed_ptr, scales_ptr, mins_ptr, n_idx, k_start, N, K_PACKED_BYTES, GROUPS,
                         GROUP, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    out_offs = m_idx[:, None] * K + k_idx[None, :]
    mask = m_mask[:, None] & (k_idx[None, :] < K)
    if ACCUMULATE:
        acc += tl.load(out_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def int4_dequantize_kernel(
    packed_ptr, scales_ptr, mins_ptr, out_ptr, N, K, K_PACKED_BYTES, GROUPS,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out (N, K) = W, dequantized."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * BLOCK_K
    k_idx = k_start + tl.arange(0, BLOCK_K)
    w = _load_w_tile(packed_ptr, scales_ptr, mins_ptr, n_idx, k_start, N, K_PACKED_BYTES, GROUPS,
                     GROUP, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + n_idx[:, None] * K + k_idx[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(n_idx[:, None] < N) & (k_idx[None, :] < K))


DEQUANTIZE = TritonLauncher(int4_dequantize_kernel)
MATMUL_NT = TritonLauncher(int4_matmul_nt_kernel)
MATMUL_NN = TritonLauncher(int4_matmul_nn_kernel)
