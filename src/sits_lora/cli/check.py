"""``sits-lora check``: the hardware report and the constraints of a training run, without training.

The model is built on the meta device from its configuration (no weights are read), wrapped with
the adapter the recipe describes, and checked by the guard rails of ``sits_lora.training``: the
memory plan against the memory budget, each adapted layer's rank against its roofline ceiling,
host<->device bytes per step against the step time, and the 4-bit layers' alignment. It answers in
about a second after the imports, whatever the model size.

A GGUF file's configuration is read from its header by a small parser here (transformers reads the
whole tokenizer for it: 9 s for SmolLM2-135M on a 2-core CPU, against milliseconds).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..recipe.loading import require_reachable, resolve_model_source


class CheckError(ValueError):
    """A bad argument to the command line: one line, no traceback."""


# ----------------------------------------------------------------------------- recipe


def load_recipe(config_path: Optional[str] = None, **overrides):
    """A :class:`sits_lora.recipe.train.TrainRecipe` from a YAML file of its fields and overrides (None = keep)."""
    import yaml

    from ..recipe.train import TrainRecipe

    values: dict = {}
    if config_path is not None:
        if not os.path.isfile(config_path):
            raise CheckError(f"--config {config_path}: no such file (give a YAML file of recipe fields such as "
                             f"'r: 16', docs/usage.md lists them; or leave --config out for the defaults)")
        try:
            with open(config_path) as f:
                values = yaml.safe_load(f) or {}
        except yaml.YAMLError as error:
            raise CheckError(f"--config {config_path}: not valid YAML ({str(error).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise CheckError(f"--config {config_path}: expected a mapping of TrainRecipe fields, got "
                             f"{type(values).__name__}")
        unknown = sorted(set(values) - set(TrainRecipe.field_names()))
        if unknown:
            raise CheckError(f"--config {config_path}: unknown keys {unknown}; allowed: "
                             f"{', '.join(TrainRecipe.field_names())}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return TrainRecipe(**values)
    except (TypeError, ValueError) as error:
        raise CheckError(f"{'--config ' + config_path + ': ' if config_path else ''}{error}") from None


def recipe_dtype(recipe) -> torch.dtype:
    """The dtype the recipe trains in on this machine ("auto": bf16 on CUDA, fp32 on the CPU)."""
    from ..recipe.train import torch_dtype_named

    return torch_dtype_named(recipe.dtype)


# ----------------------------------------------------------------------------- model configuration

# GGUF metadata value types (the GGUF specification): fixed-size scalars, 8 string, 9 array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# Architectures whose configuration this parser rebuilds exactly as transformers does (a test
# compares the two); any other architecture goes through transformers' own reader.
_GGUF_FAST_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class _GgufHeader:
    """The metadata and tensor names of a GGUF file; array values are kept only when short."""

    def __init__(self, path: str):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            if blob[:4] != b"GGUF":
                raise CheckError(f"--model {path}: not a GGUF file (no GGUF magic bytes)")
            version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
            if version not in (2, 3):
                raise CheckError(f"--model {path}: GGUF version {version} is not supported (2 and 3 are)")
            self._blob, self._pos = blob, 24
            self.metadata: dict = {}
            for _ in range(kv_count):
                key = self._string()
                (kind,) = self._unpack("<I")
                self.metadata[key] = self._value(kind)
            self.tensor_names = []
            for _ in range(tensor_count):
                self.tensor_names.append(self._string())
                (dims,) = self._unpack("<I")
                self._pos += 8 * dims + 4 + 8  # dims, ggml type, data offset
            self._blob = None

    def _unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self._blob, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = bytes(self._blob[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, kind: int):
        if kind in _GGUF_SCALARS:
            return self._unpack(_GGUF_SCALARS[kind])[0]
        if kind == 8:
            return self._string()
        if kind == 9:
            (item_kind,) = self._unpack("<I")
            (count,) = self._unpack("<Q")
            if item_kind in _GGUF_SCALARS and count > 64:  # token scores, types: skipped in one step
                self._pos += count * struct.calcsize(_GGUF_SCALARS[item_kind])
                return ("array", count)
            if item_kind == 8 and count > 64:  # the vocabulary and merges
                for _ in range(count):
                    (n,) = self._unpack("<Q")
                    self._pos += n
                return ("array", count)
            return [self._value(item_kind) for _ in range(count)]
        raise CheckError(f"GGUF metadata value type {kind} is unknown")


def _gguf_config_dict(path: str) -> Optional[dict]:
    """The transformers configuration of a GGUF file, or None for architectures left to transformers."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    header = _GgufHeader(path)
    md = header.metadata
    arch = md.get("general.architecture")
    if arch not in _GGUF_FAST_ARCHITECTURES:
        return None
    mapping = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    # transformers' own rules (modeling_gguf_pytorch_utils.load_gguf_checkpoint): llama.cpp names
    # Mistral "llama", the output matrix is absent when the embeddings are tied.
    updated = "mistral" if arch == "llama" and md.get("general.name") == "mistral" else arch
    config: dict = {"tie_word_embeddings": "output.weight" not in header.tensor_names}
    for key, value in md.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        renamed = mapping.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1 or isinstance(value, tuple):
            continue
        config[renamed] = value.replace(arch, updated) if isinstance(value, str) else value
    if "vocab_size" not in config and isinstance(md.get("tokenizer.ggml.tokens"), tuple):
        config["vocab_size"] = md["tokenizer.ggml.tokens"][1]
    return config


