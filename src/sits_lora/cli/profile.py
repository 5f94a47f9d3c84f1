"""``sits-lora profile``: forward and backward latency of a real model with its adapter, by decoder layer and op type.

How it is measured. Hooks on the modules of each decoder layer stamp the time (CUDA events on a GPU,
``time.perf_counter`` on the CPU) when a module's forward starts and ends, and, through identity
autograd nodes placed on its output and its input, when its output gradient arrives and when its
input gradient is complete: the module's backward window. Windows of one group (say q/k/v/o) are
merged as intervals, so layers that run as one operation (sits_lora's sibling fusion computes q, k
and v in the first call) are counted once. Each step runs twice on the same batch: with the adapter,
and with the adapter disabled (``model.disable_adapter()``); the op types are

    norm        the RMSNorm / LayerNorm modules
    attn_proj   q/k/v/o projections, base layer only (adapter disabled)
    attn_core   the attention module minus its projections (RoPE, softmax attention, reshapes)
    mlp_proj    gate/up/down projections, base layer only
    mlp_act     the MLP module minus its projections (activation, product)
    lora        the projections with the adapter minus without it: the LoRA branch's cost

so ``lora`` is a difference of two measurements. The two passes alternate which runs first from step to
step (whichever runs second finds warmer caches), each step's difference is taken on the same batch,
and the cell is the median of those differences; a median below zero is noise around a branch too
small to measure, and is reported as 0 (the largest such clamp is ``step_ms["lora_noise_ms"]``). The
batch is ``batch_size`` x ``seq_len`` random token ids; the embeddings' output requires grad in both
passes (the disabled pass has no trainable parameter in use), which adds layer 0's input gradient to
what training computes. Cells are medians over the measured steps, after warm-up steps.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..recipe.loading import load_model
from ..utils.model_structure import decoder_layers

OP_TYPES = ("norm", "attn_proj", "attn_core", "mlp_proj", "mlp_act", "lora")
_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn")


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``callback``: the moment the gradient of its output is complete."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


class _Clock:
    """Time stamps: CUDA events on a GPU (read after one synchronize), perf_counter on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def since(self, origin, stamp) -> float:
        """Milliseconds from ``origin`` to ``stamp``."""
        return origin.elapsed_time(stamp) if self.cuda else (stamp - origin) * 1e3


