"""Every block of a diffusion pipeline compiled alone: inductor fuses what runs between cuDNN's convolutions.

After fp8 linears and CUDA graphs, an SDXL U-Net call spends much of its GPU time outside the linears and the
attention: GroupNorm, SiLU, residual adds and the layout copies around cuDNN's convolutions (docs/diffusion.md).
``torch.compile`` of the whole U-Net fuses them but takes minutes at the SDXL shape; diffusers'
``compile_repeated_blocks`` compiles only the transformer blocks, which leaves them. Here each block is compiled
alone, so a few block shapes compile in seconds: the transformer blocks, the ResNet blocks and the down / upsamplers
of a U-Net (the blocks of a DiT), and the VAE's decoder as a whole. With ``channels_last`` (the default) the U-Net
and the VAE take cuDNN's own layout, whose copies disappear once inductor writes the GroupNorm and SiLU kernels for
it (eager GroupNorm is slower in that layout: compile and channels_last go together).

    pipe = StableDiffusionXLPipeline(...).to("cuda")
    sits_lora.diffusion.compile_blocks(pipe)      # the first image compiles; then, e.g., graph_denoiser(pipe)

Compiling the blocks makes an image faster than fp8 linears and CUDA graphs alone, and channels_last faster still
(docs/diffusion.md, "Every block compiled", gives the timings). A sits_lora adapter's cross-attention to_k / to_v
keep their outputs across the steps of a generation (``reuse_cross_attention_kv``) inside compiled blocks too: that
decision is Python (tensor identity and version counters), which dynamo does not trace, so each of those calls is
one opaque operator in the block's graph whose body runs the eager group (sits_lora.layers.siblings): no graph break, the
block stays one graph (a break there would split each transformer block into several graphs,
`bench/diffusion_graph_breaks.py`).
``keep_cross_attention_kv=False`` compiles to_k / to_v into the graph instead, recomputed every step as the base
model's are.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .reuse import cross_attention_groups, denoiser_of

# Blocks compiled one by one: those diffusers' models name as repeated (``_repeated_blocks``) plus these.
BLOCK_CLASSES = ("BasicTransformerBlock", "JointTransformerBlock", "FluxTransformerBlock",
                 "FluxSingleTransformerBlock", "ResnetBlock2D", "Downsample2D", "Upsample2D")
# Each block class compiles once per input shape (a U-Net has a few levels): room for all of them.
_SHAPES_PER_BLOCK = 64
_MODES = (None, "default", "max-autotune-no-cudagraphs")


def compile_blocks(pipe_or_model, vae: bool = True, channels_last: bool = True,
                   mode: Optional[str] = None, keep_cross_attention_kv: bool = True) -> list[str]:
    """Compile every block of the pipeline's denoiser (or of the denoiser given) alone with ``torch.compile`` and,
    with ``vae``, the pipeline's VAE decoder as a whole; ``channels_last``: the denoiser and the VAE in that memory
    format first (4-D weights: a DiT is unchanged). ``mode``: torch.compile's mode (None: the default; CUDA-graph
    modes would record inside each block, use ``graph_denoiser`` over the whole call instead). Returns the names of
    the compiled modules. The first call of each block shape compiles (seconds each). ``keep_cross_attention_kv``:
    the adapter's cross-attention groups keep their K / V across calls under compile as they do eagerly (add the
    adapter before this call; the groups that exist now are the ones set)."""
    model = denoiser_of(pipe_or_model, "compile_blocks")
    if mode not in _MODES:
        raise ValueError(f"compile_blocks: mode={mode!r} records CUDA graphs inside every block; use None, "
                         "'default' or 'max-autotune-no-cudagraphs' and sits_lora.diffusion.graph_denoiser for "
                         "graphs over the whole denoiser call")
    classes = set(BLOCK_CLASSES) | set(getattr(model, "_repeated_blocks", ()) or ())
    if channels_last:
        model.to(memory_format=torch.channels_last)
    for group in cross_attention_groups(model):
        group.keep_under_compile = keep_cross_attention_kv
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = max(limit, _SHAPES_PER_BLOCK)
    compiled = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not _inside(name, compiled):
            module.compile(mode=mode)
            compiled.append(name)
    decoder = getattr(getattr(pipe_or_model, "vae", None), "decoder", None) if vae else None
    if isinstance(decoder, nn.Module):
        if channels_last:
            pipe_or_model.vae.to(memory_format=torch.channels_last)
        decoder.compile(mode=mode)
        compiled.append("vae.decoder")
    if not compiled:
        raise ValueError(f"compile_blocks: {type(model).__name__} has none of the blocks it compiles "
                         f"({', '.join(sorted(classes))}); torch.compile(model) compiles it whole")
    return compiled


def _inside(name: str, compiled: list) -> bool:
    """Whether module ``name`` lies inside a block already compiled (it is compiled with it)."""
    return any(name.startswith(parent + ".") for parent in compiled)


__all__ = ["BLOCK_CLASSES", "compile_blocks"]
