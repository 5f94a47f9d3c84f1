"""Serving adapters: several adapters in one batch (``model(..., adapter_names=[...])`` and ``generate`` with
``adapter_names``) on sits_lora's segmented kernels instead of PEFT's loop over adapters (``mixed_batch``)."""

from .mixed_batch import mixed_batch_forward

__all__ = ["mixed_batch_forward"]
