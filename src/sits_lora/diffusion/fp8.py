"""fp8 inference of a denoiser's linear layers with static input scales calibrated on a few generations.

Two steps, apart so that a calibration is measured once and reused::

    calibration = calibrate(pipe, [{"prompt": "a red cube"}, {"prompt": "a blue sphere"}], num_inference_steps=30)
    calibration.save("fp8_calibration.json")             # optional: Fp8Calibration.load(path) later
    report = quantize_fp8(pipe, calibration)             # pipe.unet's big linears now run e4m3 GEMMs

``calibrate`` runs the pipeline on the given inputs and records, for every ``nn.Linear`` of the denoiser
(``pipe.unet`` / ``pipe.transformer``, including the frozen base of each LoRA layer), the largest |input| it saw and
how many rows (tokens) one call fed it. ``quantize_fp8`` swaps each linear that is worth it for a
:class:`StaticFp8Linear`: the weight stored once as e4m3 codes with one scale, the input cast with the calibrated
scale (one pass, no amax reduction per call: the property that lets a CUDA graph or torch.compile treat it as a
constant), the GEMM through ``torch._scaled_mm``. Not worth it, and left in bf16: layers fed fewer than ``min_rows``
rows a call (the time embedding; cross-attention to_k / to_v, which read 77 text tokens: there the cast costs what
the GEMM saves), layers the calibration never saw, dims that are not multiples of 16.

A LoRA layer whose frozen base is swapped keeps its adapter in bf16: its base runs fp8, its LoRA branch PEFT's way.
Convolutions, normalizations, attention (SDPA) and the VAE stay in their dtype. Quantize before ``graph_denoiser``
(or call ``graphs.reset()`` after). ``dequantize_fp8`` swaps plain ``nn.Linear`` layers back (with the e4m3 values:
the original weights are not kept). On the CPU the same numerics run in plain PyTorch (slow; for tests).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..bases.fp8 import MIN_CAPABILITY
from ..ops import fp8 as fp8_ops
from .reuse import denoiser_of

logger = logging.getLogger("sits_lora")

FORMAT_VERSION = 1


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every plain nn.Linear of ``model`` by qualified name (a LoRA layer's frozen base as '<layer>.base_layer');
    LoRA's own A / B matrices are adapter weights, not frozen linears, and stay out."""
    out = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not any(part in ("lora_A", "lora_B") for part in name.split(".")):
            out[name] = module
    return out


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
    """Forward pre-hooks that keep each linear's running max |input| on its device (no host sync per call)."""

    def __init__(self, linears: dict[str, nn.Linear]):
        self.amax: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in linears.items()]

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0]
            seen = x.detach().abs().amax().float()
            # NaN propagates through maximum: a non-finite input is reported after the run, not lost
            previous = self.amax.get(name)
            self.amax[name] = seen if previous is None else torch.maximum(previous, seen)
            self.rows[name] = max(self.rows.get(name, 0), x.numel() // max(x.shape[-1], 1))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def calibrate(pipe, inputs: Iterable[dict], **call_kwargs: Any) -> Fp8Calibration:
    """Run ``pipe(**item, **call_kwargs)`` for each item of ``inputs`` and record every denoiser linear's input
    range. The inputs should look like the generations to come (resolution, guidance, number of steps): a few
    prompts are enough, the scale is the max over every step of every call. Returns an :class:`Fp8Calibration`."""
    model = denoiser_of(pipe, "calibrate")
    if any(isinstance(m, StaticFp8Linear) for m in model.modules()):
        raise ValueError("calibrate: this denoiser already has fp8 layers (quantize_fp8 ran); calibrate the bf16 "
                         "model (dequantize_fp8 gives lossy bf16 layers back, not the originals)")
    items = list(inputs)
    if not items or not all(isinstance(item, dict) for item in items):
        raise ValueError("calibrate: inputs must be a non-empty list of dicts of pipeline arguments, e.g. "
                         "[{'prompt': 'a red cube'}]; got " + repr(inputs)[:120])
    linears = _linears(model)
    if not linears:
        raise ValueError(f"calibrate: {type(model).__name__} has no nn.Linear layers to calibrate")
    recorder = _Recorder(linears)
    try:
        for item in items:
            pipe(**item, **call_kwargs)
    finally:
        recorder.remove()
    amax = {name: float(value) for name, value in recorder.amax.items()}   # one sync per layer, after the runs
    bad = [name for name, value in amax.items() if not math.isfinite(value)]
    if bad:
        raise ValueError(f"calibrate: the input of {len(bad)} linear layer(s) held NaN or Inf during calibration "
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


class StaticFp8Linear(nn.Module):
    """An inference linear layer: W stored as e4m3 codes with one fp32 scale, x cast to e4m3 with a calibrated
    static scale, y = (x8 W8ᵀ) · x_inv · w_inv + b in x's dtype (``torch._scaled_mm``).

    Buffers: ``weight_fp8`` (N, K) e4m3, ``weight_scale_inv`` (1,), ``input_scale`` / ``input_scale_inv`` (1,),
    ``input_amax`` (1,) the calibrated range. An input beyond the calibrated range saturates at ±448 · x_inv.
    Under autograd (an input that requires grad) it runs F.linear on the dequantized weight, so that gradients reach
    what lies before it; it has no trainable weight.
    """

    def __init__(self, linear: nn.Linear, input_amax: float, margin: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        device = linear.weight.device
        w8, w_inv = fp8_ops.quantize_weight(linear.weight, "tensor")
        self.register_buffer("weight_fp8", w8)
        self.register_buffer("weight_scale_inv", w_inv)
        amax = torch.tensor([input_amax], dtype=torch.float32, device=device)
        scale = fp8_ops.scale_from_amax(amax, fp8_ops.FP8_MAX[fp8_ops.E4M3], margin, torch.ones_like(amax))
        self.register_buffer("input_amax", amax)
        self.register_buffer("input_scale", scale)
        self.register_buffer("input_scale_inv", scale.reciprocal())
        self.bias = linear.bias
        self.orig_dtype = linear.weight.dtype
        self.margin = margin
        self.train(linear.training)

    def __getattr__(self, name: str):
        if name == "weight":
            # code that reads or writes ``.weight`` (PEFT's merge, a weight tie) must not get a silent copy
            raise AttributeError("StaticFp8Linear holds e4m3 codes (weight_fp8), not a weight: merge LoRA adapters "
                                 "and tie weights before quantize_fp8, or call dequantize_fp8 first")
        return super().__getattr__(name)

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
            x8 = (x2.float() * self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(fp8_ops.E4M3)
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
        return (f"sits_lora fp8: {len(self.quantized)} linear layers in e4m3 with static input scales "
                f"({self.bytes_before / 2**20:.1f} -> {self.bytes_after / 2**20:.1f} MiB of weights); "
                f"{len(self.skipped)} left as they were{': ' + left if left else ''}")


@torch.no_grad()
def quantize_fp8(pipe, calibration: Fp8Calibration, min_rows: int = 256, margin: int = 0,
                 exclude: Iterable[str] = ()) -> Fp8Report:
    """Swap the denoiser's calibrated linear layers for :class:`StaticFp8Linear` (see the module docstring for which
    are left). ``margin``: the input scale is fp8_max / amax / 2**margin (1 leaves headroom for prompts wider than
    the calibration's, at a bit of precision). ``exclude``: substrings of layer names to keep in bf16."""
    model = denoiser_of(pipe, "quantize_fp8")
    if not isinstance(calibration, Fp8Calibration):
        raise TypeError(f"quantize_fp8: calibration must be an Fp8Calibration (from calibrate or "
                        f"Fp8Calibration.load), got {type(calibration).__name__}")
    for name, value in (("min_rows", min_rows), ("margin", margin)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"quantize_fp8: {name} must be an int >= 0, got {value!r}")
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    linears = _linears(model)
    unknown = [name for name in calibration.amax if name not in linears]
    if unknown and len(unknown) == len(calibration.amax):
        raise ValueError(f"quantize_fp8: none of the calibration's {len(unknown)} layers is a bf16 linear of this "
                         f"{type(model).__name__} (first: {unknown[0]!r}); it was measured on another model, or this "
                         f"one is quantized already. Calibrate this model.")
    parameter = next(model.parameters(), None)
    if parameter is not None and parameter.is_cuda:
        cc = torch.cuda.get_device_capability(parameter.device)
        if cc < MIN_CAPABILITY:
            raise RuntimeError(f"quantize_fp8 needs fp8 tensor cores (compute capability 8.9 or newer); "
                               f"{parameter.device} ({torch.cuda.get_device_name(parameter.device)}) has "
                               f"{cc[0]}.{cc[1]}. Keep this model in bf16.")
    quantized, skipped = [], {}
    before = after = 0
    for name, linear in linears.items():
        reason = None
        if any(pattern in name for pattern in exclude):
            reason = "excluded"
        elif name not in calibration.amax:
            reason = "not called during calibration"
        elif calibration.rows.get(name, 0) < min_rows:
            reason = f"fed fewer than min_rows={min_rows} rows a call"
        elif linear.in_features % 16 or linear.out_features % 16:
            reason = "dims not multiples of 16"
        elif calibration.amax[name] == 0.0:
            reason = "input all zeros in calibration"
        if reason is not None:
            skipped[name] = reason
            continue
        before += linear.weight.numel() * linear.weight.element_size()
        fp8 = StaticFp8Linear(linear, calibration.amax[name], margin)
        after += fp8.weight_fp8.numel()
        _set_module(model, name, fp8)
        quantized.append(name)
    report = Fp8Report(quantized, skipped, before, after)
    logger.info(report.summary())
    return report


@torch.no_grad()
def dequantize_fp8(pipe) -> int:
    """Swap every :class:`StaticFp8Linear` of the denoiser back for an ``nn.Linear`` holding its e4m3 values in
    the original dtype (lossy: the bf16 weights before quantize_fp8 are gone). Returns how many it swapped."""
    model = denoiser_of(pipe, "dequantize_fp8")
    names = [name for name, module in model.named_modules() if isinstance(module, StaticFp8Linear)]
    for name in names:
        _set_module(model, name, model.get_submodule(name).to_linear())
    return len(names)


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s :class:`StaticFp8Linear` layers."""
    return [name for name, module in model.named_modules() if isinstance(module, StaticFp8Linear)]


__all__ = ["Fp8Calibration", "Fp8Report", "StaticFp8Linear", "calibrate", "dequantize_fp8", "fp8_layers",
           "quantize_fp8"]
