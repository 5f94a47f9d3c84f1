"""Recording a call as a CUDA graph and replaying it: the pieces shared by the training step
(``sits_lora.training.graphs``), the denoiser (``sits_lora.diffusion.graphs``) and decoding
(``sits_lora.serving.graphs``).

A recording stands for one *signature* of a call: the shapes, dtypes and devices of its tensor arguments, its
Python values, and what Python decides inside it (each adapter layer's state, train / eval mode). A replay copies
the call's tensors into the recorded inputs, replays, and returns a copy of the recorded outputs."""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

_LEAF_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device)


class NotGraphable(Exception):
    """An argument or output a recorded call cannot stand for (the call runs eagerly)."""


def describe_call(obj: Any, tensors: list) -> Any:
    """A hashable description of ``obj`` (arguments: tensors, numbers, strings, nested tuples / lists / dicts), its
    tensors described by shape / dtype / device and appended to ``tensors`` in order; NotGraphable for a CPU
    tensor or an object of another type."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_cuda:
            raise NotGraphable(f"a tensor on {obj.device}")
        tensors.append(obj)
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device, obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(describe_call(item, tensors) for item in obj))
    if isinstance(obj, dict):
        return (type(obj), tuple((key, describe_call(value, tensors)) for key, value in obj.items()))
    if isinstance(obj, _LEAF_TYPES):
        return obj
    raise NotGraphable(f"an argument of type {type(obj).__name__}")


def substitute(obj: Any, tensors) -> Any:
    """``obj`` with its tensors replaced, in order, by those of the iterator ``tensors``."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, (tuple, list)):
        items = [substitute(item, tensors) for item in obj]
        return type(obj)(items) if type(obj) in (tuple, list) else type(obj)(*items)   # namedtuples
    if isinstance(obj, dict):
        return type(obj)({key: substitute(value, tensors) for key, value in obj.items()})
    return obj


def copy_output(out: Any, replace: Optional[dict] = None) -> Any:
    """A copy of a recorded output (its buffers are overwritten by the next replay). ``replace``: {id(object):
    substitute} for objects the output returns as they are (a KV cache the call was given)."""
    if replace and id(out) in replace:
        return replace[id(out)]
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)) and type(out) in (tuple, list):
        return type(out)(copy_output(item, replace) for item in out)
    if isinstance(out, dict):   # diffusers' BaseOutput is an OrderedDict whose fields are keyword arguments
        return type(out)(**{key: copy_output(value, replace) for key, value in out.items()})
    if out is None or isinstance(out, _LEAF_TYPES):
        return out
    raise NotGraphable(f"an output of type {type(out).__name__}")


def adapter_state(model: Optional[nn.Module]) -> tuple:
    """What each adapter layer of ``model`` does in a call, as far as Python decides it, and the modules' train /
    eval modes (a recording stands for one such state). Walks the module tree: a caller asking every call holds an
    :class:`AdapterState` instead."""
    return AdapterState(model)()


# Bumped whenever a module inside a tree some AdapterState walked registers a submodule (a global registration
# hook, set by the first AdapterState): an AdapterState walks its model's tree again only after that. Registrations
# elsewhere do not count: a model that slices a ModuleList in its forward (diffusers' mid blocks' `resnets[1:]`,
# transformers' `layers[:n]`) builds a new container every call, and counting those would walk again every call.
# Nor does anything traced by torch.compile: dynamo would guard the compiled code on the counter's value and
# compile again at every call. Deleting a module registers nothing, but it leaves the state of the layers that
# stay, which is what a recording depends on.
_registrations = 0
_hooked = False
_walked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _count_registration(module, name, submodule):
    global _registrations
    if torch.compiler.is_compiling():
        return
    if module in _walked:
        _registrations += 1


