"""Launch configurations of the Triton kernels: measured per GPU, cached on disk.

Each memory-bound kernel (shrink, expand, dy pass, x pass) has a small space of block sizes,
warps and pipeline stages. ``tune`` measures them for a layer shape on the current GPU and stores
the fastest in a JSON cache keyed by GPU name, kernel, shape and dtype (not the torch / triton
versions: see config_key), so training starts without tuning and a second tuning run reuses the
cache. The package ships the
choices for the GPUs it was tuned on (tuned_configs.json, from bench/tune_kernels.py). A GPU without an entry of
its own takes the entry of a GPU of the same compute capability (the same kind of SM and shared memory, which is
what these block sizes fit); without either the kernels use the first configuration of
each space below; fp32 on a GPU and the interpreter (tests) use one configuration each.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Iterable, Optional

import torch

from ..utils.cache import cache_root
from ..utils.timing import gpu_seconds

# Candidate configurations. The first entry of each list is the default on a GPU.
CONFIG_SPACE: dict[str, list[dict]] = {
    "shrink": [
        dict(BLOCK_T=64, BLOCK_K=128, num_warps=4, num_stages=4),
        *[dict(BLOCK_T=bt, BLOCK_K=bk, num_warps=w, num_stages=s)
          for bt in (32, 64, 128) for bk in (64, 128, 256) for w, s in ((4, 3), (8, 4))],
    ],
    "expand": [
        dict(BLOCK_T=64, BLOCK_N=128, num_warps=4, num_stages=1),
        *[dict(BLOCK_T=bt, BLOCK_N=bn, num_warps=4, num_stages=1) for bt in (32, 64, 128) for bn in (64, 128, 256)],
    ],
    "dy_pass": [
        dict(BLOCK_T=128, BLOCK_N=64, num_warps=8, num_stages=3),
        *[dict(BLOCK_T=bt, BLOCK_N=bn, num_warps=w, num_stages=3)
          for bt in (64, 128, 256) for bn in (32, 64, 128) for w in (4, 8)],
    ],
    "x_pass": [
        dict(BLOCK_T=64, BLOCK_K=128, num_warps=4, num_stages=3),
        *[dict(BLOCK_T=bt, BLOCK_K=bk, num_warps=w, num_stages=3)
          for bt in (32, 64, 128) for bk in (64, 128, 256) for w in (4, 8)],
    ],
    # the x pass over an input read as its two SwiGLU factors (ops.reference.ProductInput: down_proj's input
    # rebuilt): twice the bytes loaded a tile and a SiLU computed, so its fastest blocks need not be the plain pass's.
    # Without a measured entry it runs the plain x pass's configuration (FALLBACK)
    "x_pass_product": [
        dict(BLOCK_T=64, BLOCK_K=128, num_warps=4, num_stages=3),
        *[dict(BLOCK_T=bt, BLOCK_K=bk, num_warps=w, num_stages=s)
          for bt in (32, 64, 128) for bk in (64, 128, 256) for w in (4, 8) for s in (2, 3)],
    ],
    # the one-kernel decode path (ops.decode): dims (row block, K, N, rank block)
    "decode": [
        dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4),
        *[dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
          for bn in (16, 32, 64) for bk in (128, 256, 512) for w, s in ((4, 3), (4, 5), (8, 4))],
        # wider tiles: A (re-read by every output tile) is then a smaller share of what a program streams
        *[dict(BLOCK_N=128, BLOCK_K=bk, num_warps=w, num_stages=s) for bk in (64, 128) for w, s in ((4, 3), (8, 4))],
        # K split over SPLIT_K programs per output tile, summed by a second kernel (ops.decode): for long K
        *[dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=3)
          for sk in (2, 4, 8) for bn in (32, 64) for bk in (128, 256)],
        *[dict(BLOCK_N=128, BLOCK_K=128, SPLIT_K=sk, num_warps=w, num_stages=3) for sk in (2, 4) for w in (4, 8)],
    ],
    # the decode path's one-row kernel (ops.decode, a decode step at batch 1): dims (K, N, rank block). Used only
    # where a measured configuration is stored (measured_config): otherwise the tuned "decode" kernel runs
    "decode_gemv": [
        *[dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
          for bn in (16, 32, 64) for bk in (128, 256, 512) for w, s in ((4, 3), (8, 4))],
        *[dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=3)
          for sk in (2, 4) for bn in (32, 64) for bk in (128, 256)],
    ],
}

# fp32 on a GPU (tests against the fp32 reference): small blocks, one config, no tuning. The kernel tests also run
# the interpreter at these (tests/ops), so that their odd shapes span several programs along every dimension.
SMALL_BLOCKS_CONFIG = {
    "shrink": dict(BLOCK_T=32, BLOCK_K=32, num_warps=4, num_stages=1),
    "expand": dict(BLOCK_T=32, BLOCK_N=32, num_warps=4, num_stages=1),
    "dy_pass": dict(BLOCK_T=32, BLOCK_N=32, num_warps=4, num_stages=1),
    "x_pass": dict(BLOCK_T=32, BLOCK_K=32, num_warps=4, num_stages=1),
    "x_pass_product": dict(BLOCK_T=32, BLOCK_K=32, num_warps=4, num_stages=1),
    "decode": dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1),
    "decode_gemv": dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1),
}

# The Triton interpreter (CPU tensors, tests only): a program costs about the same whatever its block holds, so
# blocks as large as a test's layer make a launch one or a few programs.
INTERPRETER_CONFIG = {
    "shrink": dict(BLOCK_T=128, BLOCK_K=64, num_warps=4, num_stages=1),
    "expand": dict(BLOCK_T=128, BLOCK_N=64, num_warps=4, num_stages=1),
    "dy_pass": dict(BLOCK_T=128, BLOCK_N=64, num_warps=4, num_stages=1),
    "x_pass": dict(BLOCK_T=128, BLOCK_K=64, num_warps=4, num_stages=1),
    "x_pass_product": dict(BLOCK_T=128, BLOCK_K=64, num_warps=4, num_stages=1),
    "decode": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1),
    "decode_gemv": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1),
}

# A kernel whose configuration, where none was measured for it, is its sibling kernel's at the same dims.
FALLBACK = {"x_pass_product": "x_pass"}

_lock = threading.Lock()
_cache: Optional[dict] = None
# config_for's answers by (kernel, device, dims, dtype). Every launcher asks on every call, and the key
# (device name, string formatting) is slow to build next to a direct launch (bench/profile_host.py), and a layer
# step issues 4-8 launches. Cleared whenever a tuning result is stored.
_answers: dict = {}


def cache_path() -> str:
    return os.environ.get("SITS_LORA_TUNING_CACHE") or str(cache_root() / "kernel_configs.json")


def _packaged_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_configs.json")


def _load() -> dict:
    global _cache
    with _lock:
        if _cache is None:
            merged: dict = {}
            for path in (_packaged_path(), cache_path()):  # the user's own measurements win
                if os.path.exists(path):
                    try:
                        with open(path) as f:
                            table = json.load(f)
                        capabilities = {**merged.get(CAPABILITIES_KEY, {}), **table.get(CAPABILITIES_KEY, {})}
                        merged.update(table)
                        if capabilities:
                            merged[CAPABILITIES_KEY] = capabilities
                    except (OSError, json.JSONDecodeError):
                        pass  # a damaged cache must not stop training; defaults apply
            _cache = merged
        return _cache


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def config_key(kernel: str, device: torch.device, dims: tuple, dtype: torch.dtype) -> str:
    # Versions are not part of the key: block sizes that are fast on a GPU stay fast across
    # torch / triton releases far more often than not, and the cache file records the versions.
    dims_text = "x".join(str(d) for d in dims)
    return f"{_device_name(device)}|{kernel}|{dims_text}|{str(dtype).removeprefix('torch.')}"


def config_for(kernel: str, device: torch.device, dims: tuple, dtype: torch.dtype) -> dict:
    """The launch configuration for ``kernel`` on ``device`` at ``dims`` (K, N, R-block...): this GPU's entry, else
    the entry of a GPU of the same compute capability, else its FALLBACK kernel's configuration, else the space's
    first configuration."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG[kernel]
    if dtype == torch.float32:
        return SMALL_BLOCKS_CONFIG[kernel]
    answer_key = (kernel, device, dims, dtype)
    found = _answers.get(answer_key)
    if found is None:
        key = config_key(kernel, device, dims, dtype)
        found = _load().get(key) or _same_capability_entry(key, device)
        if found is None:
            fallback = FALLBACK.get(kernel)
            found = config_for(fallback, device, dims, dtype) if fallback else CONFIG_SPACE[kernel][0]
        _answers[answer_key] = found
    return found


