"""sits_lora on diffusers pipelines: what runs around the denoising loop.

``LatentGuard``: a ``callback_on_step_end`` that stops a generation whose latents stop being finite, naming the
step and (``watch_modules=True``) the first module of the denoiser whose output was not finite.
``reuse_cross_attention_kv``: whether the cross-attention to_k / to_v layers give back their outputs while the
text encoder's states are the same tensor (on by default: every denoising step after the first skips them).
``graph_denoiser``: CUDA graphs over the denoiser's forward (a denoising step replays one recorded launch
sequence instead of issuing a few thousand kernels from Python).
``calibrate`` / ``quantize_fp8``: the denoiser's big linear layers (optionally its convolutions and the VAE
decoder's layers) in fp8 with static input scales measured on a few generations (``dequantize_fp8`` undoes it,
lossily).
``compile_blocks``: every block of the denoiser and the VAE's decoder compiled alone (GroupNorm, SiLU and residual
adds fused around the convolutions; seconds to compile where the whole U-Net takes minutes).
``merge_plan``: whether a run of generations should merge the LoRA or run it unmerged, from one denoiser call timed
both ways and one merge + unmerge on the pipeline as it is set up (compiled blocks and graphs included).
The adapter itself needs nothing from here: ``unet.add_adapter(SitsLoraConfig(...))`` and
``sits_lora.export_diffusers_lora`` (see docs/usage.md).
"""

from .compile import compile_blocks
from .fp8 import Fp8Calibration, Fp8Report, StaticFp8Conv2d, StaticFp8Linear, calibrate, dequantize_fp8, fp8_layers, quantize_fp8
from .graphs import DenoiserGraphs, graph_denoiser
from .guards import LatentGuard, NonFiniteLatentsError
from .plan import DenoiserCosts, DenoiserPlan, measure_denoiser_costs, merge_plan
from .reuse import reuse_cross_attention_kv

__all__ = ["DenoiserCosts", "DenoiserGraphs", "DenoiserPlan", "Fp8Calibration", "Fp8Report", "LatentGuard",
           "NonFiniteLatentsError", "StaticFp8Conv2d", "StaticFp8Linear", "calibrate", "compile_blocks",
           "dequantize_fp8", "fp8_layers", "graph_denoiser", "measure_denoiser_costs", "merge_plan", "quantize_fp8",
           "reuse_cross_attention_kv"]
