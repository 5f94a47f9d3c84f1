"""How many kernels one adapted layer's training step launches, counted under the Triton interpreter.

On a GPU below the 8B widths the eager step is bound by the host issuing kernels (bench/profile_host.py
measures it: several hundred µs of host time per layer step on the H200 against ~100 µs for the frozen
layer), so a change that adds a launch to the hot path is a slowdown even when every kernel is fast. Counted: Triton launches
and every torch op that runs a kernel (views, allocations and detaches launch nothing). The limit is
today's count; lower it when a change removes launches.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from peft import get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import sits_lora
from sits_lora import SitsLoraConfig, ops

pytestmark = pytest.mark.skipif(not ops.triton_interpreter_on(), reason="counts launches under TRITON_INTERPRET=1")

# torch ops that allocate memory without running a kernel: counted apart (each is host time on the caching allocator)
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_strided.default"}
# torch ops that allocate, alias or re-view memory without running a kernel
NO_KERNEL = {*ALLOCATIONS, "aten.view.default", "aten._unsafe_view.default",
             "aten.detach.default", "aten.t.default", "aten.transpose.int", "aten.as_strided.default",
             "aten.expand.default", "aten.slice.Tensor", "aten.select.int", "aten.alias.default",
             "aten.permute.default", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.split.Tensor",
             "aten.split_with_sizes.default"}


class _Counting(TorchDispatchMode):
    """Counts kernel-running torch ops and, through the patched launcher, Triton launches."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.allocations = 0
        self.in_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self.in_triton:  # the interpreter's own tensor ops are not launches
            if name in ALLOCATIONS:
                self.allocations += 1
            elif name not in NO_KERNEL:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _count_step(monkeypatch, layer_step) -> Counter:
    import triton.runtime.interpreter as interpreter

    mode = _Counting()
    launch = interpreter.InterpretedFunction.__getitem__

    def counted(self, grid):
        run = launch(self, grid)

        def wrapper(*args, **kwargs):
            mode.counts["triton " + self.fn.__name__] += 1
            mode.in_triton = True
            try:
                return run(*args, **kwargs)
            finally:
                mode.in_triton = False
        return wrapper

    layer_step()  # warm: first-call work (tuning lookups, caches) is not the steady state
    monkeypatch.setattr(interpreter.InterpretedFunction, "__getitem__", counted)
    with mode:
        layer_step()
    mode.counts["allocations"] = mode.allocations
    return mode.counts


def _own_python_calls(monkeypatch, layer_step) -> int:
    """Calls of sits_lora's Python functions in one steady-state step, the kernels' launches stubbed out (their
    bodies under the interpreter are not host work on a GPU): each is host time before the next launch."""
    import cProfile
    import pstats

    import triton.runtime.interpreter as interpreter

    layer_step()
    monkeypatch.setattr(interpreter.InterpretedFunction, "__getitem__", lambda self, grid: lambda *a, **k: None)
    profile = cProfile.Profile()
    profile.enable()
    layer_step()
    profile.disable()
    # the package's own files, wherever the repository was cloned (a clone folder named sits_lora holds this test too)
    package = os.path.dirname(os.path.abspath(sits_lora.__file__)) + os.sep
    return sum(calls for (path, _, _), (_, calls, *_) in pstats.Stats(profile).stats.items()
               if os.path.abspath(path).startswith(package))


class _One(nn.Module):
    def __init__(self, d_in, d_out, bias):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x):
        return self.proj(x)


# (name, bias, limit: the launches of one forward + backward at T = 40, two token blocks of the
# interpreter's 32)
CASES = [
    # shrink, expand, dy pass, x pass (which sums g's partials), dA + dB partial sums (Triton);
    # x Wᵀ and dy W (cuBLAS addmm)
    ("one layer", False, 7),
    ("one layer with bias", True, 7),
]
# h, the output, g's and dB's partials, dA's partials, dx, and the dA and dB sums
LAYER_ALLOCATIONS = 8
# sits_lora's Python calls in one layer step (the forward's plan, with the dtype its base computes in, whether its input
# is a product the x pass can read, the op, five launchers and their launch geometry): lower it when a change removes
# some
LAYER_PYTHON_CALLS = 53


@pytest.mark.parametrize("name,bias,limit", CASES, ids=[c[0] for c in CASES])
def test_layer_step_launches_do_not_grow(monkeypatch, name, bias, limit):
    torch.manual_seed(0)
    model = get_peft_model(_One(48, 64, bias), SitsLoraConfig(r=8, lora_alpha=16, kernel="triton",
                                                             target_modules=["proj"]))
    x = torch.randn(2, 20, 48, requires_grad=True)
    dy = torch.randn(2, 20, 64)

    def step():
        x.grad = None
        model.zero_grad(set_to_none=True)
        model(x).backward(dy)

    counts = _count_step(monkeypatch, step)
    allocations = counts.pop("allocations")
    triton_launches = sum(v for k, v in counts.items() if k.startswith("triton "))
    assert triton_launches == 5, counts
    assert sum(counts.values()) <= limit, f"{sum(counts.values())} launches > {limit}: {dict(counts)}"
    assert allocations <= LAYER_ALLOCATIONS, allocations
    calls = _own_python_calls(monkeypatch, step)
    assert calls <= LAYER_PYTHON_CALLS, f"{calls} calls of sits_lora functions in a layer step > {LAYER_PYTHON_CALLS}"


# ours: the concatenated A (forward only: the backward reuses it), 3 x Wᵀ and 3 dy W (addmm); the toy
# model's own: 3 sums over the last dim, 2 adds, the loss's sum and its gradient's fill of ones
SIBLING_TORCH_OPS = 14


def test_siblings_step_launches_do_not_grow(monkeypatch):
    """q / k / v on one input: one shrink for the three, one x pass, one dx (three adds into it), one launch
    summing dA's and the three dB's partials."""
    class _QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(48, 64, False), nn.Linear(48, 32, False), nn.Linear(48, 32, False)

        def forward(self, x):
            return self.q_proj(x).sum(-1) + self.k_proj(x).sum(-1) + self.v_proj(x).sum(-1)

    torch.manual_seed(0)
    model = get_peft_model(_QKV(), SitsLoraConfig(r=8, lora_alpha=16, kernel="triton",
                                                  target_modules=["q_proj", "k_proj", "v_proj"]))
    x = torch.randn(2, 20, 48, requires_grad=True)

    def step():
        x.grad = None
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    counts = _count_step(monkeypatch, step)
    counts.pop("allocations")
    lora = {k: v for k, v in counts.items() if k.startswith("triton ")}
    assert lora == {"triton _lora_shrink_kernel": 1, "triton _lora_expand_kernel": 3,
                    "triton _lora_dy_pass_kernel": 3, "triton _lora_x_pass_kernel": 1,
                    "triton _sum_partials_kernel": 1}, counts
    torch_ops = {k: v for k, v in counts.items() if not k.startswith("triton ")}
    assert sum(torch_ops.values()) <= SIBLING_TORCH_OPS, str(torch_ops)