# The table's key naming each tuned GPU's compute capability: {GPU name: [major, minor]}
CAPABILITIES_KEY = "capabilities"


def _capability(device: torch.device) -> list:
    return list(torch.cuda.get_device_capability(device))


def _same_capability_entry(key: str, device: torch.device) -> Optional[dict]:
    """``key``'s entry as measured on another GPU of ``device``'s compute capability (first by name), or None."""
    name, rest = key.split("|", 1)
    capability = _capability(device)
    for other, other_capability in sorted(_load().get(CAPABILITIES_KEY, {}).items()):
        if other != name and list(other_capability) == capability and f"{other}|{rest}" in _load():
            return _load()[f"{other}|{rest}"]
    return None


# Bounds _answers where the derived values' keys take many token counts (variable-length batches): past it the
# answers are recomputed, which is cheap, rather than kept without limit.
_MAX_ANSWERS = 4096


def remembered(key: tuple):
    """A value derived from the configurations (a launch's grid and splits at one shape: ops.fused) stored by
    :func:`remember`, or None. Forgotten, with config_for's answers, whenever a tuning result is stored."""
    return _answers.get(key)


def forget_answers() -> None:
    """Forget config_for's answers and every value remembered with them: for tests that change the configurations
    themselves (the interpreter's blocks)."""
    _answers.clear()


