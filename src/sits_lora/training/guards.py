"""NaN / Inf guards: the trainable gradients before the optimizer step, and (optionally) every forward output.

The gradient check is one fused reduction per (device, dtype) group: ``torch._foreach_norm(grads, inf)``
gives every gradient's largest magnitude in one launch, and a non-finite entry anywhere makes that
norm NaN or Inf. The host reads one small tensor per optimizer step: the flags [non-finite gradient,
non-finite activation], after one all-reduce when torch.distributed is initialized, so every rank
takes the same decision (a rank that raised alone would leave the others waiting in their next
collective until the NCCL timeout); nothing is read back per tensor. Only the rare paths (a bad
step, clamping) look at single tensors.

A skipped step sets every trainable ``.grad`` to None. PyTorch optimizers (and bitsandbytes',
and transformers' Adafactor) leave a parameter whose grad is None untouched, state included,
so the optimizer step that follows changes nothing while the Trainer's step counter, its data
position and its learning-rate schedule move on as if the update had been applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch import nn

from ..utils.distributed import all_reduce_max

logger = logging.getLogger("sits_lora")

NAN_POLICIES = ("skip", "clamp", "raise", "off")


class NonFiniteGradientError(FloatingPointError):
    """A trainable gradient holds NaN or Inf and ``nan_policy="raise"``."""


class NonFiniteActivationError(FloatingPointError):
    """A module's forward output holds NaN or Inf, ``detect_nonfinite_activations=True`` and ``nan_policy="raise"``."""


@dataclass
class GuardOutcome:
    """What the gradient guard did at one optimizer step."""

    step: int
    nonfinite: bool = False
    activation_nonfinite: bool = False
    skipped: bool = False
    clamped_values: int = 0
    bad_parameters: list[str] = field(default_factory=list)


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 / tensor-parallel gradients are DTensors: check the local shard; the flag is all-reduced.
    return t.to_local() if hasattr(t, "to_local") else t


