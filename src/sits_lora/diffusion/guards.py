"""A NaN / Inf check on the latents of a diffusers pipeline, step by step."""

from __future__ import annotations

from typing import Optional

import torch

from ..training.guards import ActivationWatch


class NonFiniteLatentsError(FloatingPointError):
    """The latents of a denoising step hold NaN or Inf."""


class LatentGuard:
    """``pipe(..., callback_on_step_end=LatentGuard(pipe))``: after each denoising step, one ``isfinite`` reduction
    over the latents (one host read a step); when they are not finite, :class:`NonFiniteLatentsError` names the
    step and its timestep. ``watch_modules=True`` also hooks every module of the denoiser (``pipe.unet`` or
    ``pipe.transformer``) and names the first, in call order, whose output was not finite in that step: a
    debugging aid that costs one small reduction per module call.
    """

    def __init__(self, pipe=None, watch_modules: bool = False):
        self.watch: Optional[ActivationWatch] = None
        if watch_modules:
            denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
            if denoiser is None:
                raise ValueError("LatentGuard(watch_modules=True) needs the pipeline: pass LatentGuard(pipe, "
                                 "watch_modules=True) for a pipeline with a unet or a transformer")
            self.watch = ActivationWatch()
            self.watch.attach(denoiser)

    def __call__(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        latents = callback_kwargs.get("latents")
        if latents is None:
            raise ValueError("LatentGuard: the pipeline passed no latents; call it with "
                             "callback_on_step_end_tensor_inputs=['latents'] (the default)")
        module = self.watch.first_nonfinite() if self.watch is not None else None   # also resets the step's record
        if not bool(torch.isfinite(latents).all()):
            t = float(timestep) if isinstance(timestep, torch.Tensor) else timestep
            where = (f"; the first module whose output was not finite: {module}" if module is not None else
                     "; LatentGuard(pipe, watch_modules=True) names the first module whose output was not finite"
                     if self.watch is None else "; every module's output was finite (the scheduler step made it)")
            raise NonFiniteLatentsError(f"denoising step {step} (timestep {t:g}): the latents hold NaN or Inf{where}")
        return callback_kwargs

    def detach(self) -> None:
        """Remove the module hooks (``watch_modules=True``)."""
        if self.watch is not None:
            self.watch.detach()
