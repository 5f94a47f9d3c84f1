"""The INT4 frozen base: its weight format, dequantization, the dequant-GEMMs and the LoRA op over them.

Format (``int4_pack``): weight-only, asymmetric, one (scale, min) pair per group of ``group_size``
consecutive input features of a row, both in the model's float dtype: w ≈ q · scale + min, q in [0, 15].
Two weights per byte, the even input feature in the low nibble. Each row of the packed tensor (N, Kp / 2)
holds Kp = in_features rounded up to 64 (32 bytes), so every row starts on a 32-byte boundary when the
tensor does (torch's allocations start on 512-byte ones); the padding holds zeros. Per row: K / 2 bytes of
codes plus 2 · K / group_size scale / min values, 0.27x the bf16 bytes at group size 128.

Two ways to run the base products, y = x Wᵀ (forward) and dx = dy W (backward):

- ``"dequant"``: W dequantized once per call into one buffer shared by every INT4 layer of the device
  (the largest layer's size), then cuBLAS (``addmm_`` onto the LoRA part, as the bf16 path does). The
  dense weight lives for one GEMM: the model holds only the packed bytes.
- ``"fused"``: a Triton GEMM that reads the packed tiles and dequantizes them in registers (the
  prologue), never writing W. It reads a quarter of the bytes, so it wins where the GEMM is bound by the
  weight's bytes (few tokens); cuBLAS wins where it is bound by FLOPs (training batches).

``int4_lora_linear`` picks one by the token count and row length (``resolve_mode``) and runs
``dequant_linear``'s op with it (the LoRA branch on the shared kernels of ``fused``, as the bf16 op), or runs
the plain PyTorch reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .dequant_linear import DenseProducts, dequant_lora_linear, dequant_lora_linear_reference, shared_buffer

GROUP_SIZE = 128
ROW_ALIGN_BYTES = 32
PACKED_COLUMNS_MULTIPLE = 2 * ROW_ALIGN_BYTES      # input features per aligned row unit: 64 (32 bytes)
# At or below this many tokens, and for rows of at most FUSED_MAX_IN_FEATURES, the fused dequant-GEMM runs;
# otherwise dequantize + cuBLAS. With few tokens the product is bound by the weight's bytes, and the fused kernel,
# which reads a quarter of them, wins; from a few hundred tokens the product is bound by FLOPs and cuBLAS wins. On
# long rows cuBLAS wins at every token count: the fused kernel splits no K, so a few dozen programs each walk a
# whole row (bench/bench_int4.py times both; docs/quantization.md).
FUSED_MAX_TOKENS = 64
FUSED_MAX_IN_FEATURES = 8192
MODES = ("auto", "dequant", "fused")


def padded_in_features(in_features: int) -> int:
    """Kp: in_features rounded up to a multiple of 64, so that a packed row is a multiple of 32 bytes."""
    return -(-in_features // PACKED_COLUMNS_MULTIPLE) * PACKED_COLUMNS_MULTIPLE


def check_group_size(in_features: int, group_size: int) -> Optional[str]:
    """None when ``group_size`` can quantize rows of ``in_features``, else what is wrong."""
    if group_size < 32 or group_size & (group_size - 1):
        return f"the group size must be a power of two of at least 32, not {group_size}"
    if in_features % group_size:
        return f"in_features={in_features} is not a multiple of the group size {group_size}"
    return None


def int4_pack(weight: Tensor, group_size: int = GROUP_SIZE, scale_dtype: Optional[torch.dtype] = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(packed uint8 (N, Kp / 2), scales (N, Kp / group_size), mins (same)) for a weight (N, K).

    Each group's scale is (max - min) / 15 and its min the group's min, both rounded to ``scale_dtype`` (the
    weight's dtype by default) before the codes are chosen, so that the codes fit the stored values. A
    constant group gets scale 0 and decodes exactly.
    """
    if weight.dim() != 2:
        raise ValueError(f"int4_pack: expected a 2-D weight (out_features, in_features), got shape {tuple(weight.shape)}")
    N, K = weight.shape
    problem = check_group_size(K, group_size)
    if problem is not None:
        raise ValueError(f"int4_pack: {problem}")
    scale_dtype = scale_dtype or (weight.dtype if weight.dtype.is_floating_point else torch.float32)
    Kp = padded_in_features(K)
    w = torch.zeros(N, Kp, device=weight.device, dtype=torch.float32)
    w[:, :K] = weight.detach().float()
    groups = w.view(N, Kp // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = ((high - low) / 15).to(scale_dtype)
    mins = low.to(scale_dtype)
    s, m = scales.float()[..., None], mins.float()[..., None]
    q = torch.where(s > 0, torch.round((groups - m) / torch.where(s > 0, s, 1.0)), 0.0).clamp_(0, 15)
    q = q.to(torch.uint8).view(N, Kp)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed.contiguous(), scales.contiguous(), mins.contiguous()


def int4_unpack_reference(packed: Tensor, scales: Tensor, mins: Tensor, in_features: int,
                          dtype: Optional[torch.dtype] = None) -> Tensor:
    """The plain PyTorch dequantization: W (N, in_features) in ``dtype`` (the scales' dtype by default)."""
    N = packed.shape[0]
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(N, -1).float()          # (N, Kp) even, odd
    group_size = q.shape[1] // scales.shape[1]
    w = q.view(N, -1, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return w.view(N, -1)[:, :in_features].to(dtype or scales.dtype)


def int4_unpack_into(packed: Tensor, scales: Tensor, mins: Tensor, out: Tensor) -> Tensor:
    """The PyTorch dequantization into a preallocated float ``out`` (N, Kp), allocating nothing of W's size: on a
    CPU the allocator's page faults otherwise cost far more than the work. For rows without padding (in_features
    a multiple of 64), ``out`` is W."""
    N = packed.shape[0]
    if out.shape != (N, 2 * packed.shape[1]) or not out.is_contiguous():
        raise ValueError(f"int4_unpack_into: out must be contiguous ({N}, {2 * packed.shape[1]}), got "
                         f"{tuple(out.shape)}")
    pairs = out.view(N, -1, 2)                                                         # (N, Kp / 2, even / odd)
    high, low = pairs[..., 1], pairs[..., 0]
    high.copy_(packed).div_(16).floor_()
    low.copy_(packed).add_(high, alpha=-16)
    groups = out.view(N, scales.shape[1], -1)
    groups.mul_(scales[..., None]).add_(mins[..., None])
    return out


# ----------------------------------------------------------------------------- launchers


def _on_interpreter(t: Tensor) -> bool:
    return t.device.type == "cpu"


def _block_k(group_size: int) -> int:
    return min(64, group_size)


def _check_operands(packed: Tensor, scales: Tensor, mins: Tensor, in_features: int) -> int:
    """The group size, after checking the packed tensors' shapes against each other."""
    N = packed.shape[0]
    Kp = padded_in_features(in_features)
    if packed.dtype != torch.uint8 or packed.shape != (N, Kp // 2) or not packed.is_contiguous():
        raise ValueError(f"int4: packed must be a contiguous uint8 tensor ({N}, {Kp // 2}) for in_features="
                         f"{in_features}, got {packed.dtype} {tuple(packed.shape)}")
    if scales.shape != mins.shape or scales.shape[0] != N or Kp % scales.shape[1]:
        raise ValueError(f"int4: scales {tuple(scales.shape)} and mins {tuple(mins.shape)} do not match the packed "
                         f"rows ({N}, {Kp} features)")
    return Kp // scales.shape[1]


def int4_dequantize(packed: Tensor, scales: Tensor, mins: Tensor, in_features: int, out: Tensor) -> Tensor:
    """W (N, in_features) written into ``out`` (contiguous, that shape, a float dtype) by the Triton kernel."""
    group = _check_operands(packed, scales, mins, in_features)
    N = packed.shape[0]
    block_n, block_k = (16, _block_k(group)) if _on_interpreter(packed) else (32, _block_k(group))
    grid = (-(-N // block_n), -(-in_features // block_k))
    from .int4_kernels import DEQUANTIZE  # Triton loads on first use

    DEQUANTIZE(grid, packed, scales, mins, out, N, in_features, packed.shape[1], scales.shape[1],
               GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def int4_matmul(a: Tensor, packed: Tensor, scales: Tensor, mins: Tensor, in_features: int, transposed: bool = False,
                out: Optional[Tensor] = None) -> Tensor:
    """The fused dequant-GEMM on 2-D ``a``: a Wᵀ (a: (M, in_features)) or, ``transposed``, a W (a: (M, N)).

    With ``out`` given the product is added to it (the LoRA part already there), else a new tensor of a's
    dtype. A CUDA tensor, or a CPU one under TRITON_INTERPRET=1."""
    group = _check_operands(packed, scales, mins, in_features)
    N, K = packed.shape[0], in_features
    a = a.contiguous()
    M = a.shape[0]
    accumulate = out is not None
    if out is None:
        out = torch.empty(M, K if transposed else N, device=a.device, dtype=a.dtype)
    from .int4_kernels import MATMUL_NN, MATMUL_NT  # Triton loads on first use

    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    block_k = _block_k(group)
    if _on_interpreter(a):
        block_m, block_n, warps, stages = 16, 16, 4, 1
    else:
        block_m, block_n, warps, stages = (64, 64, 4, 3) if M > 16 else (16, 64, 4, 3)
    if transposed:
        grid = (-(-M // block_m), -(-K // block_k))
        MATMUL_NN(grid, a, packed, scales, mins, out, M, N, K, packed.shape[1], scales.shape[1],
                  ACCUMULATE=accumulate, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, DOT_PRECISION=precision, num_warps=warps, num_stages=stages)
    else:
        grid = (-(-M // block_m), -(-N // block_n))
        MATMUL_NT(grid, a, packed, scales, mins, out, M, N, K, padded_in_features(K), packed.shape[1],
                  scales.shape[1], ACCUMULATE=accumulate, GROUP=group, BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, num_warps=warps,
                  num_stages=stages)
    return out


# ----------------------------------------------------------------------------- the op


def dequantized_into_shared_buffer(packed: Tensor, scales: Tensor, mins: Tensor, in_features: int,
                                   dtype: torch.dtype) -> Tensor:
    """W (N, in_features) in the device's shared buffer (``dequant_linear.shared_buffer``)."""
    out = shared_buffer(packed.device, dtype, (packed.shape[0], in_features))
    return int4_dequantize(packed, scales, mins, in_features, out)


class Int4Products:
    """The base products of one packed INT4 W for ``dequant_linear`` (its "products" object), run by ``mode``:
    "dequant" (W into the shared buffer, then cuBLAS) or "fused" (the dequant-GEMM kernels)."""

    def __init__(self, packed: Tensor, scales: Tensor, mins: Tensor, in_features: int, mode: str):
        self.packed, self.scales, self.mins, self.in_features = packed, scales, mins, in_features
        self.dense = DenseProducts(lambda dtype: dequantized_into_shared_buffer(packed, scales, mins, in_features,
                                                                                dtype)) if mode == "dequant" else None

    def forward_into(self, x: Tensor, out: Optional[Tensor]) -> Tensor:
        if self.dense is not None:
            return self.dense.forward_into(x, out)
        return int4_matmul(x, self.packed, self.scales, self.mins, self.in_features, transposed=False, out=out)

    def backward_into(self, dy: Tensor, out: Optional[Tensor]) -> Tensor:
        if self.dense is not None:
            return self.dense.backward_into(dy, out)
        return int4_matmul(dy, self.packed, self.scales, self.mins, self.in_features, transposed=True, out=out)


def resolve_mode(mode: str, tokens: int, in_features: int = 0) -> str:
    """"auto": "fused" up to FUSED_MAX_TOKENS tokens on rows of up to FUSED_MAX_IN_FEATURES, else "dequant"."""
    if mode not in MODES:
        raise ValueError(f"Int4BaseLinear.int4_mode={mode!r} is invalid: allowed values are {', '.join(map(repr, MODES))}")
    if mode == "auto":
        return "fused" if tokens <= FUSED_MAX_TOKENS and in_features <= FUSED_MAX_IN_FEATURES else "dequant"
    return mode


def int4_lora_linear(x: Tensor, x_lora: Optional[Tensor], lora_A: Optional[Tensor], lora_B: Optional[Tensor],
                     bias: Optional[Tensor], packed: Tensor, scales: Tensor, mins: Tensor, in_features: int,
                     scaling: float, kernel: str = "torch", mode: str = "auto") -> Tensor:
    """y = x Wᵀ + b + s·(x_lora Aᵀ) Bᵀ with W the packed INT4 weight; ``lora_A`` None gives x Wᵀ + b.

    ``kernel`` "torch": the plain PyTorch path (W dequantized by PyTorch for each product, none kept). "triton": ``dequant_linear``'s op with the base
    products run by ``mode`` ("auto", "dequant", "fused"; see the module docstring). ``x_lora`` is x (the same
    tensor) without dropout."""
    if kernel == "torch":
        products = DenseProducts(lambda dtype: int4_unpack_reference(packed, scales, mins, in_features, dtype))
        return dequant_lora_linear_reference(x, x_lora, lora_A, lora_B, bias, products, packed.shape[0], scaling)
    tokens = x.numel() // max(x.shape[-1], 1)
    products = Int4Products(packed, scales, mins, in_features, resolve_mode(mode, tokens, in_features))
    return dequant_lora_linear(x, x_lora, lora_A, lora_B, bias, products, packed.shape[0], scaling)
