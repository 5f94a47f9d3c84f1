"""SitsLoraConfig: a PEFT ``LoraConfig`` with its own peft type and the sits_lora fields.

Every field PEFT's LoraConfig has keeps its meaning. The sits_lora fields carry help text in their metadata: the
layer's own below, each feature's in its module of this package (``DynamicRankFields``, ``Fp8Fields``,
``Int4Fields``, which SitsLoraConfig inherits, so adapter_config.json stays flat). ``__post_init__`` checks them all
with one table of validators, each feature adding its ``FIELD_CHECKS``. Checks that need the model (a rank
larger than a layer, a target module that matches nothing) run when the adapter is injected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from peft import LoraConfig

from ..utils import validation
from . import dynamic_rank as dynamic_rank_checks
from . import fp8 as fp8_checks
from . import int4 as int4_checks
from .dynamic_rank import DynamicRankFields
from .fp8 import Fp8Fields
from .int4 import Int4Fields
from .peft_type import sits_lora_peft_type

KERNEL_CHOICES = ("auto", "triton", "torch")


def _pattern_of_ranks(value: Any) -> Optional[str]:
    if not isinstance(value, dict):
        return "it must be a dict mapping a module name or regex to a rank, e.g. {'down_proj': 8}"
    for key, rank in value.items():
        if not validation.is_int(rank) or rank <= 0:
            return f"the rank for {key!r} is {rank!r}; every rank must be a positive integer"
    return None


# Field name -> check (sits_lora.utils.validation: None when the value is valid, else what is allowed).
# LoraConfig's own fields are listed where PEFT does not already reject a bad value with a clear message.
_VALIDATORS: dict[str, validation.Check] = {
    "r": validation.positive_int(" (the LoRA rank), e.g. r=16"),
    "lora_alpha": validation.number(", e.g. lora_alpha=32"),
    "lora_dropout": validation.probability(", e.g. lora_dropout=0.05"),
    "rank_pattern": _pattern_of_ranks,
    "kernel": validation.choice(KERNEL_CHOICES),
    "fuse_siblings": validation.boolean,
    "recompute_lora_inputs": validation.boolean,
    "bias": validation.choice(("none", "all", "lora_only")),
    **dynamic_rank_checks.FIELD_CHECKS,
    **fp8_checks.FIELD_CHECKS,
    **int4_checks.FIELD_CHECKS,
}


@dataclass
class SitsLoraConfig(DynamicRankFields, Fp8Fields, Int4Fields, LoraConfig):
    """Configuration of a sits_lora adapter.

    Accepts every argument of :class:`peft.LoraConfig` plus the fields below, grouped by feature (each field's
    ``help`` metadata says more; a feature's fields are declared in its module of sits_lora.config). Saved flat in adapter_config.json with ``peft_type: SITS_LORA``;
    ``import sits_lora`` registers the type so that ``PeftModel.from_pretrained`` can load it again. A bad value
    raises ValueError naming the field, the value and what is allowed, when the config is made.

    Args:
        kernel: the implementation of the adapted linear layers: "auto" (the fused Triton kernels on a CUDA
            GPU in bf16 / fp16, the PyTorch reference elsewhere), "triton" or "torch".
        fuse_siblings: run layers of one parent that read one input (q/k/v, gate/up) as one operation.
        recompute_lora_inputs: save no LoRA input for backward where the frozen model keeps what it is made of.

        use_dynamic_rank: per-token dynamic rank (nested ranks, a router per layer, a budget).
        rank_scheduler: how a token's rank is chosen: "entropy-gated", "learned", "random" or "static".
        rank_buckets: the ranks a token may use, increasing, the last equal to r (None: steps of 16).
        target_mean_rank: the mean active rank the budget holds.
        rank_histogram: "random" only: the fraction of tokens per bucket.
        router_temperature: the routers' Gumbel-softmax temperature in training.
        rank_budget_step_size: the budget's dual-ascent step size (None: the mode's default).
        rank_budget_mode: how the budget reaches the routers: "price", "target" or "ceiling".

        fp8: the fp8 frozen base: "off", "hybrid" (e4m3 forward, e5m2 backward) or "e4m3".
        fp8_amax_history_len: steps of absolute maxima each layer keeps for delayed scaling.
        fp8_amax_compute_algo: the amax a scale comes from: "max" over the history or "most_recent".
        fp8_margin: headroom in powers of two below the fp8 range.
        fp8_weight_scale: one scale per weight ("tensor") or per output row ("row").
        fp8_keep_bf16_weight: keep the bf16 base beside the fp8 one (exact merges, twice the memory).
        fp8_emulate: the fp8 numerics in plain PyTorch on any device (tests).
        fp8_layers: "auto" (fp8 only where it is faster on this GPU) or "all".

        base_quant: the 4-bit frozen base without bitsandbytes: "off" or "int4".
        int4_group_size: input features per INT4 scale / min pair (a power of two, at least 32).
    """

    kernel: Literal["auto", "triton", "torch"] = field(
        default="auto",
        metadata={
            "help": (
                "Which implementation runs the LoRA linear layers. 'torch': the plain PyTorch reference "
                "(sits_lora.ops.reference), on any device. 'triton': the fused Triton kernels (a CUDA GPU, "
                "or the CPU under TRITON_INTERPRET=1 for testing). 'auto': the fastest one available on the "
                "layer's device."
            )
        },
    )
    fuse_siblings: bool = field(
        default=True,
        metadata={
            "help": (
                "Run adapted layers of one parent that read the same input (q/k/v, gate/up) as one "
                "operation on the Triton path: one pass over the input for all of them in forward and "
                "backward, and one saved copy of it. Eager mode only; no effect on outputs."
            )
        },
    )
    recompute_lora_inputs: bool = field(
        default=True,
        metadata={
            "help": (
                "Save no LoRA input for backward where the frozen model already keeps what it is made from: "
                "the q/k/v and gate/up input is rebuilt from the norm's input, o_proj's from the output that "
                "attention keeps, down_proj's from the gate and up outputs (sits_lora.activations). The "
                "gradients are bit-identical; the adapter's activation memory goes, for the cost of "
                "recomputing those inputs in backward. Eager mode; torch.compile decides what it saves itself."
            )
        },
    )

    def __post_init__(self) -> None:
        validation.validate(_VALIDATORS, lambda name: getattr(self, name),
                            lambda name, value: f"SitsLoraConfig.{name}={value!r}")
        dynamic_rank_checks.check_dynamic_rank_config(self)
        fp8_checks.check_fp8_config(self)
        int4_checks.check_base_quant_config(self)
        super().__post_init__()
        self.peft_type = sits_lora_peft_type()

    # PEFT's save_pretrained(path_initial_model_for_weight_conversion=...), which turns a PiSSA / OLoRA / CorDA
    # adapter into a plain one, resets the initial adapter's init with ``init_lora_weights = True`` when the
    # peft type is LORA and ``init_weights = True`` for any other type: both names are this config's one field
    @property
    def init_weights(self):
        return self.init_lora_weights

    @init_weights.setter
    def init_weights(self, value) -> None:
        self.init_lora_weights = value
