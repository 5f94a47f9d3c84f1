"""Serving adapters: several adapters in one batch (``model(..., adapter_names=[...])`` and ``generate`` with
``adapter_names``) on sits_lora's segmented kernels instead of PEFT's loop over adapters (``mixed_batch``), and many
adapters served from a few GPU slots with the rest in pinned host memory (``AdapterPool``)."""

from .mixed_batch import mixed_batch_forward
from .pool import AdapterPool

__all__ = ["AdapterPool", "mixed_batch_forward"]
