"""The recipe's Liger-Kernel choice: whether the run uses it (``TrainRecipe.liger``: auto, true, false) and, under
FSDP, which of its kernels. liger-kernel and torch load inside the functions."""

from __future__ import annotations

import os
from typing import Optional


def liger_model_types() -> Optional[frozenset]:
    """The model types Liger-Kernel patches (None when liger-kernel is not installed)."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def resolve_liger(requested, model_type: str, cuda: Optional[bool] = None) -> tuple[bool, str]:
    """(on, one line saying why) for TrainRecipe.liger = requested on a model of ``model_type``.

    True must run (check_machine already refused a machine without CUDA or liger-kernel); an unsupported
    model type is refused here, after loading, the first moment it is known. "auto" turns it on wherever
    it runs and says what is lost where it does not."""
    if requested is False:
        return False, "off (liger: false)"
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        return False, "off (no CUDA GPU: Liger-Kernel's kernels are Triton GPU kernels)"
    types = liger_model_types()
    if types is None:
        return False, ("off: liger-kernel is not installed (pip install 'sits-lora[gpu]'); without it the norms, "
                       "SwiGLU and the cross-entropy over the full logits stay unfused: a LoRA step runs slower and its "
                       "peak memory is much higher (docs/performance.md)")
    if model_type not in types:
        if requested is True:
            raise ValueError(f"liger=true: Liger-Kernel has no kernels for model type {model_type!r} (it patches "
                             f"{', '.join(sorted(types))}); set liger: auto or false")
        return False, f"off: Liger-Kernel does not support model type {model_type!r}"
    return True, f"on ({model_type}: fused RMSNorm, RoPE, SwiGLU and linear cross-entropy, applied by the Trainer)"


def under_accelerate_fsdp() -> bool:
    """Whether this process was started by ``accelerate launch`` with its FSDP plugin (the variable it sets)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def liger_kernel_config(use_liger: bool, fsdp: bool) -> tuple[Optional[dict], str]:
    """(TrainingArguments.liger_kernel_config, what to add to the Liger line) for a run under FSDP or not.

    Liger's fused linear cross-entropy reads ``lm_head.weight`` outside ``lm_head``'s forward; FSDP2 gathers a
    module's parameters only around its own forward (accelerate shards the final norm and ``lm_head`` as a unit
    of their own), so the loss would read a shard and stop on mixing a DTensor with a tensor. Under FSDP the
    cross-entropy runs on the logits (Liger's kernel), the other Liger kernels as they are."""
    if not (use_liger and fsdp):
        return None, ""
    return ({"fused_linear_cross_entropy": False, "cross_entropy": True},
            "; under FSDP its cross-entropy runs on the logits (the fused one reads lm_head's weight outside its "
            "forward, where FSDP2 holds a shard)")
