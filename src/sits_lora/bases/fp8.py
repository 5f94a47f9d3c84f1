"""The fp8 frozen base: the weight stored once as e4m3 codes and their scale, and its fused path.

:class:`Fp8BaseLinear` is the base module (``layer.base_layer``) of an fp8 layer; :class:`Fp8Base` is the
layer's ``frozen_base``, which runs both base GEMMs in fp8 through ``torch._scaled_mm`` with the model's
delayed scales and the LoRA branch in bf16 on the fused kernels (``sits_lora.ops.fp8``). Which layers
get it, and the scaling state they share, are decided by ``sits_lora.fp8``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .. import ops
from ..ops import fp8 as fp8_ops
from ..utils.distributed import fsdp2_shards_integer_parameters

MIN_CAPABILITY = (8, 9)        # fp8 tensor cores and torch._scaled_mm: Ada (8.9), Hopper (9.0) and newer


class Fp8UnsupportedError(RuntimeError):
    """fp8 was asked for on hardware without fp8 GEMMs (and without fp8_emulate=True)."""


def _unsupported(detail: str) -> Fp8UnsupportedError:
    return Fp8UnsupportedError(
        f"SitsLoraConfig.fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell: fp8 "
        f"tensor cores and torch._scaled_mm); {detail}. Set fp8_emulate=True to run the same numerics in plain "
        f"PyTorch (slow; meant for tests), or fp8='off'."
    )


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_fp8_hardware(device: torch.device, emulate: bool) -> None:
    """At injection: a GPU that can run fp8 must exist (the model may still be on the CPU)."""
    if emulate:
        return
    if not torch.cuda.is_available():
        raise _unsupported("this machine has no CUDA GPU")
    index = device.index if device.type == "cuda" and device.index is not None else torch.cuda.current_device()
    cc = _capability(index)
    if cc < MIN_CAPABILITY:
        raise _unsupported(f"cuda:{index} ({torch.cuda.get_device_name(index)}) has compute capability "
                           f"{cc[0]}.{cc[1]}")


def check_fp8_device(x: torch.Tensor, emulate: bool) -> None:
    """At each call: the input must be on a GPU that runs fp8 GEMMs, unless emulated."""
    if emulate:
        return
    if not x.is_cuda:
        raise _unsupported(f"the input is on {x.device}; move the model to the GPU (model.to('cuda'))")
    cc = _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if cc < MIN_CAPABILITY:
        raise _unsupported(f"{x.device} has compute capability {cc[0]}.{cc[1]}")


def check_fp8_call(x: torch.Tensor, out_features: int, emulate: bool, row_scaled: bool) -> None:
    """At each call of an fp8 layer's fused path: a GPU that runs fp8 GEMMs, sizes the kernels address, and bf16
    input for row-wise weight scales."""
    check_fp8_device(x, emulate)
    if emulate:
        return
    if ops.tensor_too_large(x, out_features):
        # the fp8 kernels address with 32-bit offsets too, and there is no unquantized reference to fall to
        raise ValueError(f"sits_lora: an fp8 layer's input or output has {x.numel() // x.shape[-1]} tokens x "
                         f"{max(x.shape[-1], out_features)} features, 2**31 elements or more, past what the "
                         f"fp8 kernels address. Run the MLP in tiles (sits_lora.activations.tile_mlp(model)), or "
                         f"fewer tokens per batch, or SitsLoraConfig(fp8='off') for this run.")
    if row_scaled and x.dtype != torch.bfloat16:
        raise ValueError(f"SitsLoraConfig.fp8_weight_scale='row' runs the row-wise torch._scaled_mm, which writes "
                         f"bf16 only; the input is {x.dtype}. Load the model in bf16 (for a 4-bit model: "
                         f"bnb_4bit_compute_dtype=torch.bfloat16) or use fp8_weight_scale='tensor'.")


class Fp8BaseLinear(nn.Linear):
    """The frozen base layer of an fp8 adapter: ``weight`` holds e4m3 codes (N, K), not values, stored as their
    bytes (uint8) where this torch's FSDP2 shards integer parameters, else as float8_e4m3fn
    (:func:`codes_storage_dtype`); :attr:`codes` reads them as e4m3 (a view, no copy).

    W ≈ codes · weight_scale_inv, with ``weight_scale_inv`` fp32 of shape (1,) (per tensor) or
    (N,) (per output row). ``weight_bf16`` keeps the original weight when the config asks for it
    (``fp8_keep_bf16_weight=True``), else it is None and the original is freed.

    Why bytes: whatever casts a model's floating-point parameters leaves integer ones alone, and a cast of the
    codes would read them as values and drop their scale. FSDP2's mixed-precision policy (which accelerate's FSDP
    plugin sets under bf16) casts every floating-point parameter, float8 included, at each gather. ``module.to(dtype)``
    and ``.half()`` move the codes between devices and never cast them, whichever their storage.

    Called on its own (PEFT's paths: disabled adapters, several active adapters, mixed batches) it
    runs the fp8 GEMM with each tensor's own scale (current scaling); the delayed-scaling path of a
    single active adapter is :class:`Fp8Base`.
    """

    weight_bf16: Optional[torch.Tensor]

    @classmethod
    def from_linear(cls, linear: nn.Linear, granularity: str, keep_bf16: bool, grad_dtype: torch.dtype,
                    margin: int, emulate: bool) -> "Fp8BaseLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        w8, w_inv = fp8_ops.quantize_weight(linear.weight, granularity)
        new.weight = nn.Parameter(w8.view(codes_storage_dtype()), requires_grad=False)
        new.bias = linear.bias
        new.register_buffer("weight_scale_inv", w_inv)
        # the kept copy duplicates the checkpoint's own tensor: not part of the state dict
        new.register_buffer("weight_bf16", linear.weight.detach() if keep_bf16 else None, persistent=False)
        new.fp8_orig_dtype = linear.weight.dtype
        new.fp8_weight_scale = granularity
        new.fp8_grad_dtype = grad_dtype
        new.fp8_margin = margin
        new.fp8_emulate = emulate
        new.train(linear.training)
        return new

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer takes and gives (the weight's before quantization), as a quantized base names it."""
        return self.fp8_orig_dtype

    @property
    def codes(self) -> torch.Tensor:
        """The e4m3 codes (N, K): ``weight``'s bytes read as float8_e4m3fn (under FSDP2, the gathered ones)."""
        weight = self.weight
        return weight if weight.dtype == fp8_ops.E4M3 else weight.view(fp8_ops.E4M3)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in its original dtype: the kept original if there is one, else codes x scale."""
        if self.weight_bf16 is not None:
            return self.weight_bf16
        return fp8_ops.dequantize_weight(self.codes, self.weight_scale_inv, self.fp8_orig_dtype)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with :meth:`dequantized_weight` (used by merge and unload)."""
        weight = self.dequantized_weight()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.detach().clone() if self.weight_bf16 is None else weight,
                                     requires_grad=False)
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_fp8_device(x, self.fp8_emulate)
        scales = {"delayed": False, "scale": None, "scale_inv": None, "amax": None, "margin": self.fp8_margin,
                  "grad_dtype": self.fp8_grad_dtype, "emulate": self.fp8_emulate}
        return fp8_ops.fp8_lora_linear(x, None, None, None, self.codes, self.weight_scale_inv, self.bias, 0.0, scales)

    def _apply(self, fn, recurse=True):
        # ``.half()`` / ``.to(dtype)`` cast floating-point tensors: codes stored as float8 get them back, moved
        # (bytes are never cast by those), and the scale stays fp32
        codes, scale = self.weight.data, self.weight_scale_inv
        result = super()._apply(fn, recurse)
        device = self.weight.device
        if self.weight.dtype != codes.dtype:
            self.weight = nn.Parameter(codes.to(device), requires_grad=False)
        if self.weight_scale_inv.dtype != scale.dtype:
            self.weight_scale_inv = scale.to(device)
        return result

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # codes saved in the other storage (float8_e4m3fn into bytes, or bytes into float8): load them bit for
        # bit (a copy across the two dtypes would convert values)
        key = prefix + "weight"
        saved = state_dict.get(key)
        if saved is not None and saved.dtype != self.weight.dtype and {saved.dtype, self.weight.dtype} == {
                torch.uint8, fp8_ops.E4M3}:
            state_dict[key] = saved.view(self.weight.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        kept = ", bf16 weight kept" if self.weight_bf16 is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3 per {self.fp8_weight_scale}{kept}")


def codes_storage_dtype() -> torch.dtype:
    """The dtype :class:`Fp8BaseLinear` stores its codes in: their bytes (uint8), which no mixed-precision policy
    casts, where this torch's FSDP2 shards integer parameters; float8_e4m3fn where it does not (torch 2.11), which
    FSDP2 shards but its bf16 policy casts (the recipe then refuses fp8 under accelerate's FSDP plugin)."""
    return torch.uint8 if fsdp2_shards_integer_parameters() else fp8_ops.E4M3


@dataclass(eq=False)
class Fp8Base:
    """The fused path of a SitsLoraLinear whose base module is an :class:`Fp8BaseLinear`: the layer's
    row ``index`` in the model's ``Fp8ScalingState`` (sits_lora.fp8.scaling), whose delayed scales cast
    x and dy. Without a single active adapter PEFT's forward runs, and the base module's own forward
    casts with each tensor's current amax."""

    state: Any
    index: int

    module_type = Fp8BaseLinear
    fuses_siblings = False  # the sibling op is bf16; each fp8 layer runs its own fp8 GEMMs
    kernels = ()   # one implementation: the fp8 GEMMs

    def fused_forward(self, layer, plan, x: torch.Tensor) -> torch.Tensor:
        adapter = plan.adapter
        base = layer.base_layer
        check_fp8_call(x, layer.out_features, self.state.emulate, base.fp8_weight_scale == "row")
        dropout = layer.lora_dropout[adapter]
        x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else None
        scales = self.state.scales_for(self.index, layer.training)
        return fp8_ops.fp8_lora_linear(x, x_lora, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                                       base.codes, base.weight_scale_inv, base.bias, layer.scaling[adapter], scales)
