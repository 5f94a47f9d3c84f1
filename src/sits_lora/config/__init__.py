"""The adapter's configuration: :class:`SitsLoraConfig` (``adapter.py``), its PEFT type (``peft_type.py``) and the
checks of each feature's fields (``dynamic_rank.py``, ``fp8.py``, ``int4.py``).

The features build on this package and it imports none of them: a feature's field rules live here, beside the
table of checks that ``SitsLoraConfig.__post_init__`` runs. The feature modules import only
``sits_lora.utils.validation``, so the recipe can check its options before torch loads; the names below load
their module on first use for the same reason.
"""

from __future__ import annotations

from ..utils.lazy import lazy_exports

_EXPORTS = {
    "SitsLoraConfig": ".adapter",
    "KERNEL_CHOICES": ".adapter",
    "SITS_LORA_NAME": ".peft_type",
    "sits_lora_peft_type": ".peft_type",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
