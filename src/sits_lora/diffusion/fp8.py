"""fp8 inference of a denoiser's linear layers (and optionally its convolutions and the VAE decoder's) with static
input scales calibrated on a few generations.

Two steps, apart so that a calibration is measured once and reused::

    calibration = calibrate(pipe, [{"prompt": "a red cube"}, {"prompt": "a blue sphere"}], num_inference_steps=30)
    calibration.save("fp8_calibration.json")             # optional: Fp8Calibration.load(path) later
    report = quantize_fp8(pipe, calibration)             # pipe.unet's big linears now run e4m3 GEMMs
    # or: quantize_fp8(pipe, calibration, convolutions=True, vae_decoder=True)

``calibrate`` runs the pipeline on the given inputs and records, for every ``nn.Linear`` and ``nn.Conv2d`` of the
denoiser (``pipe.unet`` / ``pipe.transformer``, including the frozen base of each LoRA layer) and of the VAE's
decoder, the largest |input| it saw and how many rows (tokens, or pixels for a convolution) one call fed it.
``quantize_fp8`` swaps each linear that is worth it for a :class:`StaticFp8Linear`: the weight stored once as e4m3
codes with one scale, the input cast with the calibrated scale (one pass, no amax reduction per call: the property
that lets a CUDA graph or torch.compile treat it as a constant), the GEMM through ``torch._scaled_mm``. Not worth
it, and left in bf16: layers fed fewer than ``min_rows`` rows a call (the time embedding; cross-attention to_k /
to_v, which read 77 text tokens: there the cast costs what the GEMM saves), layers the calibration never saw, dims
that are not multiples of 16. With ``convolutions`` the denoiser's convolutions become :class:`StaticFp8Conv2d`
(per-output-channel weight scales, sits_lora's implicit-GEMM Triton kernel: cuDNN has no fp8 convolution), except
those with fewer than 16 channels (the first and last of a U-Net); with ``vae_decoder`` the VAE decoder's layers
too.

A LoRA layer whose frozen base is swapped keeps its adapter in bf16: its base runs fp8, its LoRA branch PEFT's way.
Normalizations and attention (SDPA) stay in their dtype. Quantize before ``graph_denoiser`` and ``compile_blocks``
(or call ``graphs.reset()`` after). ``dequantize_fp8`` swaps plain layers back (with the e4m3 values: the original
weights are not kept). On the CPU the same numerics run in plain PyTorch (slow; for tests).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ..bases.fp8 import MIN_CAPABILITY
from ..ops import fp8 as fp8_ops
from ..ops import fp8_conv
from ..utils import validation
from .reuse import denoiser_of

logger = logging.getLogger("sits_lora")

FORMAT_VERSION = 1


def _layers(model: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """Every plain nn.Linear and nn.Conv2d of ``model`` by qualified name (with ``prefix``), LoRA's own factors
    left out."""
    out = {}
    for name, module in model.named_modules():
        if type(module) in (nn.Linear, nn.Conv2d) and not any(part in ("lora_A", "lora_B")
                                                              for part in name.split(".")):
            out[prefix + name] = module
    return out


VAE_PREFIX = "vae.decoder."


def _vae_decoder(pipe) -> Optional[nn.Module]:
    decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
    return decoder if isinstance(decoder, nn.Module) else None


def _calibrated_layers(pipe) -> dict[str, nn.Module]:
    """What calibrate records and quantize_fp8 may swap: the denoiser's linears and convolutions by their names in
    the denoiser, the VAE decoder's (when the pipeline has one) as 'vae.decoder.<name>'."""
    layers = _layers(denoiser_of(pipe, "calibrate"))
    decoder = _vae_decoder(pipe)
    if decoder is not None:
        layers.update(_layers(decoder, VAE_PREFIX))
    return layers


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@dataclass
class Fp8Calibration:
    """What ``calibrate`` saw: per linear layer (by its name in the denoiser), the largest |input| over all calls
    (``amax``) and the most rows one call fed it (``rows``); ``calls``: the pipeline calls it ran."""

    amax: dict[str, float] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    calls: int = 0

    def save(self, path: str | os.PathLike) -> None:
        """JSON, written to a temporary file first and then moved (an interrupted save leaves no half file)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": "sits_lora.fp8_calibration", "version": FORMAT_VERSION, "calls": self.calls,
                       "amax": self.amax, "rows": self.rows}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Fp8Calibration":
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != "sits_lora.fp8_calibration":
            raise ValueError(f"{os.fspath(path)!r} is not an fp8 calibration written by Fp8Calibration.save")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{os.fspath(path)!r} has calibration format version {data.get('version')!r}; this "
                             f"sits_lora reads version {FORMAT_VERSION}. Calibrate again.")
        return cls(amax={k: float(v) for k, v in data["amax"].items()},
                   rows={k: int(v) for k, v in data["rows"].items()}, calls=int(data["calls"]))


class _Recorder:
    """Forward pre-hooks that keep each layer's running max |input| on its device (no host sync per call)."""

    def __init__(self, layers: dict[str, nn.Module]):
        self.amax: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in layers.items()]

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0]
            seen = x.detach().abs().amax().float()
            # NaN propagates through maximum: a non-finite input is reported after the run, not lost
            previous = self.amax.get(name)
            self.amax[name] = seen if previous is None else torch.maximum(previous, seen)
            channels = x.shape[1] if isinstance(module, nn.Conv2d) else x.shape[-1]   # a conv's rows: its pixels
            self.rows[name] = max(self.rows.get(name, 0), x.numel() // max(channels, 1))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def calibrate(pipe, inputs: Iterable[dict], **call_kwargs: Any) -> Fp8Calibration:
    """Run ``pipe(**item, **call_kwargs)`` for each item of ``inputs`` and record the input range of every linear
    and convolution of the denoiser and of the VAE's decoder. The inputs should look like the generations to come
    (resolution, guidance, number of steps): a few prompts are enough, the scale is the max over every step of every
    call. Returns an :class:`Fp8Calibration`."""
    model = denoiser_of(pipe, "calibrate")
    decoder = _vae_decoder(pipe)
    if fp8_layers(model) or (decoder is not None and fp8_layers(decoder)):
        raise ValueError("calibrate: this denoiser already has fp8 layers (quantize_fp8 ran); calibrate the bf16 "
                         "model (dequantize_fp8 gives lossy bf16 layers back, not the originals)")
    items = list(inputs)
    if not items or not all(isinstance(item, dict) for item in items):
        raise ValueError("calibrate: inputs must be a non-empty list of dicts of pipeline arguments, e.g. "
                         "[{'prompt': 'a red cube'}]; got " + repr(inputs)[:120])
    layers = _calibrated_layers(pipe)
    if not layers:
        raise ValueError(f"calibrate: {type(model).__name__} has no nn.Linear or nn.Conv2d layers to calibrate")
    recorder = _Recorder(layers)
    try:
        for item in items:
            pipe(**item, **call_kwargs)
    finally:
        recorder.remove()
    amax = {name: float(value) for name, value in recorder.amax.items()}   # one sync per layer, after the runs
    bad = [name for name, value in amax.items() if not math.isfinite(value)]
    if bad:
        raise ValueError(f"calibrate: the input of {len(bad)} layer(s) held NaN or Inf during calibration "
                         f"(first: {bad[0]}); the pipeline itself is not finite at these settings. Find the step "
                         f"with sits_lora.diffusion.LatentGuard(pipe, watch_modules=True).")
    return Fp8Calibration(amax=amax, rows=dict(recorder.rows), calls=len(items))


FP8_MAX = fp8_ops.FP8_MAX[fp8_ops.E4M3]


@functools.lru_cache(maxsize=None)
def _check_capability(device: torch.device) -> None:
    cc = torch.cuda.get_device_capability(device)
    if cc < MIN_CAPABILITY:
        raise RuntimeError(f"StaticFp8Linear needs fp8 tensor cores (compute capability 8.9 or newer); {device} has "
                           f"{cc[0]}.{cc[1]}. Call sits_lora.diffusion.dequantize_fp8 on this model, or run it on an "
                           f"Ada / Hopper / Blackwell GPU.")


class _StaticFp8Layer(nn.Module):
    """What both fp8 inference layers hold beside their e4m3 weight: the static input scale's buffers
    (``input_amax``, ``input_scale`` = fp8_max / amax / 2**margin, ``input_scale_inv``), the source layer's bias,
    dtype and mode; and no ``weight`` attribute (``_weight_refusal`` says what to do instead)."""

    _weight_refusal = ""

    def _take_from(self, source: nn.Module, input_amax: float, margin: int) -> None:
        amax = torch.tensor([input_amax], dtype=torch.float32, device=source.weight.device)
        scale = fp8_ops.scale_from_amax(amax, FP8_MAX, margin, torch.ones_like(amax))
        self.register_buffer("input_amax", amax)
        self.register_buffer("input_scale", scale)
        self.register_buffer("input_scale_inv", scale.reciprocal())
        self.margin = margin
        self.bias = source.bias
        self.orig_dtype = source.weight.dtype
        self.train(source.training)

    def __getattr__(self, name: str):
        if name == "weight":
            # code that reads or writes ``.weight`` (PEFT's merge, a weight tie) must not get a silent copy
            raise AttributeError(self._weight_refusal)
        return super().__getattr__(name)


class StaticFp8Linear(_StaticFp8Layer):
    """An inference linear layer: W stored as e4m3 codes with one fp32 scale, x cast to e4m3 with a calibrated
    static scale, y = (x8 W8ᵀ) · x_inv · w_inv + b in x's dtype (``torch._scaled_mm``).

    Buffers: ``weight_fp8`` (N, K) e4m3, ``weight_scale_inv`` (1,), ``input_scale`` / ``input_scale_inv`` (1,),
    ``input_amax`` (1,) the calibrated range. An input beyond the calibrated range saturates at ±448 · x_inv.
    Under autograd (an input that requires grad) it runs F.linear on the dequantized weight, so that gradients reach
    what lies before it; it has no trainable weight.
    """

    _weight_refusal = ("StaticFp8Linear holds e4m3 codes (weight_fp8), not a weight: merge LoRA adapters and tie "
                       "weights before quantize_fp8, or call dequantize_fp8 first")

    def __init__(self, linear: nn.Linear, input_amax: float, margin: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w8, w_inv = fp8_ops.quantize_weight(linear.weight, "tensor")
        self.register_buffer("weight_fp8", w8)
        self.register_buffer("weight_scale_inv", w_inv)
        self._take_from(linear, input_amax, margin)

    def dequantized_weight(self) -> torch.Tensor:
        return fp8_ops.dequantize_weight(self.weight_fp8, self.weight_scale_inv, self.orig_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return nn.functional.linear(x, self.dequantized_weight().to(x.dtype),
                                        None if self.bias is None else self.bias.to(x.dtype))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        emulate = not x2.is_cuda
        compiling = torch.compiler.is_compiling()
        if not emulate and not compiling:
            _check_capability(x2.device)
        if emulate:
            y, _ = fp8_ops.fp8_linear_forward(x2, None, self.weight_fp8, self.weight_scale_inv, self.bias, None, None,
                                              0.0, self.input_scale, self.input_scale_inv, None, emulate=True)
            return y.reshape(*lead, self.out_features)
        if compiling:
            # the same cast in tensor ops: Inductor fuses it into whatever wrote x (a LayerNorm, a GELU gate)
            # (row-major: an input viewed through a transpose, as a VAE attention's (B, HW, C) from (B, C, HW), keeps
            # its strides through the cast, and _scaled_mm refuses a column-major A)
            x8 = (x2.float() * self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(fp8_ops.E4M3).contiguous()
        else:
            x8 = fp8_ops.fp8_cast(x2, self.input_scale, None, fp8_ops.E4M3)
        # the bias in the GEMM's epilogue: added by a pass of its own it cost half the GEMM it follows (a GEGLU
        # projection's output is 8,192 x 10,240 at SDXL's 64² level); _scaled_mm takes no bias for an fp32 output
        fused_bias = self.bias is not None and x.dtype != torch.float32
        y = torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=self.input_scale_inv, scale_b=self.weight_scale_inv,
                             bias=self.bias.to(x.dtype) if fused_bias else None, out_dtype=x.dtype,
                             use_fast_accum=True)
        if self.bias is not None and not fused_bias:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.dequantized_weight(), requires_grad=False)
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3 per tensor, static input scale (amax {float(self.input_amax[0]):.4g})")


class StaticFp8Conv2d(_StaticFp8Layer):
    """An inference 2-D convolution in fp8: W stored as e4m3 codes with one scale per output channel, x cast to e4m3
    with a calibrated static scale, the convolution by sits_lora's implicit-GEMM Triton kernel
    (``sits_lora.ops.fp8_conv``; cuDNN has no fp8 convolution), output channels_last in x's dtype.

    Buffers: ``weight_fp8`` (C_out, KH · KW · C_in) e4m3 (the kernel's order), ``weight_scale_inv`` (C_out,),
    ``input_scale`` / ``input_scale_inv`` / ``input_amax`` (1,). Under autograd it runs F.conv2d on the dequantized
    weight. On the CPU the same numerics run in plain PyTorch.
    """

    _weight_refusal = ("StaticFp8Conv2d holds e4m3 codes (weight_fp8), not a weight: call dequantize_fp8 first to "
                       "read or change the convolution's weight")

    def __init__(self, conv: nn.Conv2d, input_amax: float, margin: int = 0):
        super().__init__()
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = tuple(conv.kernel_size)
        self.stride, self.padding = conv.stride[0], conv.padding[0]
        w8, w_inv = fp8_ops.quantize_weight(conv.weight.reshape(self.out_channels, -1), "row")
        self.register_buffer("weight_fp8", fp8_conv.pack_conv_weight(w8.reshape(conv.weight.shape)))
        self.register_buffer("weight_scale_inv", w_inv)
        self._take_from(conv, input_amax, margin)

    def dequantized_weight(self) -> torch.Tensor:
        w8 = fp8_conv.unpack_conv_weight(self.weight_fp8, self.kernel_size)
        return (w8.float() * self.weight_scale_inv.reshape(-1, 1, 1, 1)).to(self.orig_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return nn.functional.conv2d(x, self.dequantized_weight().to(x.dtype),
                                        None if self.bias is None else self.bias.to(x.dtype),
                                        stride=self.stride, padding=self.padding)
        if x.is_cuda and not torch.compiler.is_compiling():
            _check_capability(x.device)
        # the kernel reads each tile's channels contiguously: channels_last (a no-op where the model already is)
        x = x.contiguous(memory_format=torch.channels_last)
        if x.is_cuda and not torch.compiler.is_compiling():
            batch, channels, height, width = x.shape
            x8 = fp8_ops.fp8_cast(x.permute(0, 2, 3, 1).reshape(-1, channels), self.input_scale, None, fp8_ops.E4M3)
            x8 = x8.reshape(batch, height, width, channels).permute(0, 3, 1, 2)
        else:
            # tensor ops: Inductor fuses the cast into the GroupNorm / SiLU that wrote x (and it runs on the CPU)
            x8 = (x.float() * self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(fp8_ops.E4M3)
        return fp8_conv.conv2d_fp8_op(x8, self.weight_fp8, self.input_scale_inv, self.weight_scale_inv,
                                      None if self.bias is None else self.bias.to(x.dtype), self.kernel_size[0],
                                      self.kernel_size[1], self.stride, self.padding, x.dtype)

    def to_conv(self) -> nn.Conv2d:
        conv = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, stride=self.stride,
                         padding=self.padding, bias=self.bias is not None, device="meta")
        conv.weight = nn.Parameter(self.dequantized_weight(), requires_grad=False)
        conv.bias = self.bias
        conv.train(self.training)
        return conv

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={self.bias is not None}, fp8=e4m3 per output channel, static input "
                f"scale (amax {float(self.input_amax[0]):.4g})")


def _conv_unsupported(conv: nn.Conv2d) -> Optional[str]:
    """Why the fp8 kernel cannot take ``conv`` (None if it can)."""
    if conv.groups != 1 or tuple(conv.dilation) != (1, 1) or conv.padding_mode != "zeros":
        return "groups, dilation or padding mode the fp8 kernel does not take"
    if isinstance(conv.padding, str) or len(set(conv.stride)) != 1 or len(set(conv.padding)) != 1:
        return "stride or padding differ between height and width"
    if not fp8_conv.conv_k_block(conv.in_channels) or conv.out_channels < 16:
        return "fewer than 16 channels, or input channels not a multiple of 16"
    return None


@dataclass
class Fp8Report:
    """What ``quantize_fp8`` did: the layers now fp8, and those left in bf16 with the reason."""

    quantized: list[str]
    skipped: dict[str, str]
    bytes_before: int
    bytes_after: int

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for reason in self.skipped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        left = "; ".join(f"{n} {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
        return (f"sits_lora fp8: {len(self.quantized)} layers in e4m3 with static input scales "
                f"({self.bytes_before / 2**20:.1f} -> {self.bytes_after / 2**20:.1f} MiB of weights); "
                f"{len(self.skipped)} left as they were{': ' + left if left else ''}")


@torch.no_grad()
def quantize_fp8(pipe, calibration: Fp8Calibration, min_rows: int = 256, margin: int = 0,
                 exclude: Iterable[str] = (), convolutions: bool = False, vae_decoder: bool = False) -> Fp8Report:
    """Swap the denoiser's calibrated linear layers for :class:`StaticFp8Linear` (see the module docstring for which
    are left). ``margin``: the input scale is fp8_max / amax / 2**margin (1 leaves headroom for prompts wider than
    the calibration's, at a bit of precision). ``exclude``: substrings of layer names to keep in bf16.
    ``convolutions``: the denoiser's 2-D convolutions too, as :class:`StaticFp8Conv2d`. ``vae_decoder``: the VAE
    decoder's linears and convolutions too (a pipeline's ``vae``; its layers are named 'vae.decoder.<name>')."""
    model = denoiser_of(pipe, "quantize_fp8")
    if not isinstance(calibration, Fp8Calibration):
        raise TypeError(f"quantize_fp8: calibration must be an Fp8Calibration (from calibrate or "
                        f"Fp8Calibration.load), got {type(calibration).__name__}")
    validation.check_arguments("quantize_fp8", min_rows=(min_rows, validation.non_negative_int()),
                               margin=(margin, validation.non_negative_int()))
    decoder = _vae_decoder(pipe) if vae_decoder else None
    if vae_decoder and decoder is None:
        raise ValueError(f"quantize_fp8: vae_decoder=True needs a pipeline with a .vae that has a decoder; got "
                         f"{type(pipe).__name__}. Pass the pipeline, or vae_decoder=False.")
    if vae_decoder and not any(name.startswith(VAE_PREFIX) for name in calibration.amax):
        raise ValueError("quantize_fp8: vae_decoder=True but the calibration saw none of the VAE decoder's layers: "
                         "it ran the pipeline with output_type='latent', which skips the decode. Calibrate with "
                         "output_type='pt' (or 'pil'), or pass vae_decoder=False.")
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    everything = _calibrated_layers(pipe)
    unknown = [name for name in calibration.amax if name not in everything]
    if unknown and len(unknown) == len(calibration.amax):
        raise ValueError(f"quantize_fp8: none of the calibration's {len(unknown)} layers is a bf16 layer of this "
                         f"{type(model).__name__} (first: {unknown[0]!r}); it was measured on another model, or this "
                         f"one is quantized already. Calibrate this model.")
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.is_cuda:
        cc = torch.cuda.get_device_capability(parameter.device)
        if cc < MIN_CAPABILITY:
            raise RuntimeError(f"quantize_fp8 needs fp8 tensor cores (compute capability 8.9 or newer); "
                               f"{parameter.device} ({torch.cuda.get_device_name(parameter.device)}) has "
                               f"{cc[0]}.{cc[1]}. Keep this model in bf16.")
    candidates = {name: (model, name, layer) for name, layer in _layers(model).items()
                  if convolutions or type(layer) is nn.Linear}
    if decoder is not None:
        candidates.update({VAE_PREFIX + name: (decoder, name, layer) for name, layer in _layers(decoder).items()})
    quantized, skipped = [], {}
    before = after = 0
    for name, (owner, local_name, layer) in candidates.items():
        is_conv = type(layer) is nn.Conv2d
        reason = None
        if any(pattern in name for pattern in exclude):
            reason = "excluded"
        elif name not in calibration.amax:
            reason = "not called during calibration"
        elif calibration.rows.get(name, 0) < min_rows:
            reason = f"fed fewer than min_rows={min_rows} rows a call"
        elif is_conv and _conv_unsupported(layer):
            reason = _conv_unsupported(layer)
        elif not is_conv and (layer.in_features % 16 or layer.out_features % 16):
            reason = "dims not multiples of 16"
        elif calibration.amax[name] == 0.0:
            reason = "input all zeros in calibration"
        if reason is not None:
            skipped[name] = reason
            continue
        before += layer.weight.numel() * layer.weight.element_size()
        fp8 = (StaticFp8Conv2d if is_conv else StaticFp8Linear)(layer, calibration.amax[name], margin)
        after += fp8.weight_fp8.numel()
        _set_module(owner, local_name, fp8)
        quantized.append(name)
    report = Fp8Report(quantized, skipped, before, after)
    logger.info(report.summary())
    return report


@torch.no_grad()
def dequantize_fp8(pipe) -> int:
    """Swap every fp8 layer of the denoiser (and of a pipeline's VAE decoder) back for an ``nn.Linear`` /
    ``nn.Conv2d`` holding its e4m3 values in the original dtype (lossy: the bf16 weights before quantize_fp8 are
    gone). Returns how many it swapped."""
    owners = [denoiser_of(pipe, "dequantize_fp8")]
    if _vae_decoder(pipe) is not None:
        owners.append(_vae_decoder(pipe))
    swapped = 0
    for owner in owners:
        for name in fp8_layers(owner):
            layer = owner.get_submodule(name)
            _set_module(owner, name, layer.to_conv() if isinstance(layer, StaticFp8Conv2d) else layer.to_linear())
            swapped += 1
    return swapped


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s fp8 layers (:class:`StaticFp8Linear`, :class:`StaticFp8Conv2d`)."""
    return [name for name, module in model.named_modules() if isinstance(module, (StaticFp8Linear, StaticFp8Conv2d))]


__all__ = ["Fp8Calibration", "Fp8Report", "StaticFp8Conv2d", "StaticFp8Linear", "calibrate", "dequantize_fp8",
           "fp8_layers", "quantize_fp8"]
