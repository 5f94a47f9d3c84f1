"""sits_lora on diffusers pipelines: what runs around the denoising loop.

``LatentGuard``: a ``callback_on_step_end`` that stops a generation whose latents stop being finite, naming the
step and (``watch_modules=True``) the first module of the denoiser whose output was not finite.
The adapter itself needs nothing from here: ``unet.add_adapter(SitsLoraConfig(...))`` and
``sits_lora.export_diffusers_lora`` (see docs/usage.md).
"""

from .guards import LatentGuard, NonFiniteLatentsError

__all__ = ["LatentGuard", "NonFiniteLatentsError"]
