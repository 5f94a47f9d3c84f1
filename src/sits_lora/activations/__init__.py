"""Activation memory: what a LoRA step keeps between forward and backward, and how to keep less.

``recompute``: the LoRA layers save no input of their own where the frozen model already keeps what the
input is made from (``SitsLoraConfig(recompute_lora_inputs=True)``, the default; attached by
``get_peft_model``). ``input_recompute_report(model)`` says which layer rebuilds its input and which
saves it.

``offload``: saved tensors in pinned host memory, copied on a side stream (``offload_saved_tensors``), per
decoder layer (``enable_activation_offload``), and gradient checkpointing whose kept layer inputs live there
(``enable_offloaded_checkpointing``).

``tiled_mlp``: the MLP run over the sequence in tiles at long context, keeping only its input
(``tile_mlp``).

``selective``: checkpointing that keeps attention's output and recomputes the rest of each layer
(``selective_checkpointing_kwargs``).
"""

from __future__ import annotations

from .offload import (disable_activation_offload, enable_activation_offload, enable_offloaded_checkpointing,
                      offload_saved_tensors, offloaded_checkpoint)
from .patch import attach_input_recompute, detach_input_recompute, input_recompute_report
from .selective import selective_checkpointing_kwargs
from .tiled_mlp import tile_mlp, untile_mlp

__all__ = ["attach_input_recompute", "detach_input_recompute", "disable_activation_offload",
           "enable_activation_offload", "enable_offloaded_checkpointing",
           "input_recompute_report", "offload_saved_tensors", "offloaded_checkpoint", "selective_checkpointing_kwargs",
           "tile_mlp", "untile_mlp"]