def remember(key: tuple, value):
    if len(_answers) > _MAX_ANSWERS:
        _answers.clear()
    _answers[key] = value
    return value


def measured_config(kernel: str, device: torch.device, dims: tuple, dtype: torch.dtype) -> Optional[dict]:
    """The configuration stored for ``kernel`` on this GPU at ``dims`` (measured: the tuning cache or the packaged
    table), or None where none is: for a kernel that runs only where it was measured to win."""
    if device.type != "cuda":
        return None
    answer_key = ("measured", kernel, device, dims, dtype)
    if answer_key not in _answers:
        _answers[answer_key] = _load().get(config_key(kernel, device, dims, dtype))
    return _answers[answer_key]


def fp8_layer_measurement(device: torch.device, in_features: int, out_features: int) -> Optional[dict]:
    """The stored fp8-vs-bf16 measurement of one adapted layer shape on this GPU (sits_lora.fp8.selection),
    or None: {"ratio": fp8 step / bf16 step, "use_fp8": bool, "tokens": T, "rank": r}."""
    if device.type != "cuda":
        return None
    return _load().get(config_key("fp8_layer", device, (in_features, out_features), torch.bfloat16))


def store_fp8_layer_measurement(device: torch.device, in_features: int, out_features: int, entry: dict,
                                save: bool = True) -> None:
    _load()[config_key("fp8_layer", device, (in_features, out_features), torch.bfloat16)] = entry
    _answers.clear()
    if save:
        save_cache()


def tune(kernel: str, device: torch.device, dims: tuple, dtype: torch.dtype,
         run: Callable[[dict], object], configs: Optional[Iterable[dict]] = None, save: bool = True) -> tuple[dict, list]:
    """Time ``run(config)`` for every candidate; remember and return the fastest (and all timings: (median
    milliseconds, config))."""
    timings = []
    for cfg in configs or CONFIG_SPACE[kernel]:
        try:
            ms = gpu_seconds(lambda: run(cfg)) * 1e3
        except ImportError:  # no Triton: nothing can be tuned
            raise
        except Exception:  # a config the GPU cannot run (too much shared memory) is skipped
            continue
        timings.append((ms, cfg))
    if not timings:
        raise RuntimeError(f"no launch configuration of {kernel} ran on {_device_name(device)} at {dims}")
    best = min(timings, key=lambda t: t[0])[1]
    key = config_key(kernel, device, dims, dtype)
    _load()[key] = best
    _load().setdefault(CAPABILITIES_KEY, {})[_device_name(device)] = _capability(device)
    _answers.clear()
    if save:
        save_cache()
    return best, timings


def save_cache() -> str:
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_load(), f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