def max_abs_per_tensor(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Largest |value| of each tensor (NaN where a tensor holds NaN): one ``_foreach_norm`` per (device, dtype).

    Returns a float32 vector on the first tensor's device, grouped by (device, dtype), and ``order``:
    entry k of the vector belongs to ``tensors[order[k]]``. No index tensor goes to the device.
    """
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out_device = tensors[0].device
    parts, order = [], []
    for indices in groups.values():
        norms = torch._foreach_norm([tensors[i] for i in indices], float("inf"))
        parts.append(torch.stack(norms).to(device=out_device, dtype=torch.float32))
        order.extend(indices)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), order


def activation_message(step: int, name: Optional[str]) -> str:
    """The error / warning for a non-finite forward output; ``name`` None: it was seen on another rank."""
    where = f"is {name}" if name is not None else "was on another rank"
    return (f"optimizer step {step}: the first module whose forward output is not finite {where}. Fix: check this "
            f"step's batch and that module's inputs and weights; lower learning_rate or set max_grad_norm.")


class GradientGuard:
    """Checks the trainable gradients of ``model`` once per optimizer step and applies ``policy``.

    ``policy``: "skip" drops the step (every trainable grad set to None, see the module docstring),
    "clamp" acts only on a step where some gradient is not finite: there it replaces NaN by 0 and
    bounds ±Inf and every value beyond ``clamp_value`` to ±clamp_value, in the gradients that hold
    such values (a step whose gradients are all finite is left exactly as it is); "raise" raises
    :class:`NonFiniteGradientError` naming the first bad parameter (in ``named_parameters`` order)
    and the step; "off" does nothing.
    """

    def __init__(self, policy: str = "skip", clamp_value: float = 1.0):
        if policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy={policy!r} is invalid: allowed values are {', '.join(map(repr, NAN_POLICIES))}.")
        self.policy = policy
        self.clamp_value = float(clamp_value)
        self._named: list[tuple[str, nn.Parameter]] = []

    def bind(self, model: nn.Module) -> int:
        """Remember the trainable parameters of ``model``; returns how many there are."""
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return len(self._named)

    def check(self, step: int, names_and_params: Optional[Iterable[tuple[str, nn.Parameter]]] = None,
              activation: Optional[str] = None) -> GuardOutcome:
        """Check this step's gradients and apply the policy; every rank must call it at every optimizer step.

        ``activation``: the first module on this rank whose forward output was not finite this step
        (from :class:`ActivationWatch`), None when all were. Its flag goes into the same all-reduce as
        the gradient flag; under "raise" a non-finite output on any rank raises
        :class:`NonFiniteActivationError` on every rank, before the gradient check (it names the cause).
        """
        outcome = GuardOutcome(step=step)
        if self.policy == "off":
            return outcome
        named = list(names_and_params) if names_and_params is not None else self._named
        with_grad = [(n, p) for n, p in named if p.grad is not None]
        grads = [_local(p.grad) for _, p in with_grad]
        device = grads[0].device if grads else torch.device("cpu")
        # A fill on the device, not a host tensor copied over: the flags' read below stays the step's only sync.
        act_flag = torch.full((), activation is not None, dtype=torch.bool, device=device)
        if grads:
            max_abs, order = max_abs_per_tensor(grads)                            # (n_params,), grouped
            bad = ~torch.isfinite(max_abs)
            flags = torch.stack([bad.any(), act_flag])
        else:
            flags = torch.stack([torch.zeros((), dtype=torch.bool), act_flag])
        any_bad, any_act = (bool(v) for v in all_reduce_max(flags, torch.int32).tolist())     # the one host read per step
        outcome.activation_nonfinite = any_act
        if any_act and self.policy == "raise":
            raise NonFiniteActivationError(activation_message(step, activation))
        if not any_bad:
            return outcome
        outcome.nonfinite = True
        if grads:
            positions = sorted(order[k] for k in bad.nonzero().flatten().tolist())   # named_parameters order
            outcome.bad_parameters = [with_grad[i][0] for i in positions]
        if self.policy == "raise":
            raise NonFiniteGradientError(self._describe(outcome, dict(with_grad)))
        if self.policy == "skip":
            for _, p in named:
                p.grad = None
            outcome.skipped = True
        elif self.policy == "clamp" and grads:
            # Some rank saw a non-finite value: this rank bounds its own gradients of the step too.
            needs = bad | (max_abs > self.clamp_value)
            outcome.clamped_values = self._clamp([grads[i] for i in order], needs)
        return outcome

    def _clamp(self, grads: list[torch.Tensor], needs: torch.Tensor) -> int:
        c = self.clamp_value
        counts = []
        for k in needs.nonzero().flatten().tolist():
            g = grads[k]
            counts.append(((~torch.isfinite(g)) | (g.abs() > c)).sum())
            torch.nan_to_num_(g, nan=0.0, posinf=c, neginf=-c).clamp_(-c, c)
        return int(torch.stack(counts).sum().item()) if counts else 0

    def _describe(self, outcome: GuardOutcome, params: dict) -> str:
        if outcome.bad_parameters:
            first = outcome.bad_parameters[0]
            p = params.get(first)
            what = "is not finite"
            if p is not None and p.grad is not None:
                g = _local(p.grad)
                what = ("holds NaN" if torch.isnan(g).any() else "holds Inf")
                what += f" (shape {tuple(g.shape)}, dtype {str(g.dtype).removeprefix('torch.')})"
            others = len(outcome.bad_parameters) - 1
            where = f"the gradient of {first} {what}" + (f", and {others} other parameter(s) too" if others else "")
        else:
            where = "a gradient on another rank is not finite"
        return (
            f"optimizer step {outcome.step}: {where}. Nothing was applied at this step (nan_policy='raise'). Fix: "
            f"lower learning_rate, set max_grad_norm, check this step's batch (SitsHardwareCallback("
            f"detect_nonfinite_activations=True) names the first module whose output is not finite), or use "
            f"nan_policy='skip' to drop such steps and keep training."
        )


class ActivationWatch:
    """Forward hooks that find the first module whose output is not finite.

    Every module's floating-point outputs get one ``isfinite().all()`` reduction on the device,
    stored without a host read; :meth:`first_nonfinite` reads them once. Only the outermost
    forward is watched: a gradient-checkpointing recompute during backward runs the same modules
    again and is ignored. A debugging aid: it costs one small reduction per module call.
    """

    def __init__(self):
        self._handles: list = []
        self._flags: list[tuple[int, torch.Tensor]] = []
        self._names: list[str] = []
        self._active = False

    def attach(self, model: nn.Module) -> None:
        self.detach()
        self._names = []
        # A hook on the base layer of an adapted layer would turn off sits_lora's fused path (it runs the
        # base GEMM itself); the adapted layer's own output is watched instead.
        base_layers = {id(m.get_base_layer()) for m in model.modules()
                       if callable(getattr(m, "get_base_layer", None)) and m.get_base_layer() is not m}
        for index, (name, module) in enumerate(model.named_modules()):
            self._names.append(name or type(module).__name__)
            if module is model or id(module) in base_layers:
                continue
            self._handles.append(module.register_forward_hook(self._make_hook(index)))
        self._handles.append(model.register_forward_pre_hook(self._enter))
        self._handles.append(model.register_forward_hook(self._leave, always_call=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._flags = []

    def _enter(self, module, args):
        self._active = True

    def _leave(self, module, args, output):
        self._active = False

    def _make_hook(self, index: int):
        def hook(module, args, output):
            if not self._active:
                return
            tensors = [t for t in _flatten(output) if t.is_floating_point() and t.numel()]
            if tensors:
                finite = torch.stack([torch.isfinite(_local(t)).all() for t in tensors]).all()
                self._flags.append((index, finite))

        return hook

    def first_nonfinite(self) -> Optional[str]:
        """Name (and class) of the first module, in call order, whose output was not finite; resets the record."""
        flags, self._flags = self._flags, []
        if not flags:
            return None
        finite = torch.stack([f.to(flags[0][1].device) for _, f in flags])
        bad = (~finite).nonzero().flatten()
        if bad.numel() == 0:
            return None
        return self._names[flags[int(bad[0])][0]]


def _flatten(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in _flatten(v)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in _flatten(v)]
    if hasattr(output, "to_tuple"):  # transformers ModelOutput
        return _flatten(output.to_tuple())
    return []
