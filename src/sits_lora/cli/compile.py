"""``sits-lora compile``: tune the fused kernels for a model's layer shapes on this GPU, once.

The model is built on the meta device from its configuration (no weights), its adapted linear
layers give the shapes, and every side kernel (shrink, expand, dy pass, x pass) is tuned per shape
by ``sits_lora.ops.fused.tune_layer_kernels`` at the run's token count (batch x seq). Sibling layers
(q / k / v, gate / up) share one shrink and one x pass at their summed rank: those are tuned at that
rank, the per-layer ones only where a layer runs alone (``kernel_launches``). The choices go
to the on-disk cache that training reads (``sits_lora.ops.tuning``; the file is
``$SITS_LORA_TUNING_CACHE``, default ``~/.cache/sits_lora/kernel_configs.json``). A kernel and shape
already in that cache, or among the choices shipped with the package, is reported as "cached"
and not measured again (``force`` measures everything again).

The cache key is the GPU name, kernel, shape (dims) and dtype, not the torch / triton versions: an
entry measured under other versions is reused after an upgrade. So each row says which versions
measured its entry, when known: compile records the versions of what it tunes in a file next to
the cache (``kernel_configs.versions.json``), and the packaged choices come from one tuning run
(``_PACKAGED_VERSIONS``); an entry written by anything else (``bench/tune_kernels.py``, a tuning
call during training) is "unknown". The report counts the entries measured under other versions
than the ones running now.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .check import CheckError


class GpuRequiredError(CheckError):
    """compile needs a GPU."""


# The versions of the tuning runs that src/sits_lora/ops/tuned_configs.json copies (bench/tune_kernels.py,
# and bench/decode_kernels.py for the decode kernel's entries, under the same versions; see docs/kernels.md).
# tests/cli/test_cli.py checks that they agree.
_PACKAGED_VERSIONS = {"torch": "2.11.0+cu130", "triton": "3.6.0"}
CACHE_KEY_FIELDS = ("gpu", "kernel", "dims", "dtype")


def current_versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}


def versions_path(cache_file: str) -> str:
    """The record of which versions measured each entry of ``cache_file``, next to it."""
    root, _ = os.path.splitext(cache_file)
    return root + ".versions.json"


def record_versions(cache_file: str, keys, versions: dict) -> str:
    """Add ``versions`` (plus the time) for each cache key in ``keys`` to the record next to ``cache_file``."""
    path = versions_path(cache_file)
    records = _read(path)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for key in keys:
        records[key] = {**versions, "tuned_at": stamp}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def cached_entry(key: str, user: dict, packaged: dict, records: dict) -> tuple[Optional[str], Optional[dict]]:
    """(source, versions) of a cache key: "cached" (the user's cache), "cached (packaged)", or (None, None).

    The user's cache file also holds copies of the packaged choices (a tuning run saves the merged
    cache): an entry equal to the packaged one with no record of its own is the packaged one.
    """
    record = records.get(key)
    versions = {"torch": record.get("torch"), "triton": record.get("triton")} if isinstance(record, dict) else None
    if key in user:
        if versions is None and key in packaged and user[key] == packaged[key]:
            return "cached (packaged)", dict(_PACKAGED_VERSIONS)
        return "cached", versions
    if key in packaged:
        return "cached (packaged)", dict(_PACKAGED_VERSIONS)
    return None, None


def _versions_text(versions: Optional[dict]) -> str:
    if not versions:
        return "unknown"
    return f"torch {versions.get('torch') or '?'}, triton {versions.get('triton') or '?'}"


def _kernel_dims(K: int, N: int, r: int) -> dict[str, tuple]:
    from ..ops.geometry import block_rank

    block_r = block_rank(r)
    # the dims each launcher passes to tuning.config_for (see ops/fused.py)
    return {"shrink": (K, block_r), "expand": (N, block_r), "dy_pass": (N, block_r), "x_pass": (K, block_r)}


def product_input_layers(model: nn.Module, rows: list, groups: list) -> set:
    """Names of the adapted layers whose x pass can read their input as two factors (``ops.ProductInput``): a down
    projection beside a two-layer sibling group (gate / up) under one parent, as wide as the group's outputs, with
    its input rebuilt in backward (``SitsLoraConfig(recompute_lora_inputs=True)``, which finds the factors)."""
    by_name = {row["name"]: row for row in rows}
    modules = dict(model.named_modules())
    found = set()
    for members in groups:
        present = [by_name[name] for name in members if name in by_name]
        if len(present) != 2 or present[0]["N"] != present[1]["N"]:
            continue
        parent = members[0].rsplit(".", 1)[0]
        for row in rows:
            name = row["name"]
            if (name.rsplit(".", 1)[0] == parent and name not in members and row["K"] == present[0]["N"]
                    and getattr(modules.get(name), "input_recompute", None) is not None):
                found.add(name)
    return found


def kernel_launches(rows: list, groups: list, product_inputs: frozenset = frozenset()) -> dict[tuple, dict]:
    """{(kernel, dims): {"layers": how many adapted layers use it, "shape": (K, N, r) that tunes it}} for the adapted
    layers ``rows`` (``adapted_linear_shapes``) and their sibling groups (``sibling_group_members``: lists of layer
    names). A group's layers share one shrink and one x pass at their summed rank; each keeps its own expand and
    dy pass. A layer named in ``product_inputs`` (:func:`product_input_layers`) also runs its x pass over the two
    factors ("x_pass_product")."""
    by_name = {row["name"]: row for row in rows}
    grouped = {name for members in groups for name in members if name in by_name}
    wanted: dict[tuple, dict] = {}

    def add(kernel: str, dims: tuple, shape: tuple, layers: int) -> None:
        entry = wanted.setdefault((kernel, dims), {"layers": 0, "shape": shape})
        entry["layers"] += layers

    for row in rows:
        shape = (row["K"], row["N"], row["r"])
        for kernel, dims in _kernel_dims(*shape).items():
            if row["name"] not in grouped or kernel in ("expand", "dy_pass"):
                add(kernel, dims, shape, 1)
        if row["name"] in product_inputs:
            add("x_pass_product", _kernel_dims(*shape)["x_pass"], shape, 1)
    for members in groups:
        present = [by_name[name] for name in members if name in by_name]
        if len(present) < 2:
            continue
        K, rank = present[0]["K"], sum(row["r"] for row in present)
        for kernel, dims in _kernel_dims(K, K, rank).items():
            if kernel in ("shrink", "x_pass"):
                add(kernel, dims, (K, K, rank), len(present))
    return wanted


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@dataclass
class CompileReport:
    model: str
    gpu: str
    dtype: str
    tokens: int
    cache_file: str
    rows: list[dict]
    seconds: float
    environment: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)  # torch / triton running now

    @property
    def tuned(self) -> int:
        return sum(1 for r in self.rows if r["source"] == "tuned now")

    @property
    def other_versions(self) -> int:
        """Cached entries measured under torch / triton versions other than the running ones."""
        return sum(1 for r in self.rows if r.get("versions") and r["versions"] != self.versions)

    @property
    def unknown_versions(self) -> int:
        return sum(1 for r in self.rows if not r.get("versions"))

    def to_dict(self) -> dict:
        return {"command": "compile", "model": self.model, "gpu": self.gpu, "dtype": self.dtype, "tokens": self.tokens,
                "cache_file": self.cache_file, "versions_file": versions_path(self.cache_file),
                "cache_key": list(CACHE_KEY_FIELDS), "versions": self.versions, "tuned": self.tuned,
                "cached": len(self.rows) - self.tuned, "cached_under_other_versions": self.other_versions,
                "versions_unknown": self.unknown_versions, "seconds": self.seconds, "rows": self.rows,
                "environment": self.environment}

    def table(self) -> str:
        head = ("kernel", "dims", "layers", "source", "measured with", "config", "best ms", "default ms")
        body = []
        for r in self.rows:
            cfg = " ".join(f"{k}={v}" for k, v in r["config"].items())
            best = f"{r['best_ms']:.4f}" if r.get("best_ms") is not None else ""
            default = f"{r['default_ms']:.4f}" if r.get("default_ms") is not None else ""
            body.append((r["kernel"], "x".join(map(str, r["dims"])), str(r["layers"]), r["source"],
                         _versions_text(r.get("versions")), cfg, best, default))
        widths = [max(len(row[c]) for row in [head] + body) for c in range(len(head))]
        lines = [f"sits-lora compile: {self.model} on {self.gpu}, {self.dtype}, tuned at {self.tokens} tokens, "
                 f"{_versions_text(self.versions)}", ""]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in [head] + body]
        cached = len(self.rows) - self.tuned
        lines += ["", f"{self.tuned} tuned now, {cached} cached ({self.seconds:.1f} s); cache: {self.cache_file}"]
        if self.other_versions or self.unknown_versions:
            lines.append(f"the cache key is GPU, kernel, shape and dtype, not versions: {self.other_versions} cached "
                         f"entries were measured under other torch / triton versions and {self.unknown_versions} under "
                         f"unknown ones; --force measures them again with the running versions")
        return "\n".join(lines)


def fp8_crossover_rows(shapes: list[dict], device: torch.device, tokens: int, force: bool,
                       cached_source: Callable[[str], tuple]) -> list[dict]:
    """One row per adapted layer shape: whether the fp8 base pays there (``SitsLoraConfig(fp8_layers="auto")``
    reads the verdict), measured now by timing one layer step with each base, or found in the cache
    (``cached_source(key)``: its source and versions, as :func:`cached_entry` gives them)."""
    from ..fp8 import selection
    from ..ops import tuning

    rows = []
    by_shape: dict = {}
    for entry in shapes:
        by_shape.setdefault((entry["K"], entry["N"]), []).append(entry)
    for (K, N), layers in sorted(by_shape.items()):
        key = tuning.config_key("fp8_layer", device, (K, N), torch.bfloat16)
        found = None if force else tuning.fp8_layer_measurement(device, K, N)
        measured = found is None
        source, versions = ("tuned now", current_versions()) if measured else cached_source(key)
        if measured:
            found = selection.measure_layer(K, N, tokens=tokens, rank=layers[0]["r"])
            record_versions(tuning.cache_path(), [key], versions)
            torch.cuda.empty_cache()
        rows.append({"kernel": "fp8_layer", "dims": [K, N], "layers": len(layers), "key": key,
                     "source": source or "cached", "versions": versions,
                     "config": {"base": "fp8" if found["use_fp8"] else "bf16", "ratio": round(found["ratio"], 3)},
                     **({"best_ms": found["fp8_ms"], "default_ms": found["bf16_ms"]} if measured else {})})
    return rows


def run_compile(model: Optional[str] = None, config: Optional[str] = None, batch_size: Optional[int] = None,
                seq_len: Optional[int] = None, force: bool = False, cache: Optional[str] = None,
                fp8: bool = False) -> CompileReport:
    """Tune (or find cached) launch configurations for every adapted layer shape of the recipe's model; with
    ``fp8``, also measure where the fp8 base pays (a row per layer shape, "fp8_layer")."""
    from ..layers.siblings import sibling_group_members
    from ..utils.env import environment
    from .check import adapted_linear_shapes, build_meta_model, load_recipe, model_config, recipe_dtype

    if not torch.cuda.is_available():
        raise GpuRequiredError(
            "compile tunes the fused Triton kernels on a GPU and torch sees none (torch.cuda.is_available() is "
            "False); run it on the machine that trains. Without a GPU the layers run the PyTorch reference, "
            "which needs no tuning.")
    if cache is not None:
        os.environ["SITS_LORA_TUNING_CACHE"] = os.path.abspath(cache)  # read by ops.tuning on first use
    from ..ops import fused, tuning

    start = time.perf_counter()
    recipe = load_recipe(config, model=model, batch_size=batch_size, seq_len=seq_len)
    dtype = recipe_dtype(recipe)
    if recipe.kernel == "torch":
        raise CheckError("kernel: torch runs the PyTorch reference, which has nothing to tune; use kernel: auto or triton")
    if dtype not in (torch.bfloat16, torch.float16):
        raise CheckError(f"dtype: {recipe.dtype} trains in {str(dtype).removeprefix('torch.')}, where the fused kernels "
                         f"use fixed launch configurations (kernel auto runs the PyTorch reference); tuning applies to "
                         f"bfloat16 and float16 (dtype: auto is bfloat16 on a GPU)")
    hf_config, source = model_config(recipe.model)
    meta_model = build_meta_model(hf_config, recipe, dtype)
    shapes = adapted_linear_shapes(meta_model)
    if not shapes:
        raise CheckError(f"target_modules {recipe.target_modules} adapt no linear layer of {source.describe()}")
    device = torch.device("cuda", torch.cuda.current_device())
    packaged = _read(os.path.join(os.path.dirname(os.path.abspath(tuning.__file__)), "tuned_configs.json"))
    user = _read(tuning.cache_path())
    records = _read(versions_path(tuning.cache_path()))
    running = current_versions()

    groups = sibling_group_members(meta_model)
    wanted = kernel_launches(shapes, groups, product_input_layers(meta_model, shapes, groups))
    sources: dict[tuple, tuple] = {}
    skip: set = set()
    for kernel, dims in wanted:
        found, versions = cached_entry(tuning.config_key(kernel, device, dims, dtype), user, packaged, records)
        if not force and found is not None:
            sources[(kernel, dims)] = (found, versions)
            skip.add((kernel, dims))
    measured: dict[tuple, dict] = {}
    todo = sorted({entry["shape"] for kd, entry in wanted.items() if kd not in skip})
    # a sibling group's shape also names an expand and a dy pass that no layer launches: not measured
    skip |= {(kernel, dims) for K, N, r in todo for kernel, dims in _kernel_dims(K, N, r).items()
             if (kernel, dims) not in wanted}
    from tqdm.auto import tqdm

    for K, N, r in tqdm(todo, desc="sits-lora compile", unit="shape", disable=not todo):
        product = any(kernel == "x_pass_product" and entry["shape"] == (K, N, r)
                      for (kernel, _), entry in wanted.items())
        result = fused.tune_layer_kernels(K, N, r, dtype, device, tokens=recipe.batch_size * recipe.seq_len,
                                          save=True, skip=skip, product_input=product)
        for kernel, info in result.items():
            measured[(kernel, tuple(info["dims"]))] = info
    if measured:
        record_versions(tuning.cache_path(), [tuning.config_key(k, device, dims, dtype) for k, dims in measured],
                        running)
    rows = []
    for (kernel, dims), entry in sorted(wanted.items()):
        info = measured.get((kernel, dims))
        cached_source, versions = sources.get((kernel, dims), (None, None))
        row = {"kernel": kernel, "dims": list(dims), "layers": entry["layers"],
               "key": tuning.config_key(kernel, device, dims, dtype),
               "source": "tuned now" if info else cached_source,
               "versions": dict(running) if info else versions,
               "config": info["best"] if info else tuning.config_for(kernel, device, dims, dtype)}
        if info:
            row.update(best_ms=info["best_ms"], default_ms=info["default_ms"], configs_tried=info["configs_tried"])
        rows.append(row)
    if fp8:
        rows += fp8_crossover_rows(shapes, device, recipe.batch_size * recipe.seq_len, force,
                                   lambda key: cached_entry(key, user, packaged, records))
    return CompileReport(model=source.describe(), gpu=torch.cuda.get_device_name(device),
                         dtype=str(dtype).removeprefix("torch."), tokens=recipe.batch_size * recipe.seq_len,
                         cache_file=tuning.cache_path(), rows=rows, seconds=time.perf_counter() - start,
                         environment=environment(), versions=running)


__all__ = ["CompileReport", "GpuRequiredError", "run_compile"]
