"""Triton kernels for the LoRA linear layer, and their launchers: the building blocks that the ops
(``linear``, ``siblings``, ``dynamic_rank``, ``fp8``) drive.

Notation as in ``reference``: x (T, K) the input, W (N, K) the frozen weight, A (R, K), B (N, R),
s the scaling, h = x Aᵀ (T, R), g = dy B (T, R). R is the LoRA rank (or the summed ranks of
sibling layers that share x).

Where the time goes. The base layer's two GEMMs (forward x Wᵀ, backward dy W) are compute-bound
and are the floor. The LoRA arithmetic is 2·R·(K+N)/(K·N) of it (under 1 % at R=16, K=N=4096);
what costs is every extra pass over x (T·K), dy and the output (T·N). The kernels here make the
fewest passes we know how to make:

    forward   shrink: one read of x -> h.  Then one of two GEMM paths:
              "triton": a GEMM whose epilogue adds s·h Bᵀ (+ bias) to each output tile: no extra
                        pass over the output at all.
              "cublas": expand writes C = s·h Bᵀ + bias once, cuBLAS computes C += x Wᵀ in place
                        (its epilogue reads C): one write and one read of the output.
    backward  dy pass: one read of dy -> g and dB (partial sums per token block, no atomics, so
                        results are deterministic).
              dX:      "triton": GEMM dy W with epilogue s·g A.  "cublas": the x pass writes
                        s·g A, cuBLAS adds dy W in place.
              x pass:  one read of x -> dA (and, for "cublas" or with dropout, s·g A).

Every kernel accumulates in fp32 and loads fp32 master adapter weights, casting them to the
activation dtype for the tensor-core dot (bf16/fp16) or keeping fp32 ("ieee") for fp32 inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import tuning
from .launch import TritonLauncher

# ----------------------------------------------------------------------------- helpers


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host integers (grids, splits).

    Not triton.cdiv: newer Triton makes it a ConstexprFunction whose host call costs microseconds,
    and a layer step computes a dozen of these on the path that issues its kernels.
    """
    return -(-a // b)


def block_rank(r: int) -> int:
    """The rank block the kernels run rank ``r`` at (the R in the tuning cache's dims)."""
    # tl.dot needs every dimension >= 16; ranks that are not powers of two are masked.
    return max(16, 1 << (r - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 activations: exact fp32 products (the interpreter tests compare at 1e-5);
    # bf16 / fp16: the inputs are cast to the activation dtype, precision flag unused.
    return "ieee" if dtype == torch.float32 else "tf32"


def _split(length: int, block: int, other_programs: int, target_programs: int) -> tuple[int, int]:
    """(splits, per_split): cut ``length`` into whole blocks so that splits x other_programs is
    about ``target_programs`` (enough programs to keep every SM streaming), at least one split."""
    splits = max(1, min(cdiv(length, block), cdiv(target_programs, other_programs)))
    per_split = cdiv(cdiv(length, splits), block) * block
    return cdiv(length, per_split), per_split


# The launch geometry of each kernel at a shape is remembered (tuning.remember): a layer launches at the same few
# shapes step after step, and recomputing blocks, grids and splits is host time on the path that issues its kernels.
# A configuration passed in (tests, tuning) is used as given and not remembered.

def _grid_geometry(kernel: str, device, T: int, width: int, R: int, dtype, config: Optional[dict]) -> tuple:
    """(config, grid, BLOCK_R, dot precision) of the shrink (width K) or the expand (width N)."""
    key = (kernel, device, T, width, R, dtype)
    found = None if config else tuning.remembered(key)
    if found is None:
        BLOCK_R = block_rank(R)
        cfg = config or tuning.config_for(kernel, device, (width, BLOCK_R), dtype)
        t_blocks = cdiv(T, cfg["BLOCK_T"])
        grid = (t_blocks,) if kernel == "shrink" else (t_blocks, cdiv(width, cfg["BLOCK_N"]))
        found = (cfg, grid, BLOCK_R, dot_precision(dtype))
        if not config:
            tuning.remember(key, found)
    return found


def _split_geometry(kernel: str, device, T: int, width: int, R: int, dtype, config: Optional[dict]) -> tuple:
    """(config, grid, BLOCK_R, dot precision, per split) of the dy pass (width N, split along N) or the x pass
    (width K, split along T)."""
    key = (kernel, device, T, width, R, dtype)
    found = None if config else tuning.remembered(key)
    if found is None:
        BLOCK_R = block_rank(R)
        cfg = config or tuning.config_for(kernel, device, (width, BLOCK_R), dtype)
        if kernel == "dy_pass":
            # About two programs per SM of a Hopper GPU (132 SMs): split N when there are few token blocks.
            t_blocks = cdiv(T, cfg["BLOCK_T"])
            splits, per_split = _split(width, cfg["BLOCK_N"], t_blocks, 264)
            grid = (t_blocks, splits)
        else:
            # About four programs per SM in all, each summing its own token range: a few partial sums of dA instead
            # of one per token block.
            k_blocks = cdiv(width, cfg["BLOCK_K"])
            splits, per_split = _split(T, cfg["BLOCK_T"], k_blocks, 528)
            grid = (splits, k_blocks)
        found = (cfg, grid, BLOCK_R, dot_precision(dtype), per_split)
        if not config:
            tuning.remember(key, found)
    return found


# ----------------------------------------------------------------------------- shrink: h = x Aᵀ


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, h_full_ptr, limit_ptr,
    T, K, R,
    stride_xt, stride_xk, stride_ar, stride_ak, stride_ht, stride_hr,
    HAS_LIMIT: tl.constexpr, WRITE_FULL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h = x Aᵀ; with HAS_LIMIT h[t, r] = 0 for r >= limit[t] (and the unlimited h to h_full with
    WRITE_FULL, same strides), so that the passes after it run the static kernels unchanged."""
    pid_t = tl.program_id(0)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + k[None, :] * stride_xk,
                    mask=(offs_t[:, None] < T) & (k[None, :] < K), other=0.0)             # (BT, BK)
        a = tl.load(a_ptr + k[:, None] * stride_ak + offs_r[None, :] * stride_ar,
                    mask=(k[:, None] < K) & (offs_r[None, :] < R), other=0.0)             # (BK, BR)
        acc = tl.dot(x, a.to(x.dtype), acc, input_precision=DOT_PRECISION)
    out = offs_t[:, None] * stride_ht + offs_r[None, :] * stride_hr
    ok = (offs_t[:, None] < T) & (offs_r[None, :] < R)
    if HAS_LIMIT:
        if WRITE_FULL:
            tl.store(h_full_ptr + out, acc, mask=ok)
        limit = tl.load(limit_ptr + offs_t, mask=offs_t < T, other=0)
        acc = tl.where(offs_r[None, :] < limit[:, None], acc, 0.0)
    tl.store(h_ptr + out, acc, mask=ok)


def lora_shrink(x: torch.Tensor, lora_A: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """h = x Aᵀ in fp32. x (T, K) any strides, A (R, K)."""
    return _shrink(x, lora_A, config, None, False)[0]


def lora_shrink_limited(x: torch.Tensor, lora_A: torch.Tensor, rank_limit: torch.Tensor, keep_full: bool,
                        config: Optional[dict] = None) -> tuple:
    """(h limited, h or None) in fp32: h = x Aᵀ with h[t, r] = 0 for r >= rank_limit[t] ((T,) int32), and
    the unlimited h as well when ``keep_full`` (the router's gradient reads it beyond each limit)."""
    return _shrink(x, lora_A, config, rank_limit, keep_full)


_SHRINK = TritonLauncher(_lora_shrink_kernel)


def _shrink(x, lora_A, config, rank_limit, keep_full):
    T, K = x.shape
    R = lora_A.shape[0]
    h = torch.empty((T, R), device=x.device, dtype=torch.float32)
    h_full = torch.empty_like(h) if rank_limit is not None and keep_full else None
    cfg, grid, BLOCK_R, precision = _grid_geometry("shrink", x.device, T, K, R, x.dtype, config)
    _SHRINK(grid,
        x, lora_A, h, h_full if h_full is not None else h, rank_limit if rank_limit is not None else h, T, K, R,
        *x.stride(), *lora_A.stride(), R, 1,  # h is fresh: contiguous
        HAS_LIMIT=rank_limit is not None, WRITE_FULL=h_full is not None,
        BLOCK_R=BLOCK_R, DOT_PRECISION=precision, **cfg,
    )
    return h, h_full


# ----------------------------------------------------------------------------- expand: C = s·h Bᵀ + bias


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, bias_ptr, c_ptr, limit_ptr, order_ptr,
    T, N, R, scale, H_PARTS,
    stride_ht, stride_hr, stride_hp, stride_bn, stride_br, stride_ct, stride_cn,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_LIMIT: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C = s·h Bᵀ + bias, or C += s·h Bᵀ + bias with ACCUMULATE (one read and one write of C).

    HAS_LIMIT (per-token rank): token t uses the first limit[t] columns of h only. A block whose
    largest limit is below R runs the 16-wide rank tiles up to it, skipping the rest; a block with a
    token at the full rank runs one full-width dot, as the static kernel does (four 16-wide dots in
    a loop instead cost a visible share of the whole layer). The limit is applied by a select after a
    load under the static kernel's mask, not as the load's mask: a mask that varies along the contiguous
    rank axis can keep the compiler from vectorizing the load (as the load's mask, the expand ran
    clearly slower than the static one; docs/dynamic-rank.md). dynamic_rank_forward
    passes the limit only with grouped tokens: in token order h comes limited from the shrink.
    GROUPED: the block's tokens are order[block's range] (tokens sorted by limit), so that most
    blocks hold one limit and skip every tile above it. Without a limit, h may arrive as H_PARTS partial
    sums stride_hp apart (the dy pass's g partials, for the fp8 backward's s·g A), added as loaded.
    """
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < T
    rows = offs_t
    if GROUPED:
        rows = tl.load(order_ptr + offs_t, mask=t_ok, other=0)
    if HAS_LIMIT:
        limit = tl.load(limit_ptr + rows, mask=t_ok, other=0)                                # (BT,)
        r_hi = tl.max(limit, 0)
        if r_hi >= R:
            offs_r = tl.arange(0, BLOCK_R)
            h = tl.load(h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                        mask=t_ok[:, None] & (offs_r[None, :] < R), other=0.0)              # (BT, BR) fp32
            h = tl.where(offs_r[None, :] < limit[:, None], h, 0.0)
            b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                        mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)     # (BR, BN)
            acc = tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, r_hi, 16):
                offs_r = r0 + tl.arange(0, 16)
                h = tl.load(h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                            mask=t_ok[:, None] & (offs_r[None, :] < R), other=0.0)          # (BT, 16) fp32
                h = tl.where(offs_r[None, :] < limit[:, None], h, 0.0)
                b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                            mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)     # (16, BN)
                acc = tl.dot(h, b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        acc = acc * scale
    else:
        offs_r = tl.arange(0, BLOCK_R)
        h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_r[None, :] * stride_hr
        h_ok = t_ok[:, None] & (offs_r[None, :] < R)
        h = tl.load(h_ptrs, mask=h_ok, other=0.0)                                          # (BT, BR) fp32
        for part in range(1, H_PARTS):
            h += tl.load(h_ptrs + part * stride_hp, mask=h_ok, other=0.0)
        b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                    mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)        # (BR, BN)
        acc = tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION) * scale
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = t_ok[:, None] & (offs_n[None, :] < N)
    c_ptrs = c_ptr + rows[:, None] * stride_ct + offs_n[None, :] * stride_cn
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


_EXPAND = TritonLauncher(_lora_expand_kernel)


def lora_expand(h: torch.Tensor, lora_B: torch.Tensor, scale: float, bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, config: Optional[dict] = None, add_to: Optional[torch.Tensor] = None,
                rank_limit: Optional[torch.Tensor] = None, token_order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """C = s·h Bᵀ + bias in out_dtype; with ``add_to``, add into that (T, N) tensor in place and return it.
    h (T, R) fp32, or its partial sums (P, T, R) (no rank_limit then), B (N, R). ``rank_limit`` (T,) int32:
    token t uses h[t, :rank_limit[t]] only; ``token_order`` (T,) int32, a permutation: blocks take their
    tokens in that order (see the kernel)."""
    h_parts = h.shape[0] if h.dim() == 3 else 1
    T, R = h.shape[-2:]
    N = lora_B.shape[0]
    c = torch.empty((T, N), device=h.device, dtype=out_dtype) if add_to is None else add_to
    cfg, grid, BLOCK_R, precision = _grid_geometry("expand", h.device, T, N, R, out_dtype, config)
    _EXPAND(grid,
        h, lora_B, bias if bias is not None else h, c,
        rank_limit if rank_limit is not None else h, token_order if token_order is not None else h,
        T, N, R, scale, h_parts,
        *h.stride()[-2:], h.stride(0) if h_parts > 1 else 0, *lora_B.stride(), *c.stride(),
        HAS_BIAS=bias is not None, ACCUMULATE=add_to is not None, HAS_LIMIT=rank_limit is not None,
        GROUPED=token_order is not None, BLOCK_R=BLOCK_R,
        DOT_PRECISION=precision, **cfg,
    )
    return c


# ----------------------------------------------------------------------------- GEMM + low-rank epilogue


@triton.jit
def _lora_gemm_kernel(
    a_ptr, b_ptr, out_ptr, l_ptr, r_ptr, bias_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K, R, scale,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
    stride_lm, stride_lr, stride_rr, stride_rn,
    HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out = (a b)·[a_scale·b_scale] + s·L Rw + bias; a (M, K), b (K, N), L (M, R) fp32, Rw (R, N).

    HAS_SCALES: a and b are fp8 codes and the base product is dequantized by the two per-tensor scales
    (fp32 (1,) each) before the epilogue (ops.fp8.triton_fp8_matmul)."""
    # 1. tile order grouped along M so that consecutive programs reuse b tiles in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # 2. the base product
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_SCALES:
        acc = acc * tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
    # 3. epilogue: the low-rank term and the bias, added while the tile is in registers
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        lo = tl.load(l_ptr + offs_m[:, None] * stride_lm + offs_r[None, :] * stride_lr,
                     mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0.0)
        ro = tl.load(r_ptr + offs_r[:, None] * stride_rr + offs_n[None, :] * stride_rn,
                     mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)
        # accumulate into acc: a separate (BLOCK_M, BLOCK_N) product would double the registers
        acc = tl.dot(lo.to(tl.float32) * scale, ro.to(tl.float32), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_GEMM = TritonLauncher(_lora_gemm_kernel)


def _gemm_config(M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)
    # Hopper-sized tiles for bf16 / fp16; `sits-lora compile` can tune them per shape.
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def lora_gemm(a: torch.Tensor, b: torch.Tensor, lora_left: Optional[torch.Tensor], lora_right: Optional[torch.Tensor],
              scale: float, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
              config: Optional[dict] = None, scales: Optional[tuple] = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) + s·L (M, R) @ Rw (R, N) + bias, any strides, out (M, N) contiguous.

    ``scales`` (a_inv, b_inv): fp32 (1,) tensors multiplying a @ b (fp8 a and b, see ops.fp8)."""
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), device=a.device, dtype=out_dtype)
    cfg = dict(config or _gemm_config(M, N, K, a.dtype))
    has_lora = lora_left is not None
    R = lora_left.shape[1] if has_lora else 0
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    dummy = a
    _GEMM(grid,
        a, b, out, lora_left if has_lora else dummy, lora_right if has_lora else dummy,
        bias if bias is not None else dummy,
        scales[0] if scales is not None else dummy, scales[1] if scales is not None else dummy,
        M, N, K, R, scale,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        lora_left.stride(0) if has_lora else 0, lora_left.stride(1) if has_lora else 0,
        lora_right.stride(0) if has_lora else 0, lora_right.stride(1) if has_lora else 0,
        HAS_LORA=has_lora, HAS_BIAS=bias is not None, HAS_SCALES=scales is not None, BLOCK_R=block_rank(max(R, 1)),
        DOT_PRECISION=dot_precision(a.dtype), **cfg,
    )
    return out


# ----------------------------------------------------------------------------- backward: the dy pass


@triton.jit
def _lora_dy_pass_kernel(
    dy_ptr, b_ptr, h_ptr, g_part_ptr, db_part_ptr,
    T, N, R, N_PER_SPLIT, scale, g_scale,
    stride_dyt, stride_dyn, stride_bn, stride_br, stride_ht, stride_hr, stride_gs, stride_gt,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One read of dy: g partials (per N split) and dB partials (per token block).

    g_part[split, t, r]   = g_scale · Σ_{n in split} dy[t, n] B[n, r]   (a split past N writes zeros)
    db_part[tblock, n, r] = s · Σ_{t in tblock} dy[t, n] h[t, r]
    """
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    offs_nb = tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + offs_t[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                mask=(offs_t[:, None] < T) & (offs_r[None, :] < R), other=0.0) * scale   # (BT, BR) fp32
    g = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    n_start = pid_s * N_PER_SPLIT
    n_stop = tl.minimum(n_start + N_PER_SPLIT, N)
    for n0 in range(n_start, n_stop, BLOCK_N):
        n = n0 + offs_nb
        n_ok = n < n_stop
        dy = tl.load(dy_ptr + offs_t[:, None] * stride_dyt + n[None, :] * stride_dyn,
                     mask=(offs_t[:, None] < T) & n_ok[None, :], other=0.0)               # (BT, BN)
        b = tl.load(b_ptr + n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                    mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0)                # (BN, BR)
        g = tl.dot(dy, b.to(dy.dtype), g, input_precision=DOT_PRECISION)
        db = tl.dot(tl.trans(dy), h.to(dy.dtype), input_precision=DOT_PRECISION)         # (BN, BR)
        tl.store(db_part_ptr + pid_t * N * R + n[:, None] * R + offs_r[None, :], db,
                 mask=n_ok[:, None] & (offs_r[None, :] < R))
    tl.store(g_part_ptr + pid_s * stride_gs + offs_t[:, None] * stride_gt + offs_r[None, :], g * g_scale,
             mask=(offs_t[:, None] < T) & (offs_r[None, :] < R))


_DY_PASS = TritonLauncher(_lora_dy_pass_kernel)


def dy_pass_splits(dy: torch.Tensor, R: int, config: Optional[dict] = None) -> int:
    """How many N splits (g partials) the dy pass makes for dy (T, N) at rank R."""
    T, N = dy.shape
    return _split_geometry("dy_pass", dy.device, T, N, R, dy.dtype, config)[1][1]


def lora_dy_pass_parts(dy: torch.Tensor, lora_B: torch.Tensor, h: torch.Tensor, scale: float,
                       config: Optional[dict] = None, g_part: Optional[torch.Tensor] = None,
                       g_scale: float = 1.0) -> tuple:
    """(g partials (S, T, R), dB partials (P, N, R)), fp32, from one read of dy: g = Σ_s g_part[s] = dy B,
    dB = Σ_p db_part[p] = s·dyᵀ h. The x pass sums the g partials as it loads them and ``sum_partials``
    sums dB's with dA's in one launch: no torch reduction between the passes.

    ``g_part``: write g's partials into this (S, T, R) view (unit stride along R; siblings pass their
    columns of one shared buffer), S splits whatever dy_pass_splits says, each scaled by ``g_scale``."""
    T, N = dy.shape
    R = h.shape[1]
    cfg, (t_blocks, splits), BLOCK_R, precision, n_per_split = _split_geometry("dy_pass", dy.device, T, N, R,
                                                                               dy.dtype, config)
    if g_part is None:
        g_part = torch.empty((splits, T, R), device=dy.device, dtype=torch.float32)
    else:
        splits = g_part.shape[0]
        n_per_split = cdiv(cdiv(N, splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    # dB partials cost (T / BLOCK_T)·N·R·4 bytes: a tall token block keeps them small against dy.
    db_part = torch.empty((t_blocks, N, R), device=dy.device, dtype=torch.float32)
    _DY_PASS((t_blocks, splits),
             dy, lora_B, h, g_part, db_part, T, N, R, n_per_split, scale, g_scale,
             *dy.stride(), *lora_B.stride(), *h.stride(), *g_part.stride()[:2],
             BLOCK_R=BLOCK_R, DOT_PRECISION=precision, **cfg)
    return g_part, db_part


def lora_dy_pass(dy: torch.Tensor, lora_B: torch.Tensor, h: torch.Tensor, scale: float, config: Optional[dict] = None):
    """(g, dB) from one read of dy: g = dy B (T, R) fp32, dB = s·dyᵀ h (N, R) fp32."""
    g_part, db_part = lora_dy_pass_parts(dy, lora_B, h, scale, config)
    return sum_leading(g_part), sum_leading(db_part)


def sum_leading(parts: torch.Tensor) -> torch.Tensor:
    return parts[0] if parts.shape[0] == 1 else parts.sum(0)


# ----------------------------------------------------------------------------- backward: the x pass


@triton.jit
def _lora_x_pass_kernel(
    x_ptr, a_ptr, g_ptr, da_part_ptr, dx_ptr,
    T, K, R, T_PER_SPLIT, G_PARTS, scale,
    stride_xt, stride_xk, stride_ar, stride_ak, stride_gs, stride_gt, stride_gr, stride_dxt, stride_dxk,
    WRITE_DX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One read of x: dA partials per token split, and optionally dx_lora = s·g A.

    g arrives as G_PARTS partial sums (g = Σ_s g[s], the dy pass's N splits), added here as they are
    loaded; the partials are small (T·R fp32 each) and stay in L2 across the K blocks.
    da_part[split, r, k] = s · Σ_{t in split} g[t, r] x[t, k]
    """
    pid_s = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    offs_tb = tl.arange(0, BLOCK_T)
    k_ok = offs_k < K
    r_ok = offs_r < R
    if WRITE_DX:
        a = tl.load(a_ptr + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)        # (BR, BK)
    da = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    t_start = pid_s * T_PER_SPLIT
    t_stop = tl.minimum(t_start + T_PER_SPLIT, T)
    for t0 in range(t_start, t_stop, BLOCK_T):
        offs_t = t0 + offs_tb
        t_ok = offs_t < t_stop
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)                        # (BT, BK)
        g_ptrs = g_ptr + offs_t[:, None] * stride_gt + offs_r[None, :] * stride_gr
        g_ok = t_ok[:, None] & r_ok[None, :]
        g = tl.load(g_ptrs, mask=g_ok, other=0.0)                                          # (BT, BR) fp32
        for part in range(1, G_PARTS):
            g += tl.load(g_ptrs + part * stride_gs, mask=g_ok, other=0.0)
        da = tl.dot(tl.trans(g.to(x.dtype)), x, da, input_precision=DOT_PRECISION)
        if WRITE_DX:
            dx = tl.dot(g, a, input_precision=DOT_PRECISION) * scale
            tl.store(dx_ptr + offs_t[:, None] * stride_dxt + offs_k[None, :] * stride_dxk,
                     dx.to(dx_ptr.dtype.element_ty), mask=t_ok[:, None] & k_ok[None, :])
    tl.store(da_part_ptr + pid_s * R * K + offs_r[:, None] * K + offs_k[None, :], da * scale,
             mask=r_ok[:, None] & k_ok[None, :])


_X_PASS = TritonLauncher(_lora_x_pass_kernel)


def lora_x_pass_parts(x: torch.Tensor, lora_A: torch.Tensor, g: torch.Tensor, scale: float, write_dx: bool,
                      config: Optional[dict] = None):
    """(dA partials (S, R, K) fp32, dx_lora or None): dA = Σ_s da_part[s] = s·gᵀ x; dx_lora = s·g A (T, K) in
    x's dtype. ``g``: (T, R), or its partial sums (P, T, R) as lora_dy_pass_parts writes them."""
    T, K = x.shape
    g_parts = g.shape[0] if g.dim() == 3 else 1
    R = g.shape[-1]
    cfg, (splits, k_blocks), BLOCK_R, precision, t_per_split = _split_geometry("x_pass", x.device, T, K, R, x.dtype,
                                                                              config)
    da_part = torch.empty((splits, R, K), device=x.device, dtype=torch.float32)
    dx = torch.empty((T, K), device=x.device, dtype=x.dtype) if write_dx else None
    g_strides = g.stride()
    _X_PASS((splits, k_blocks),
            x, lora_A, g, da_part, dx if write_dx else x,
            T, K, R, t_per_split, g_parts, scale,
            *x.stride(), *lora_A.stride(), g_strides[0] if g_parts > 1 else 0, *g_strides[-2:],
            K if write_dx else 0, 1 if write_dx else 0,  # dx is fresh: contiguous
            WRITE_DX=write_dx, BLOCK_R=BLOCK_R, DOT_PRECISION=precision, **cfg)
    return da_part, dx


def lora_x_pass(x: torch.Tensor, lora_A: torch.Tensor, g: torch.Tensor, scale: float, write_dx: bool,
                config: Optional[dict] = None):
    """(dA, dx_lora or None): dA = s·gᵀ x (R, K) fp32; dx_lora = s·g A (T, K) in x's dtype."""
    da_part, dx = lora_x_pass_parts(x, lora_A, g, scale, write_dx, config)
    return sum_leading(da_part), dx


# ----------------------------------------------------------------------------- backward: the two partial sums


@triton.jit
def _sum_stack(part_ptr, out_ptr, parts, size, block_id, BLOCK: tl.constexpr):
    offs = block_id * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = part_ptr + offs
    for _ in range(0, parts):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += size  # pointer arithmetic is 64-bit: no int32 overflow at T·N·R > 2³¹
    tl.store(out_ptr + offs, acc, mask=ok)


@triton.jit
def _sum_partials_kernel(
    p0, o0, parts0, size0, p1, o1, parts1, size1, p2, o2, parts2, size2, p3, o3, parts3, size3,
    end0, end1, end2,
    BLOCK: tl.constexpr,
):
    """out_i = Σ_p part_i[p] for up to four contiguous fp32 stacks in one launch. Programs [0, end0) sum
    stack 0, [end0, end1) stack 1, and so on; each adds its BLOCK elements in part order (deterministic)."""
    pid = tl.program_id(0)
    if pid < end0:
        _sum_stack(p0, o0, parts0, size0, pid, BLOCK)
    elif pid < end1:
        _sum_stack(p1, o1, parts1, size1, pid - end0, BLOCK)
    elif pid < end2:
        _sum_stack(p2, o2, parts2, size2, pid - end1, BLOCK)
    else:
        _sum_stack(p3, o3, parts3, size3, pid - end2, BLOCK)


_SUM_PARTIALS = TritonLauncher(_sum_partials_kernel)
_SUM_BLOCK = 256


def sum_partials(*stacks: torch.Tensor) -> list:
    """[Σ_p stack[p] for each stack]: contiguous fp32 stacks of partial sums (the dA and dB partials of a
    layer's backward, or of several siblings'), four per launch; a one-part stack is a view, no work."""
    sums = [parts[0] if parts.shape[0] == 1 else torch.empty(parts.shape[1:], device=parts.device,
                                                              dtype=torch.float32) for parts in stacks]
    pending = [(parts, out) for parts, out in zip(stacks, sums) if parts.shape[0] > 1]
    for first in range(0, len(pending), 4):
        group = pending[first:first + 4]
        args, ends, programs = [], [], 0
        for parts, out in group:
            size = out.numel()
            args += (parts, out, parts.shape[0], size)
            programs += -(-size // _SUM_BLOCK)
            ends.append(programs)
        # unused slots: no programs reach them
        args += (group[0][0], group[0][1], 0, 0) * (4 - len(group))
        ends += [programs] * (3 - len(ends))
        _SUM_PARTIALS((programs,), *args, *ends[:3], BLOCK=_SUM_BLOCK, num_warps=4, num_stages=1)
    return sums


# ----------------------------------------------------------------------------- backward: the per-token rank limit


@triton.jit
def _limit_grad_kernel(
    g_ptr, limit_ptr, g_out_ptr, h_ptr, ends_ptr, dw_ptr, T, R, K, scale,
    stride_gt, stride_gr, stride_ht, stride_hr, stride_wt, stride_wk,
    BUCKET_GRAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """g_out[t, r] = g[t, r] for r < limit[t], else 0 (g_out has g's strides); with BUCKET_GRAD also
    dw[t, k] = s · Σ_{r < ends[k]} h[t, r] g[t, r], the router's bucket-weight gradient (h unlimited)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    ok = (offs_t[:, None] < T) & (offs_r[None, :] < R)
    g_offs = offs_t[:, None] * stride_gt + offs_r[None, :] * stride_gr
    g = tl.load(g_ptr + g_offs, mask=ok, other=0.0)                                        # (BT, BR) fp32
    limit = tl.load(limit_ptr + offs_t, mask=offs_t < T, other=0)
    tl.store(g_out_ptr + g_offs, tl.where(offs_r[None, :] < limit[:, None], g, 0.0), mask=ok)
    if BUCKET_GRAD:
        h = tl.load(h_ptr + offs_t[:, None] * stride_ht + offs_r[None, :] * stride_hr, mask=ok, other=0.0)
        hg = h * g
        for k in range(0, K):
            end = tl.load(ends_ptr + k)
            total = tl.sum(tl.where(offs_r[None, :] < end, hg, 0.0), 1) * scale             # (BT,)
            tl.store(dw_ptr + offs_t * stride_wt + k * stride_wk, total, mask=offs_t < T)


_LIMIT_GRAD = TritonLauncher(_limit_grad_kernel)


def limit_grad(g: torch.Tensor, rank_limit: torch.Tensor, scale: float, h_full: Optional[torch.Tensor] = None,
               bucket_ends: Optional[torch.Tensor] = None) -> tuple:
    """(g limited, bucket-weight gradient or None) from one read of g (T, R) fp32.

    g limited: g[t, r] zeroed for r >= rank_limit[t] ((T,) int32), what dA and dx read, so the x pass
    runs the static kernel. With the unlimited ``h_full`` and ``bucket_ends`` (K,): the (T, K) fp32
    gradient of the router's bucket weights, s · Σ_{r < bucket_ends[k]} h[t, r] g[t, r] (it reads h and g
    beyond each token's limit). Limiting h and g once here and in the shrink, instead of in every pass
    that reads them, is what made the per-token-rank passes as fast as the static ones (docs/dynamic-rank.md);
    the bucket gradient in one kernel replaces six torch kernels."""
    T, R = g.shape
    g_out = torch.empty_like(g)
    bucket_grad = h_full is not None
    if bucket_grad and bucket_ends is None:
        raise ValueError("limit_grad: h_full needs bucket_ends (the rank at each bucket's end)")
    K = bucket_ends.shape[0] if bucket_grad else 0
    d_weights = torch.empty((T, K), device=g.device, dtype=torch.float32) if bucket_grad else None
    # without the bucket gradient its pointers are placeholders the kernel never reads
    h, ends, dw = (h_full, bucket_ends, d_weights) if bucket_grad else (g, rank_limit, g)
    BLOCK_T = 64
    _LIMIT_GRAD((cdiv(T, BLOCK_T),),
        g, rank_limit, g_out, h, ends, dw, T, R, K, scale,
        g.stride(0), g.stride(1), h.stride(0), h.stride(1), dw.stride(0), dw.stride(1),
        BUCKET_GRAD=bucket_grad, BLOCK_T=BLOCK_T, BLOCK_R=block_rank(R),
    )
    return g_out, d_weights


# ----------------------------------------------------------------------------- tuning


def tune_layer_kernels(K: int, N: int, R: int, dtype: torch.dtype, device, tokens: int = 8192, save: bool = True,
                       skip: Optional[set] = None) -> dict:
    """Measure every launch configuration of the four side kernels for one layer shape on this GPU.

    Returns {kernel: {"best": config, "best_ms": ..., "default_ms": ...}}; the choices go to the
    on-disk cache that training reads (sits_lora.ops.tuning). Keys in ``skip`` (kernel, dims) are
    not measured again; measured ones are added to it.
    """
    T = tokens
    x = torch.randn(T, K, device=device, dtype=dtype)
    dy = torch.randn(T, N, device=device, dtype=dtype)
    A = torch.randn(R, K, device=device) / K**0.5
    B = torch.randn(N, R, device=device) / R**0.5
    h = lora_shrink(x, A)
    g, _ = lora_dy_pass(dy, B, h, 1.0)
    block_r = block_rank(R)
    runs = {
        "shrink": ((K, block_r), lambda cfg: lora_shrink(x, A, config=cfg)),
        "expand": ((N, block_r), lambda cfg: lora_expand(h, B, 1.0, None, dtype, config=cfg)),
        "dy_pass": ((N, block_r), lambda cfg: lora_dy_pass(dy, B, h, 1.0, config=cfg)),
        "x_pass": ((K, block_r), lambda cfg: lora_x_pass(x, A, g, 1.0, True, config=cfg)),
    }
    report = {}
    for kernel, (dims, run) in runs.items():
        if skip is not None:
            if (kernel, dims) in skip:
                continue
            skip.add((kernel, dims))
        before = tuning.config_for(kernel, torch.device(device), dims, dtype)
        best, timings = tuning.tune(kernel, torch.device(device), dims, dtype, run, save=save)
        default = tuning.CONFIG_SPACE[kernel][0]
        report[kernel] = {
            "dims": list(dims),
            "best": best,
            "best_ms": min(ms for ms, _ in timings),
            "default_ms": next((ms for ms, cfg in timings if cfg == default), None),
            # what config_for gave before this run (an entry of a GPU of the same compute capability, say)
            "before": before,
            "before_ms": next((ms for ms, cfg in timings if cfg == before), None),
            "configs_tried": len(timings),
        }
    return report