def model_config(spec: Optional[str]):
    """(transformers config, ModelSource) of a --model value, reading no weights."""
    from transformers import AutoConfig

    try:
        source = resolve_model_source(spec)
        require_reachable(source)
    except FileNotFoundError as error:  # ModelNotFoundError: already one clear line
        raise CheckError(str(error)) from None
    try:
        if source.gguf_file:
            config_dict = _gguf_config_dict(os.path.join(source.location, source.gguf_file))
            if config_dict is not None:
                return AutoConfig.for_model(**config_dict), source
            return AutoConfig.from_pretrained(source.location, gguf_file=source.gguf_file), source
        return AutoConfig.from_pretrained(source.location), source
    except (OSError, ValueError, KeyError) as error:
        if isinstance(error, CheckError):
            raise
        raise CheckError(f"--model {source.describe()}: cannot read its configuration: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None


def adapter_config(recipe, model=None, source=None):
    """The recipe's SitsLoraConfig; with ``base_quant: int4`` the group size the recipe would pick for ``model``
    loaded from ``source`` (a ModelSource)."""
    from ..config import SitsLoraConfig
    from ..recipe.train import int4_fields

    if recipe.base_quant == "nf4":
        raise CheckError("base_quant: nf4 is not planned by `sits-lora check` (the model would have to load through "
                         "bitsandbytes); check the run with base_quant: int4 or off")
    try:
        block = source.quantized_block() if source is not None and recipe.base_quant == "int4" else None
        quant = int4_fields(recipe, model, quiet=True, source_block=block) if model is not None else {}
        return SitsLoraConfig(r=recipe.r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout,
                              target_modules=list(recipe.target_modules), kernel=recipe.kernel, task_type="CAUSAL_LM",
                              **quant)
    except ValueError as error:
        raise CheckError(str(error)) from None


def build_meta_model(config, recipe, dtype: torch.dtype, source=None):
    """The recipe's adapted model on the meta device (shapes only, no memory, no weights)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # from_config picks the attention implementation from_pretrained would (sdpa)
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    try:
        return get_peft_model(model, adapter_config(recipe, model, source))
    except ValueError as error:
        raise CheckError(str(error).splitlines()[0]) from None


def adapted_linear_shapes(model: nn.Module) -> list[dict]:
    """One entry per adapted linear layer: name, (K, N), rank, kernel."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    rows = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer) or not getattr(module, "r", None):
            continue
        base = module.get_base_layer()
        if not isinstance(base, nn.Linear):
            continue
        adapter = next(iter(module.r))
        rows.append({"name": name, "K": int(base.in_features), "N": int(base.out_features),
                     "r": int(module.r[adapter]), "kernel": getattr(module, "sits_kernel", {}).get(adapter, "peft")})
    return rows


# ----------------------------------------------------------------------------- the check


@dataclass
class CheckReport:
    """What ``sits-lora check`` found; ``passed`` is False when a constraint is violated."""

    model: str
    parameters: int
    recipe: dict
    dtype: str
    hardware: object
    plan: Optional[object]
    results: list
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(r.status == "violated" for r in self.results)

    def to_dict(self) -> dict:
        from ..utils.env import environment

        return {
            "command": "check",
            "passed": self.passed,
            "model": self.model,
            "parameters": self.parameters,
            "dtype": self.dtype,
            "recipe": self.recipe,
            "hardware": self.hardware.to_dict(),
            "constraints": [r.to_dict() for r in self.results],
            "memory_plan": self.plan.to_dict() if self.plan is not None else None,
            "notes": self.notes,
            "environment": environment(),
        }

    def table(self) -> str:
        from ..training.constraints import results_table

        r = self.recipe
        lines = [
            f"model     {self.model} ({self.parameters / 1e6:,.1f} M parameters, built on the meta device from its config)",
            f"adapter   r={r['r']} alpha={r['lora_alpha']} on {', '.join(r['target_modules'])}, kernel {r['kernel']}",
            f"run       batch {r['batch_size']} x seq {r['seq_len']}, grad accum {r['grad_accum']}, {self.dtype}",
            "",
            "hardware",
            self.hardware.table(),
            "",
            "constraints",
            results_table(self.results),
        ]
        if self.plan is not None:
            lines += ["", self.plan.table()]
        lines += [f"note      {n}" for n in self.notes]
        violated = [x.name for x in self.results if x.status == "violated"]
        lines += ["", "verdict   " + ("pass" if not violated else f"VIOLATED: {', '.join(violated)}")]
        return "\n".join(lines)


def run_check(model: Optional[str] = None, config: Optional[str] = None, batch_size: Optional[int] = None,
              seq_len: Optional[int] = None, memory_budget_gib: Optional[float] = None,
              rank_share: float = 0.10) -> CheckReport:
    """Build the recipe's adapted model on the meta device and check it against this machine."""
    from ..training import plan_memory, probe_hardware
    from ..training.alternatives import memory_alternatives
    from ..training.constraints import (
        check_int4,
        check_memory,
        check_pcie,
        check_rank,
        estimate_step_seconds,
        layer_runs_fused,
        pcie_bytes_per_step,
    )
    from ..training.memory import UnsupportedModelError
    from ..utils.units import GIB

    if memory_budget_gib is not None and not memory_budget_gib > 0:
        raise CheckError(f"--memory-budget-gib {memory_budget_gib}: it must be a positive number of GiB, e.g. 70")
    if not 0 < rank_share < 1:
        raise CheckError(f"--rank-share {rank_share}: it must be a fraction in (0, 1), e.g. 0.1 for 10 % of a layer's time")
    recipe = load_recipe(config, model=model, batch_size=batch_size, seq_len=seq_len)
    hf_config, source = model_config(recipe.model)
    dtype = recipe_dtype(recipe)
    peft_model = build_meta_model(hf_config, recipe, dtype, source)
    cuda = torch.cuda.is_available()
    hardware = probe_hardware(torch.device("cuda") if cuda else torch.device("cpu"))
    # recipe.run trains bf16 weights under bf16 autocast on a GPU (TrainingArguments(bf16=True))
    autocast = torch.bfloat16 if cuda and dtype == torch.bfloat16 else None
    B, S, accumulation = recipe.batch_size, recipe.seq_len, recipe.grad_accum
    notes = ["adapted layers were probed on the meta device, where they run the PyTorch reference; the fused "
             "GPU path saves no more than it, so the memory plan is an upper bound"]

    plan_kwargs = dict(optimizer="adamw", autocast_dtype=autocast, gradient_accumulation_steps=accumulation)
    plan, plan_error = None, ""
    try:
        plan = plan_memory(peft_model, B, S, **plan_kwargs)
    except UnsupportedModelError as error:
        plan_error = str(error)
    if memory_budget_gib is not None:
        budget, budget_source = int(memory_budget_gib * GIB), "--memory-budget-gib"
    elif cuda:
        free, _ = torch.cuda.mem_get_info()
        budget, budget_source = int(free), f"free on {hardware.device}"
    else:
        budget, budget_source = int(hardware.free_memory), "available host memory"
    alternatives = {}
    if plan is not None and plan.total > budget:
        alternatives = memory_alternatives(peft_model, B, S, plan, budget, 0, plan_kwargs)
    results = [check_memory(plan, budget, budget_source, alternatives, plan_error)]

    act_bytes = 2 if autocast is not None else torch.finfo(dtype).bits // 8
    # The meta model has no device: which layers run fused follows the device the run will use (a GPU;
    # without one check_rank is skipped).
    results.append(check_rank(peft_model, hardware, B * S, act_bytes, rank_share,
                              is_fused=lambda layer: layer_runs_fused(layer, cuda=True, autocast_dtype=autocast)))
    # the recipe's batches: input_ids, attention_mask and labels, int64
    parts = pcie_bytes_per_step(peft_model, batch_bytes=3 * 8 * B * S, activation_offload_bytes=0,
                                gradient_checkpointing=False, accumulation=accumulation)
    step = estimate_step_seconds(peft_model, B * S, hardware.matmul_flops, accumulation, False) \
        if hardware.is_cuda and hardware.matmul_flops else None
    results.append(check_pcie(parts, hardware, step, "roofline estimate"))
    int4 = check_int4(peft_model)
    if int4.status == "skipped":
        int4.summary += " (a model built from its config has no quantized layers; `sits-lora bench` measures alignment)"
    results.append(int4)
    return CheckReport(
        model=source.describe(), parameters=sum(p.numel() for p in peft_model.parameters()),
        recipe=dataclasses.asdict(recipe), dtype=str(dtype).removeprefix("torch."), hardware=hardware, plan=plan,
        results=results, notes=notes,
    )


__all__ = ["CheckError", "CheckReport", "load_recipe", "model_config", "run_check"]
