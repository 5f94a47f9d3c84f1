"""Activation memory: what a LoRA step keeps between forward and backward, and how to keep less.

``recompute``: the LoRA layers save no input of their own where the frozen model already keeps what the
input is made from (``SitsLoraConfig(recompute_lora_inputs=True)``, the default; attached by
``get_peft_model``). ``input_recompute_report(model)`` says which layer rebuilds its input and which
saves it.
"""

from __future__ import annotations

from .patch import attach_input_recompute, detach_input_recompute, input_recompute_report

__all__ = ["attach_input_recompute", "detach_input_recompute", "input_recompute_report"]