class AdapterState:
    """:func:`adapter_state` of one model, cheap to ask every call: the module list is kept and walked again only
    when a module was registered somewhere since (an adapter injected, a layer replaced). Walking SDXL's U-Net
    (1,930 modules) every call, more so with a LoRA on its cross-attention, costs the CPU many times what the kept
    list costs, a visible share of a replayed denoising step's GPU work; and a scheduler that waits for the GPU
    every step adds the host's time to it (docs/diffusion.md, "Every block compiled")."""

    def __init__(self, model: Optional[nn.Module]) -> None:
        global _hooked
        if not _hooked:
            nn.modules.module.register_module_module_registration_hook(_count_registration)
            _hooked = True
        self.model = model
        self._seen = -1
        self._modules: list = []
        self._tuners: list = []

    def __call__(self) -> tuple:
        if self.model is None:
            return ()
        if self._seen != _registrations:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self._seen = _registrations
            self._modules = list(self.model.modules())
            _walked.update(self._modules)   # hashable: torch's own module walk keeps a set of them
            self._tuners = [m for m in self._modules if isinstance(m, BaseTunerLayer)]
        modes = tuple([m.training for m in self._modules])
        tuners = []
        for module in self._tuners:
            scaling = getattr(module, "scaling", {})
            tuners.append((module.merged, module.disable_adapters, tuple(module.active_adapters),
                           tuple(scaling.items()) if isinstance(scaling, dict) else scaling))
        return modes, tuple(tuners)


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


def cublas_workspace_bytes(device: torch.device) -> int:
    """Bytes of the cuBLAS workspace torch gives each CUDA stream on ``device`` at its first GEMM (the caching
    allocator counts it and never frees it, so every new stream a recording runs on adds it): the sizes of
    CUBLAS_WORKSPACE_CONFIG (``:KiB:count`` pairs) when it is set, else cuBLAS's recommended size, which torch
    uses: 32 MiB from compute capability 9 (Hopper), 4096 KiB x 2 + 16 KiB x 8 before. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    numbers = [int(n) for n in re.findall(r":(\d+)", config)]
    if numbers and len(numbers) % 2 == 0:
        return sum(kib * 1024 * count for kib, count in zip(numbers[::2], numbers[1::2]))
    major, _ = torch.cuda.get_device_capability(device)
    return 32 * 2**20 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def run_on_side_stream(fn: Callable, args: tuple, kwargs: dict, times: int = 1) -> Any:
    """``fn(*args, **kwargs)`` ``times`` times on a side stream ordered with the current one both ways, as PyTorch
    asks of the calls before a recording (lazy initialization and autotuning then happen off the recorded stream);
    the last output."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(times):
            out = fn(*args, **kwargs)
    current.wait_stream(side)
    return out


@contextlib.contextmanager
def capture_or_undo(graph: "torch.cuda.CUDAGraph", pool: Optional[tuple] = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` that leaves the process as it found it when the recording fails.

    A capture stopped by an error (a host sync, a data-dependent shape) ends inside ``capture_end``, before torch
    undoes what ``capture_begin`` set up, and torch undoes none of it later:
    - the current stream stays the capture's side stream (``torch.cuda.graph`` restores it after ``capture_end``);
    - the device's CUDA generator stays in capture mode (its epilogue runs only after a successful end), so every later
      random draw outside a graph raises "Offset increment outside graph capture encountered unexpectedly";
    - the caching allocator keeps routing the capture's allocations to its private pool and never frees it.
    Here each is put back: the stream, the generator (its state before the capture, as a fresh state object:
    a failed capture draws nothing), the pool (ended and released, so ``empty_cache`` returns its memory: a caller
    that passed ``pool`` must not record into it again). What the recorded code did in Python (tensors it assigned,
    such as ``.grad``) is the caller's to undo."""
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream()
    generator = torch.cuda.default_generators[device]   # the one a capture on this device registers
    saved = generator.clone_state()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    except BaseException:
        torch.cuda.set_stream(stream)
        generator.graphsafe_set_state(saved)
        try:
            torch._C._cuda_endAllocateToPool(device, pool)
        except RuntimeError:
            pass   # the capture never began allocating to the pool, or torch already ended it: nothing to release
        else:
            # the capture's hold on the pool, which its graph will never give back; the pool's id must not be
            # used again (a released id that still holds blocks refuses a new capture)
            torch._C._cuda_releasePool(device, pool)
        raise


__all__ = ["AdapterState", "NotGraphable", "adapter_state", "capture_or_undo", "copy_output", "cublas_workspace_bytes",
           "describe_call", "first_line", "run_on_side_stream", "substitute"]
