"""Launching the Triton kernels with little host time.

``kernel[grid](*args)`` (``JITFunction.run``) rebuilds the same facts on every call: it binds the
arguments, specializes each one, turns the options into a cache key string, checks the kernel's
globals, asks the driver for the device and stream, and the launcher asks the driver to validate
every pointer. That takes several times the host time of the compiled kernel's own launcher
(bench/profile_host.py; docs/performance.md), and a layer step issues four of them.

``TritonLauncher`` keeps the compiled kernel per specialization. A call computes the facts Triton
specializes on, from the arguments, in one pass: each tensor's dtype and whether its address is
16-byte aligned, each integer's class (1, a multiple of 16, other; 64-bit when it does not fit
32 bits), and the constexpr values as they are. The first call with a new class goes through
``JITFunction.run`` (which compiles if needed and returns the compiled kernel); later calls launch
that kernel directly, with the pointers passed as integers. A Triton whose compiled kernels lack
the launcher interface used here, a launch hook (a profiler such as proton), or the interpreter
all take ``JITFunction``'s own path, as does every call when ``SITS_LORA_DIRECT_LAUNCH=0``.
``tests/ops/test_launch_gpu.py`` checks, on a GPU, that two calls with the same classes get the same
Triton specialization, and that the results match the plain launch.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def direct_launch_enabled() -> bool:
    return os.environ.get("SITS_LORA_DIRECT_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _int_class(v: int) -> int:
    if v == 1:
        return 1
    if _INT32_MIN <= v <= _INT32_MAX:
        return 16 if v % 16 == 0 else 0
    return 64 + (16 if v % 16 == 0 else 0)


def _float_class(v) -> type:
    if type(v) is not float:
        raise TypeError("not a float")
    return float


def _int_value(v):
    if type(v) is not int:
        raise TypeError("not an int")
    return v


def _generic_bind(values: list, constexpr: list) -> tuple:
    """(key, launch values) for any argument types: the path a binder falls back to."""
    key, launch_values = [], []
    for value, is_constexpr in zip(values, constexpr):
        if is_constexpr:
            key.append(value)
            launch_values.append(value)
        elif isinstance(value, torch.Tensor):
            ptr = value.data_ptr()
            key.append(value.dtype)
            key.append(ptr % 16 == 0)
            launch_values.append(ptr)
        elif type(value) is int:
            key.append(_int_class(value))
            launch_values.append(value)
        else:  # floats (one fp32 type), bools, None
            key.append(type(value))
            launch_values.append(value)
    return tuple(key), launch_values


def _make_bind(values: list, constexpr: list):
    """A binder written for the argument types of one call (as Triton writes its own): straight-line code
    instead of a loop with type tests, several times faster. A later call with another type at some position
    raises (AttributeError / TypeError) and takes _generic_bind."""
    params, key, launch = [], [], []
    for i, (value, is_constexpr) in enumerate(zip(values, constexpr)):
        name = f"a{i}"
        params.append(name)
        if is_constexpr:
            key.append(name)
            launch.append(name)
        elif isinstance(value, torch.Tensor):
            key.append(f"{name}.dtype, p{i} % 16 == 0")
            launch.append(f"p{i}")
        elif type(value) is int:
            # _int_class inlined for 32-bit ints; anything else (64-bit, or not an int) goes through it
            key.append(f"((1 if {name} == 1 else 16 if {name} % 16 == 0 else 0) if type({name}) is int "
                       f"and -2147483648 <= {name} <= 2147483647 else _ic(_iv({name})))")
            launch.append(name)
        elif type(value) is float:
            key.append(f"_fc({name})")
            launch.append(name)
        else:
            return None
    pointers = [f"p{i} = a{i}.data_ptr()" for i, (v, c) in enumerate(zip(values, constexpr))
                if not c and isinstance(v, torch.Tensor)]
    source = (f"def bind({', '.join(params)}):\n"
              + "".join(f"    {line}\n" for line in pointers)
              + f"    return ({', '.join(key)},), [{', '.join(launch)}]\n")
    namespace = {"_ic": _int_class, "_iv": _int_value, "_fc": _float_class}
    exec(source, namespace)  # noqa: S102 - the source is built above from the kernel's parameter count only
    return namespace["bind"]


class TritonLauncher:
    """Launch ``fn`` (a ``triton.jit`` function) as ``launcher(grid, *args, num_warps=, num_stages=, **constexprs)``.

    Positional arguments follow the kernel's signature; the constexprs after them are given by name.
    """

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)
        self.direct = params is not None and direct_launch_enabled()
        self.names = [p.name for p in params] if params is not None else []
        self.constexpr = [bool(p.is_constexpr) for p in params] if params is not None else []
        self._kernels: dict = {}
        self._bind = None
        self.direct_launches = 0  # read by the GPU tests and bench/profile_host.py

    def __call__(self, grid, *args: Any, num_warps: int = 4, num_stages: int = 3, **named: Any):
        if not self.direct:
            return self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **named)
        values = list(args)
        if named:
            values += [named[name] for name in self.names[len(args):]]
        if self._bind is None:
            self._bind = _make_bind(values, self.constexpr) or _generic_bind_for(self.constexpr)
        try:
            key, launch_values = self._bind(*values)
        except (AttributeError, TypeError):
            key, launch_values = _generic_bind(values, self.constexpr)
        device = torch.cuda.current_device()
        key = (device, num_warps, num_stages, key)
        kernel = self._kernels.get(key)
        if kernel is None or _launch_hook_set():
            compiled = self.fn[grid](*values, num_warps=num_warps, num_stages=num_stages)
            if kernel is None:
                self._remember(key, compiled)
            return
        run, function, packed = kernel
        self.direct_launches += 1
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, _raw_stream(device), function, packed, None, None, None, *launch_values)

    def _remember(self, key, compiled) -> None:
        try:
            handle = (compiled.run, compiled.function, compiled.packed_metadata)
        except AttributeError:  # a Triton without this launcher interface: stay on JITFunction.run
            self.direct = False
            return
        if len(self._kernels) > 1024:  # many token counts of one class share a key; this bounds odd strides
            self._kernels.clear()
        self._kernels[key] = handle


def _generic_bind_for(constexpr: list):
    return lambda *values: _generic_bind(list(values), constexpr)


try:
    from triton import knobs as _knobs
except ImportError:  # an older Triton: no launch hooks to honour
    _knobs = None


def _hook_active(hook) -> bool:
    # Triton >= 3.5 holds the hooks in a HookChain that is never None: active when it holds a call.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def _launch_hook_set() -> bool:
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _raw_stream(device: int) -> int:
    """The current CUDA stream's handle, as Triton's own launch asks for it."""
    return torch._C._cuda_getCurrentRawStream(device)
