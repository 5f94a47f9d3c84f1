"""SitsLoraConfig: a PEFT ``LoraConfig`` with its own peft type and the sits_lora fields.

Every field PEFT's LoraConfig has keeps its meaning. The sits_lora fields below carry help text
in their metadata and are checked in ``__post_init__`` by one table of validators, so a new field
(dynamic rank, fp8, ...) adds one entry there and nothing else. Checks that need the model (a rank
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
class SitsLoraConfig(LoraConfig):
    """Configuration of a sits_lora adapter.

    Accepts every argument of :class:`peft.LoraConfig` plus the fields below, grouped here by feature (each
    field's ``help`` metadata says more). Saved flat in adapter_config.json with ``peft_type: SITS_LORA``;
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

    use_dynamic_rank: bool = field(
        default=False,
        metadata={
            "help": (
                "Per-token dynamic rank (sits_lora.dynamic_rank): the rank dimensions are trained nested "
                "(the first k of them form a working adapter of rank k) and each token uses the first "
                "b dimensions, b from rank_buckets, chosen by rank_scheduler under the target_mean_rank "
                "budget. Adapted layers must be torch.nn.Linear; not with rank_pattern, alpha_pattern, "
                "use_dora or lora_bias. merge_and_unload needs a static adapter first "
                "(sits_lora.truncate_rank(model, k))."
            ),
            # PEFT resolves LoRA variants from fields tagged so: SitsLoraLinear.lora_variants maps this one to
            # sits_lora.dynamic_rank.variant.DynamicRankVariant
            "is_lora_variant": True,
        },
    )
    rank_scheduler: Literal["entropy-gated", "learned", "random", "static"] = field(
        default="entropy-gated",
        metadata={
            "help": (
                "How each token's bucket is chosen (with use_dynamic_rank=True). 'entropy-gated': a router "
                "per adapted layer reads the token's hidden state and the entropy predicted by a probe fitted "
                "with TokenEntropySampler. 'learned': the same router without the entropy feature. 'random': "
                "buckets drawn at random with rank_histogram (or the most spread-out histogram of mean "
                "target_mean_rank). 'static': no routing, every token uses the full rank r at inference; "
                "training draws one bucket per sequence, the same in every layer of the forward, so the "
                "adapter can be truncated to any bucket (sits_lora.dynamic_rank.nested)."
            )
        },
    )
    rank_buckets: Optional[list] = field(
        default=None,
        metadata={
            "help": (
                "The ranks a token may use, strictly increasing, the last equal to r, e.g. [16, 32, 48, 64]; "
                "a first bucket of 0 lets a token skip the adapter. Multiples of 16 suit tensor-core kernels. "
                "None: steps of 16 up to r (r a multiple of 16)."
            )
        },
    )
    target_mean_rank: Optional[float] = field(
        default=None,
        metadata={
            "help": (
                "The mean active rank over non-padding tokens that the budget holds ('entropy-gated', "
                "'learned': a Lagrange multiplier updated by dual ascent; 'random': the histogram's mean). "
                "Must lie between the smallest and the largest bucket."
            )
        },
    )
    rank_histogram: Optional[list] = field(
        default=None,
        metadata={
            "help": (
                "rank_scheduler='random' only: the fraction of tokens per bucket (one per bucket, summing to "
                "1), e.g. the histogram a learned router reached, to test routing against chance."
            )
        },
    )
    router_temperature: float = field(
        default=1.0,
        metadata={
            "help": (
                "Gumbel-softmax temperature of the router in training: the forward pass uses the hard "
                "bucket, the gradient flows through the softmax at this temperature (straight-through)."
            )
        },
    )
    rank_budget_step_size: Optional[float] = field(
        default=None,
        metadata={
            "help": (
                "Dual-ascent step size η of the rank budget: after each optimizer step "
                "λ ← λ + η·(mean active rank − target_mean_rank) / r (clamped at 0 with rank_budget_mode='ceiling')."
                " None: 6.0 with rank_budget_mode='price' (λ moves the routers' logits directly), 0.5 otherwise."
            )
        },
    )
    rank_budget_mode: Literal["target", "ceiling", "price"] = field(
        default="price",
        metadata={
            "help": (
                "'price' (default): λ is a price on rank in the routing decision itself: each step shifts every "
                "router's bucket biases by -Δλ·b_k/r (no budget term in the gradient), so the decisions follow "
                "at once; the biases save with the adapter, so inference routes with the final price. "
                "'target': λ reaches the routers through their gradient and holds the mean from both sides "
                "(λ may turn negative); it lags, so the mean swings around the target (docs/dynamic-rank.md). "
                "'ceiling': as 'target' with λ ≥ 0, so target_mean_rank is only an upper bound."
            )
        },
    )

    fp8: Literal["off", "hybrid", "e4m3"] = field(
        default="off",
        metadata={
            "help": (
                "FP8 frozen base (sits_lora.fp8). 'hybrid': the base weight of each adapted layer is quantized "
                "once to e4m3, activations are cast to e4m3 in forward and gradients to e5m2 in backward, with "
                "delayed scaling, and both base GEMMs run in fp8 (torch._scaled_mm); the LoRA branch stays in "
                "bf16. 'e4m3': the same with e4m3 gradients. Needs a GPU of compute capability 8.9 or newer, "
                "or fp8_emulate=True. Adapted layers must be torch.nn.Linear with in and out features "
                "multiples of 16, or bitsandbytes 4-bit layers (QLoRA), which keep their 4-bit storage and run "
                "their GEMMs in fp8 (docs/quantization.md). 'off': the bf16 path."
            )
        },
    )
    fp8_amax_history_len: int = field(
        default=1024,
        metadata={
            "help": (
                "Delayed scaling (Transformer Engine's DelayedScaling): how many optimizer steps of each "
                "activation's and gradient's absolute maximum (amax) each layer keeps."
            )
        },
    )
    fp8_amax_compute_algo: Literal["max", "most_recent"] = field(
        default="max",
        metadata={
            "help": (
                "The amax a scale is computed from: 'max' over the history (safe against spikes), or "
                "'most_recent' (the last step's, follows the data fastest)."
            )
        },
    )
    fp8_margin: int = field(
        default=0,
        metadata={"help": "Headroom in powers of two: scale = (fp8_max / amax) / 2**fp8_margin."},
    )
    fp8_weight_scale: Literal["tensor", "row"] = field(
        default="tensor",
        metadata={
            "help": (
                "Granularity of the frozen weight's fp8 scale: 'tensor' (one scale, cuBLAS fp8 GEMM) or 'row' "
                "(one scale per output row: more accurate with outlier rows; row-wise torch._scaled_mm, "
                "bf16 activations only)."
            )
        },
    )
    fp8_keep_bf16_weight: bool = field(
        default=False,
        metadata={
            "help": (
                "Keep the original bf16 base weight beside the fp8 one (2x the frozen-weight memory): merges "
                "and unload then give back the exact bf16 base. False frees it (fp8 weight + scale: about "
                "0.5x the bf16 bytes) and merges start from the dequantized fp8 weight."
            )
        },
    )
    fp8_emulate: bool = field(
        default=False,
        metadata={
            "help": (
                "Run the fp8 numerics by quantize-dequantize in plain PyTorch on any device (CPU, older GPUs): "
                "the same casts, scales and amax records, fp32 matrix products. For tests; slow."
            )
        },
    )
    fp8_layers: Literal["auto", "all"] = field(
        default="auto",
        metadata={
            "help": (
                "Which adapted layers get the fp8 base. 'auto': only those whose shape makes fp8 faster than "
                "the bf16 fused path on this GPU (a measured crossover from `python bench/tune_kernels.py "
                "--fp8` stored with the tuned kernel configs; without a measurement for a shape, fp8 where "
                "in_features x out_features >= 32 Mi); the others keep the bf16 path. "
                "sits_lora.fp8.fp8_layer_plan(model) says which layer got which, and why. With fp8_emulate "
                "every layer is quantized (emulation has no speed to win). 'all': every adapted layer."
            )
        },
    )

    base_quant: Literal["off", "int4"] = field(
        default="off",
        metadata={
            "help": (
                "4-bit frozen base without bitsandbytes (sits_lora.int4). 'int4': the base weight of each adapted "
                "layer is quantized once at injection (weight-only, asymmetric, one scale and min per "
                "int4_group_size input features, rows padded to 32-byte multiples: 0.27x the bf16 bytes at group "
                "size 128); forward and dX run from the packed codes, the LoRA branch stays in the model's dtype. "
                "Adapted layers must be torch.nn.Linear. For bitsandbytes NF4 / FP4, load the model with "
                "BitsAndBytesConfig(load_in_4bit=True) and leave this 'off'."
            )
        },
    )
    int4_group_size: int = field(
        default=128,
        metadata={"help": "Input features per INT4 scale / min pair: a power of two of at least 32 that divides "
                          "every adapted layer's in_features."},
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