def _is_linear_like(module: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    quantized_or_conv1d = type(module).__name__ in ("Conv1D", "Linear4bit", "Linear8bitLt")
    return isinstance(module, (nn.Linear, BaseTunerLayer)) or quantized_or_conv1d


@dataclass
class _Tracked:
    layer: str      # decoder layer index, or "head"
    kind: str       # norm | attn | attn_proj | mlp | mlp_proj | lm_head
    name: str


def _tracked_modules(model: nn.Module) -> dict[nn.Module, _Tracked]:
    """Which modules to time, and as what. Nothing inside an adapted layer is hooked: a hook on its base
    layer would turn sits_lora's fused path off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    path, blocks = decoder_layers(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to profile")
    tracked: dict[nn.Module, _Tracked] = {}
    for index, block in enumerate(blocks):
        inside_tuner: set[int] = set()
        for name, module in block.named_modules():
            if id(module) in inside_tuner or not name:
                continue
            if isinstance(module, BaseTunerLayer):
                inside_tuner.update(id(m) for m in module.modules() if m is not module)
            leaf = name.rsplit(".", 1)[-1]
            top = name.split(".", 1)[0]
            if "norm" in type(module).__name__.lower() and "." not in name:
                tracked[module] = _Tracked(str(index), "norm", name)
            elif name == top and leaf in _ATTN_NAMES:
                tracked[module] = _Tracked(str(index), "attn", name)
            elif name == top and leaf in _MLP_NAMES:
                tracked[module] = _Tracked(str(index), "mlp", name)
            elif _is_linear_like(module) and top in _ATTN_NAMES:
                tracked[module] = _Tracked(str(index), "attn_proj", name)
            elif _is_linear_like(module) and top in _MLP_NAMES:
                tracked[module] = _Tracked(str(index), "mlp_proj", name)
    block_ids = {id(m) for b in blocks for m in b.modules()}
    for name, module in model.named_modules():
        if id(module) in block_ids or not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("norm", "final_layernorm", "ln_f", "model_norm") and "norm" in type(module).__name__.lower():
            tracked[module] = _Tracked("head", "norm", name)
        elif leaf == "lm_head":
            tracked[module] = _Tracked("head", "lm_head", name)
    return tracked


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


class _Recorder:
    """Installs the hooks; collects (module, phase, start, end) stamps for one pass."""

    def __init__(self, tracked: dict[nn.Module, _Tracked], clock: _Clock):
        self.tracked = tracked
        self.clock = clock
        self.handles = []
        self.reset()
        for module in tracked:
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post))

    def reset(self) -> None:
        self.forward: list[tuple[nn.Module, object, object]] = []
        self.backward_start: dict[int, list] = {}  # id(module) -> stamps
        self.backward_end: dict[int, list] = {}    # id(module) -> slots, filled by the input's mark
        self._open: dict[int, list] = {}
        self._marked: dict[int, tuple] = {}        # id(tensor) -> (weakref, slot)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre(self, module, args, kwargs):
        key = id(module)
        self._open.setdefault(key, []).append(self.clock.stamp())
        x_in_args = bool(args) and isinstance(args[0], torch.Tensor)
        x = args[0] if x_in_args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or not x.requires_grad or not torch.is_grad_enabled():
            return None
        known = self._marked.get(id(x))
        if known is not None and known[0]() is x:
            self.backward_end.setdefault(key, []).append(known[1])
            return None
        if getattr(module, "sibling_group", None) is not None:
            return None  # a new tensor here would split the siblings' shared input; a parent marks it
        slot: list = []
        marked = _Mark.apply(x, lambda slot=slot: slot.append(self.clock.stamp()))
        self._marked[id(marked)] = (weakref.ref(marked), slot)
        self.backward_end.setdefault(key, []).append(slot)
        if x_in_args:
            return (marked, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": marked}

    def _post(self, module, args, output):
        key = id(module)
        start = self._open[key].pop()
        self.forward.append((module, start, self.clock.stamp()))
        y = _first_tensor(output)
        if y is None or not y.requires_grad or not torch.is_grad_enabled():
            return None
        stamps = self.backward_start.setdefault(key, [])
        marked = _Mark.apply(y, lambda: stamps.append(self.clock.stamp()))
        if isinstance(output, torch.Tensor):
            return marked
        return type(output)((marked, *output[1:]))

    def windows(self, origin) -> dict[tuple[str, str, str], list[tuple[float, float]]]:
        """{(layer, kind, phase): [(start_ms, end_ms), ...]} relative to ``origin``; call after a synchronize."""
        out: dict[tuple[str, str, str], list] = {}
        since = self.clock.since
        for module, start, end in self.forward:
            info = self.tracked[module]
            out.setdefault((info.layer, info.kind, "forward"), []).append((since(origin, start), since(origin, end)))
        for module, info in self.tracked.items():
            starts = self.backward_start.get(id(module), [])
            ends = [slot[0] for slot in self.backward_end.get(id(module), []) if slot]
            for start, end in zip(starts, ends):
                out.setdefault((info.layer, info.kind, "backward"), []).append((since(origin, start), since(origin, end)))
        return out


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, current_end = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= current_end:
            continue
        total += end - max(start, current_end)
        current_end = end
    return total


@dataclass
class ProfileResult:
    """Median milliseconds per (layer, op type) for forward and backward, plus the step totals."""

    rows: list[dict]
    step_ms: dict
    meta: dict
    environment: dict = field(default_factory=dict)

    def cell(self, layer: str, op_type: str) -> dict:
        return next(r for r in self.rows if r["layer"] == layer and r["op_type"] == op_type)

    def top(self, n: int = 10) -> list[dict]:
        return sorted(self.rows, key=lambda r: r["total_ms"], reverse=True)[:n]

    def to_dict(self) -> dict:
        return {"command": "profile", "meta": self.meta, "step_ms": self.step_ms, "rows": self.rows,
                "environment": self.environment}

    def write_csv(self, path: str) -> str:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["layer", "op_type", "forward_ms", "backward_ms", "total_ms"])
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})
        return path

    def heatmap(self, path: str) -> str:
        """Layers x op types, forward and backward side by side."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        layers = sorted({r["layer"] for r in self.rows if r["layer"] != "head"}, key=int)
        fig, axes = plt.subplots(1, 2, figsize=(12, max(3.0, 0.28 * len(layers) + 1.8)), squeeze=False)
        for ax, phase in zip(axes[0], ("forward", "backward")):
            grid = [[self.cell(layer, op)[f"{phase}_ms"] for op in OP_TYPES] for layer in layers]
            image = ax.imshow(grid, aspect="auto", cmap="viridis")
            ax.set_xticks(range(len(OP_TYPES)), OP_TYPES, rotation=30, fontsize=8)
            ax.set_yticks(range(len(layers)), layers, fontsize=7 if len(layers) > 24 else 8)
            ax.set_ylabel("decoder layer")
            ax.set_title(f"{phase} (ms, median of {self.meta['steps']} steps)", fontsize=10)
            if len(layers) <= 32:
                top = max((max(row) for row in grid), default=0) or 1
                for i, row in enumerate(grid):
                    for j, value in enumerate(row):
                        ax.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=6,
                                color="white" if value < 0.6 * top else "black")
            fig.colorbar(image, ax=ax, fraction=0.04)
        m = self.meta
        # the file name, not its folder: a model inside site-packages made the title longer than the figure
        name = os.path.basename(str(m["model"]).rstrip("/")) or str(m["model"])
        fig.suptitle(f"per-layer latency: {name}\n{m['device']}, {m['dtype']}, batch {m['batch_size']} x seq "
                     f"{m['seq_len']}, r {m['r']}; step fwd {self.step_ms['forward']:.1f} ms, "
                     f"bwd {self.step_ms['backward']:.1f} ms", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def table(self, n: int = 10) -> str:
        m = self.meta
        head = ("layer", "op type", "forward ms", "backward ms", "total ms")
        body = [(r["layer"], r["op_type"], f"{r['forward_ms']:.3f}", f"{r['backward_ms']:.3f}", f"{r['total_ms']:.3f}")
                for r in self.top(n)]
        widths = [max(len(row[c]) for row in [head] + body) for c in range(5)]
        lines = [f"sits-lora profile: {m['model']} on {m['device']} ({m['dtype']}), batch {m['batch_size']} x seq "
                 f"{m['seq_len']}, adapter r {m['r']} on {m['adapted_layers']} layers, median of {m['steps']} steps",
                 f"step: forward {self.step_ms['forward']:.2f} ms, backward {self.step_ms['backward']:.2f} ms; "
                 f"LoRA branch in all layers: forward {self.step_ms['lora_forward']:.2f} ms, backward "
                 f"{self.step_ms['lora_backward']:.2f} ms",
                 "", f"top {len(body)} (layer, op type) by forward + backward time"]
        for row in [head] + body:
            lines.append("  ".join(v.rjust(w) if c >= 2 else v.ljust(w) for c, (v, w) in enumerate(zip(row, widths))))
        return "\n".join(lines)


def profile_model(model: nn.Module, input_ids: torch.Tensor, steps: int = 3, warmup: int = 1,
                  progress: bool = True) -> tuple[list[dict], dict]:
    """(rows, step totals) for a PEFT model on its device; see the module docstring."""
    from tqdm.auto import tqdm

    cuda = input_ids.is_cuda
    clock = _Clock(cuda)
    tracked = _tracked_modules(model)
    recorder = _Recorder(tracked, clock)
    embed = model.get_input_embeddings()
    was_training = model.training
    model.train()
    per_step: list[dict] = []
    try:
        for step in tqdm(range(warmup + steps), desc="sits-lora profile", unit="step", disable=not progress):
            measured = {}
            for adapted in ((True, False) if step % 2 == 0 else (False, True)):
                recorder.reset()
                model.zero_grad(set_to_none=True)
                with torch.no_grad():
                    embeds = embed(input_ids)
                embeds = embeds.detach().requires_grad_()
                if cuda:
                    torch.cuda.synchronize()
                origin = clock.stamp()
                context = model.disable_adapter() if not adapted else contextlib.nullcontext()
                with context:
                    loss = model(inputs_embeds=embeds, labels=input_ids).loss
                    mid = clock.stamp()
                    loss.backward()
                end = clock.stamp()
                if cuda:
                    torch.cuda.synchronize()
                measured[adapted] = (recorder.windows(origin), clock.since(origin, mid), clock.since(mid, end))
            if step >= warmup:
                per_step.append(_cells(measured[True][0], measured[False][0]) | {
                    ("step", "forward"): measured[True][1], ("step", "backward"): measured[True][2],
                    ("step_disabled", "forward"): measured[False][1],
                    ("step_disabled", "backward"): measured[False][2]})
    finally:
        recorder.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    keys = per_step[0].keys()
    median = {k: statistics.median(s.get(k, 0.0) for s in per_step) for k in keys}
    # a LoRA branch cannot cost less than nothing: a negative median is the two passes' noise
    noise = max((-v for k, v in median.items() if k[1] == "lora" and v < 0), default=0.0)
    median = {k: max(v, 0.0) if k[1] == "lora" else v for k, v in median.items()}
    layers = sorted({k[0] for k in keys if k[0] not in ("step", "step_disabled", "head")}, key=int)
    rows = []
    for layer in layers + ["head"]:
        ops = OP_TYPES if layer != "head" else ("norm", "lm_head")
        for op in ops:
            f, b = median.get((layer, op, "forward"), 0.0), median.get((layer, op, "backward"), 0.0)
            rows.append({"layer": layer, "op_type": op, "forward_ms": f, "backward_ms": b, "total_ms": f + b})
    step_ms = {"forward": median[("step", "forward")], "backward": median[("step", "backward")],
               "lora_forward": sum(r["forward_ms"] for r in rows if r["op_type"] == "lora"),
               "lora_backward": sum(r["backward_ms"] for r in rows if r["op_type"] == "lora"),
               "lora_noise_ms": noise,
               # the pass with the adapter disabled, where attn_proj / mlp_proj are measured
               "disabled_forward": median[("step_disabled", "forward")],
               "disabled_backward": median[("step_disabled", "backward")]}
    return rows, step_ms


def _cells(adapted: dict, base: dict) -> dict:
    """{(layer, op type, phase): ms} from the windows of the adapted and the adapter-disabled pass."""
    cells: dict = {}
    layers = {k[0] for k in adapted}
    for layer in layers:
        for phase in ("forward", "backward"):
            def union(windows, kind):
                return _union_ms(windows.get((layer, kind, phase), []))

            if layer == "head":
                cells[(layer, "norm", phase)] = union(adapted, "norm")
                cells[(layer, "lm_head", phase)] = union(adapted, "lm_head")
                continue
            attn_proj, mlp_proj = union(adapted, "attn_proj"), union(adapted, "mlp_proj")
            cells[(layer, "norm", phase)] = union(adapted, "norm")
            cells[(layer, "attn_core", phase)] = max(union(adapted, "attn") - attn_proj, 0.0)
            cells[(layer, "mlp_act", phase)] = max(union(adapted, "mlp") - mlp_proj, 0.0)
            base_attn, base_mlp = union(base, "attn_proj"), union(base, "mlp_proj")
            cells[(layer, "attn_proj", phase)] = base_attn
            cells[(layer, "mlp_proj", phase)] = base_mlp
            cells[(layer, "lora", phase)] = attn_proj + mlp_proj - base_attn - base_mlp
    return cells


def run_profile(model: Optional[str] = None, config: Optional[str] = None, batch_size: Optional[int] = None,
                seq_len: Optional[int] = None, steps: int = 3, out_dir: str = "profile",
                progress: bool = True) -> tuple[ProfileResult, dict]:
    """Load the model, add the recipe's adapter, profile it; write profile.csv / .png / .json to ``out_dir``."""
    from peft import get_peft_model

    from ..utils.env import environment
    from .check import CheckError, adapter_config, adapted_linear_shapes, load_recipe, recipe_dtype

    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise CheckError(f"--steps {steps}: it must be a positive integer, e.g. 3")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckError(f"--out {out_dir}: a file of that name exists; give a folder for profile.csv / .png / .json")
    recipe = load_recipe(config, model=model, batch_size=batch_size, seq_len=seq_len)
    dtype = recipe_dtype(recipe)
    lora = adapter_config(recipe)  # checked before the model loads; INT4 picks its group size once it has
    try:
        base, source = load_model(recipe.model, dtype)
    except FileNotFoundError as error:
        raise CheckError(str(error)) from None
    except (OSError, ValueError) as error:
        raise CheckError(f"--model {recipe.model}: cannot load it: {str(error).splitlines()[0]}") from None
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    base.to(device)
    try:
        peft_model = get_peft_model(base, adapter_config(recipe, base, source) if recipe.base_quant == "int4" else lora)
    except ValueError as error:
        raise CheckError(str(error).splitlines()[0]) from None
    vocab = peft_model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(recipe.seed)
    ids = torch.randint(0, vocab, (recipe.batch_size, recipe.seq_len), generator=gen).to(device)
    rows, step_ms = profile_model(peft_model, ids, steps=steps, warmup=2 if cuda else 1, progress=progress)
    meta = {"model": source.describe(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "batch_size": recipe.batch_size, "seq_len": recipe.seq_len,
            "r": recipe.r, "kernel": recipe.kernel, "adapted_layers": len(adapted_linear_shapes(peft_model)),
            "steps": steps, "timer": "CUDA events" if cuda else "time.perf_counter", "op_types": list(OP_TYPES)}
    result = ProfileResult(rows, step_ms, meta, environment())
    os.makedirs(out_dir, exist_ok=True)
    paths = {"csv": result.write_csv(os.path.join(out_dir, "profile.csv")),
             "png": result.heatmap(os.path.join(out_dir, "profile.png")),
             "json": os.path.join(out_dir, "profile.json")}
    with open(paths["json"], "w") as f:
        json.dump(result.to_dict() | {"files": paths}, f, indent=2)
    return result, paths


__all__ = ["OP_TYPES", "ProfileResult", "profile_model", "run_profile"]
