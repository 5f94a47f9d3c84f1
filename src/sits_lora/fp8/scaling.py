"""Delayed scaling state of every fp8 layer of a model, advanced in one batched update per optimizer step."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..ops import fp8 as fp8_ops
from ..utils.distributed import all_reduce_max, world_size

logger = logging.getLogger("sits_lora")

SLOTS = ("input", "grad")   # slot 0: the layer input x (forward); slot 1: the output gradient dy (backward)
_ALIGN_FLOATS = 4           # 16 bytes of fp32: the alignment cuBLAS wants of an fp8 GEMM's scale pointer


class Fp8ScalingState(nn.Module):
    """amax histories and scales of L fp8 layers, stacked: one update for all of them, no host sync.

    Buffers (fp32 unless noted), slot 0 = the layer input x, slot 1 = the output gradient dy:
        amax_history  (H, L, 2)  ring buffer of per-step amax, H = fp8_amax_history_len
        amax          (L, 2)     this step's running amax: the cast kernels atomically max into it
        scale         (L, 2)     the scale the casts use:  q = fp8(x · scale)
        scale_inv     (L, 2)     1 / scale, the dequantization factor torch._scaled_mm takes: a strided view
                                 of a padded (L, 8) buffer, one entry per 16 bytes, because cuBLAS (CUDA 13)
                                 refuses fp8 GEMMs whose scale is not 16-byte aligned
        saturated_steps, nonfinite_steps  (L, 2) int64: per slot, optimizer steps whose amax was
                                 beyond the representable range at the scale in use / NaN or Inf

    :meth:`update` (Transformer Engine's DelayedScaling): the step's amax (the largest over the ranks of a
    distributed run) enters the history,
    amax_use = max over the history ("max") or this step's ("most_recent"),
    scale = (fp8_max / amax_use) / 2**margin, kept where amax_use is 0. A NaN / Inf amax enters the
    history as 2 · fp8_max / scale, so the next scale is at most half the one in use (the back-off),
    and it ages out of the history like any other entry. Until the first update every cast uses
    its tensor's own amax (current scaling): no step runs on the default scale of 1.

    The state is not saved with the adapter (it belongs to the training run, not to the weights):
    :class:`sits_lora.SitsHardwareCallback` writes it into each Trainer checkpoint and a run resumed
    from one continues with its history and scales (:meth:`sits_checkpoint_state`).
    """

    # Each rank's buffers are its own: amax gathers this rank's micro-batches until update() reduces it over the
    # ranks, after which every rank holds the same history and scales. DDP must not broadcast rank 0's before each
    # forward (sits_lora.model.SitsLoraModel._ddp_params_and_buffers_to_ignore reads this).
    rank_local_buffers = True

    def __init__(self, names: list[str], recipe: str, history_len: int, algo: str, margin: int, emulate: bool,
                 device: Optional[torch.device] = None):
        super().__init__()
        L = len(names)
        self.names = list(names)
        self.recipe, self.history_len, self.algo, self.margin, self.emulate = recipe, history_len, algo, margin, emulate
        self.grad_dtype = fp8_ops.E5M2 if recipe == "hybrid" else fp8_ops.E4M3
        f32 = dict(device=device, dtype=torch.float32)
        self.register_buffer("amax_history", torch.zeros(history_len, L, 2, **f32), persistent=False)
        self.register_buffer("amax", torch.zeros(L, 2, **f32), persistent=False)
        self.register_buffer("scale", torch.ones(L, 2, **f32), persistent=False)
        # entries at columns 0 and 4 (16-byte steps): every layer's scale goes to cuBLAS without a copy
        self.register_buffer("_scale_inv_padded", torch.ones(L, 2 * _ALIGN_FLOATS, **f32), persistent=False)
        self.register_buffer("fp8_max", torch.tensor([fp8_ops.FP8_MAX[fp8_ops.E4M3], fp8_ops.FP8_MAX[self.grad_dtype]],
                                                     **f32), persistent=False)
        self.register_buffer("saturated_steps", torch.zeros(L, 2, device=device, dtype=torch.int64), persistent=False)
        self.register_buffer("nonfinite_steps", torch.zeros(L, 2, device=device, dtype=torch.int64), persistent=False)
        # the ring buffer's next row and whether any update ran, on the device: a recorded training step advances
        # the state inside its CUDA graph, where a Python counter would stay at its value at recording
        self.register_buffer("position", torch.zeros((), device=device, dtype=torch.int64), persistent=False)
        self.register_buffer("started", torch.zeros((), device=device, dtype=torch.bool), persistent=False)
        self.steps = 0
        # a bool, not steps > 0: torch.compile guards on it and compiles the delayed graph once
        self.delayed = False
        # set by a training step that advanced the state inside itself (sits_advance_in_step), cleared by the next
        # update() or per-step hook, which then has nothing left to do
        self._advanced_in_step = False
        self._logged = torch.zeros(2, dtype=torch.int64)
        self._pending: Optional[tuple[torch.Tensor, object]] = None

    @property
    def scale_inv(self) -> torch.Tensor:
        """(L, 2) view of the padded buffer: each entry 16-byte aligned."""
        return self._scale_inv_padded[:, ::_ALIGN_FLOATS]

    def copy_rows_from(self, other: "Fp8ScalingState") -> None:
        """Take over the history, scales and counts of layers ``other`` also has (matched by name)."""
        rows = [(i, other.names.index(n)) for i, n in enumerate(self.names) if n in other.names]
        if not rows or other.history_len != self.history_len:
            return
        mine = torch.tensor([i for i, _ in rows], device=self.scale.device)
        theirs = torch.tensor([j for _, j in rows], device=other.scale.device)
        with torch.no_grad():
            for name in ("amax", "scale", "scale_inv", "saturated_steps", "nonfinite_steps"):
                getattr(self, name)[mine] = getattr(other, name)[theirs].to(self.scale.device)
            self.amax_history[:, mine] = other.amax_history[:, theirs].to(self.scale.device)
            self.position.copy_(other.position)
            self.started.copy_(other.started)
        self.steps, self.delayed = other.steps, other.delayed

    def scales_for(self, index: int, training: bool) -> dict:
        """The ``scales`` argument of :func:`sits_lora.ops.fp8.fp8_lora_linear` for layer ``index``.

        Training after the first update: the state's delayed scales, recording amax. Eval: each
        tensor's own amax (current scaling), recording nothing.
        """
        return {
            "delayed": training and self.delayed,
            "scale": self.scale[index],
            "scale_inv": self.scale_inv[index],
            "amax": self.amax[index] if training else None,
            "margin": self.margin,
            "grad_dtype": self.grad_dtype,
            "emulate": self.emulate,
        }

    @torch.no_grad()
    def update(self) -> None:
        """Advance every layer's history and scales once: a dozen tensor ops for the whole model. Nothing to do
        when the training step already advanced them (:meth:`sits_advance_in_step`)."""
        if self._advanced_in_step:
            self._advanced_in_step = False
            return
        self.sits_advance_in_step()
        self._advanced()

    @torch.no_grad()
    def sits_advance_in_step(self) -> None:
        """The update's device work alone: no host sync, no Python state, so a CUDA graph of the whole training step
        (sits_lora.training.TrainStep) records it and every replay advances the state. The step then calls
        :meth:`sits_note_advanced` on the host after each call."""
        new = _max_over_ranks(self.amax)                                       # (L, 2)
        finite = torch.isfinite(new)
        # the first update's step used each tensor's own amax: nothing was clipped
        saturated = finite & (new * self.scale > self.fp8_max) & self.started
        entry = torch.where(finite, new, 2 * self.fp8_max / self.scale)
        self.amax_history.index_copy_(0, self.position.view(1), entry.unsqueeze(0))
        self.position.copy_((self.position + 1) % self.history_len)
        amax_use = entry if self.algo == "most_recent" else self.amax_history.amax(dim=0)
        scale = fp8_ops.scale_from_amax(amax_use, self.fp8_max, self.margin, self.scale)
        self.scale.copy_(scale)
        self.scale_inv.copy_(scale.reciprocal())
        self.saturated_steps += saturated
        self.nonfinite_steps += ~finite
        self.amax.zero_()
        self.started.fill_(True)

    def sits_note_advanced(self) -> None:
        """Host bookkeeping after a training step ran :meth:`sits_advance_in_step`: the step count, the switch to
        the delayed scales, the log of clipped and non-finite amaxes; this step's update() or per-step hook then
        does nothing."""
        self._advanced()
        self._advanced_in_step = True

    def _advanced(self) -> None:
        self.steps += 1
        self.delayed = True
        self._report_without_sync()

    _CHECKPOINTED = ("amax_history", "scale", "scale_inv", "saturated_steps", "nonfinite_steps")

    def sits_checkpoint_state(self) -> dict:
        """What a resumed run needs (found by SitsHardwareCallback on any module of the model, saved with
        each Trainer checkpoint): the history, scales, counts and the position in the ring buffer."""
        return {"names": list(self.names), "recipe": self.recipe, "history_len": self.history_len,
                "steps": self.steps, "position": int(self.position), "delayed": self.delayed,
                **{k: getattr(self, k).detach().cpu().clone() for k in self._CHECKPOINTED}}

    def sits_load_checkpoint_state(self, saved: dict) -> None:
        """Continue from :meth:`sits_checkpoint_state`'s dict; refuses one of other layers or settings."""
        mine = (list(self.names), self.recipe, self.history_len)
        theirs = (list(saved["names"]), saved["recipe"], saved["history_len"])
        if mine != theirs:
            raise ValueError(
                f"the checkpoint's fp8 scaling state was saved for {len(theirs[0])} layers, fp8={theirs[1]!r}, "
                f"fp8_amax_history_len={theirs[2]}; this model has {len(mine[0])} layers, fp8={mine[1]!r}, "
                f"fp8_amax_history_len={mine[2]}. Resume with the SitsLoraConfig the checkpoint was trained with "
                f"(a checkpoint from before fp8_layers existed quantized every adapted layer: fp8_layers='all'; with "
                f"fp8_layers='auto' the layers chosen follow the GPU's measurements, see fp8_layer_plan).")
        with torch.no_grad():
            for k in self._CHECKPOINTED:
                getattr(self, k).copy_(saved[k])
            self.position.fill_(int(saved["position"]))
            self.started.fill_(int(saved["steps"]) > 0)
        self.steps, self.delayed = int(saved["steps"]), bool(saved["delayed"])
        self._advanced_in_step = False
        self._logged = torch.stack([self.saturated_steps.sum(), self.nonfinite_steps.sum()]).cpu()

    def sits_after_optimizer_step(self, step: int, skipped: bool) -> None:
        """The per-step hook of :class:`sits_lora.SitsHardwareCallback` (found on the model by name).

        A skipped step advances the state too: its NaN / Inf amax is what backs the scale off.
        """
        self.update()

    def log_counts(self) -> dict:
        """Totals over all layers (host values: one device sync), for logs."""
        return {"fp8_saturated": int(self.saturated_steps.sum()), "fp8_nonfinite": int(self.nonfinite_steps.sum())}

    def _report_without_sync(self) -> None:
        # The totals reach the host by an asynchronous copy; the previous step's copy, finished by
        # now, is read and logged when it grew. Logging lags one step and never stalls the GPU.
        if self._pending is not None:
            host, event = self._pending
            if event is None or event.query():
                self._pending = None
                if bool((host > self._logged).any()):
                    saturated, nonfinite = (int(v) for v in host - self._logged)
                    # a NaN / Inf is news; a clipped amax is delayed scaling's ordinary lag (TE clips too)
                    logger.log(logging.WARNING if nonfinite else logging.INFO,
                               "sits_lora fp8: %d layer input/gradient amax(es) beyond the fp8 range and %d NaN/Inf by "
                               "optimizer step %d; their scales backed off (totals: %d, %d).",
                               saturated, nonfinite, self.steps - 1, int(host[0]), int(host[1]))
                    self._logged = host.clone()
        if self._pending is None:
            totals = torch.stack([self.saturated_steps.sum(), self.nonfinite_steps.sum()])
            if totals.is_cuda:
                host = torch.empty(2, dtype=torch.int64, pin_memory=True)
                host.copy_(totals, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending = (host, event)
            else:
                self._pending = (totals.clone(), None)

    def extra_repr(self) -> str:
        return (f"layers={len(self.names)}, recipe={self.recipe!r}, history={self.history_len}, algo={self.algo!r}, "
                f"margin={self.margin}, steps={self.steps}")


def _max_over_ranks(amax: torch.Tensor) -> torch.Tensor:
    """This step's amax, the largest over the ranks of a distributed run (DDP / FSDP feed each rank other data):
    every rank then takes the same scales, as one process with the whole batch would. A NaN / Inf on any rank
    becomes +inf on all (a max over NaN is not defined), so every rank backs off together. One all-reduce of
    L x 2 floats a step; none in a single process. Not while a CUDA graph records (a collective there needs the
    backend's graph support): the ranks' scales then drift apart, which is said once."""
    if world_size() == 1:
        return amax
    if amax.is_cuda and torch.cuda.is_current_stream_capturing():
        global _warned_capture
        if not _warned_capture:
            _warned_capture = True
            logger.warning("fp8 scaling: the update runs inside a CUDA graph recording on several ranks; its amax "
                           "is not reduced over them there, so the ranks' scales drift apart. Update the scales "
                           "outside the recorded step.")
        return amax
    return all_reduce_max(torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("inf"))))


_warned_capture = False


def find_scaling_states(model: nn.Module) -> list[Fp8ScalingState]:
    return [m for m in model.modules() if isinstance(m, Fp8ScalingState)]


def fp8_scaling_state(model: nn.Module) -> Fp8ScalingState:
    """The Fp8ScalingState of a PeftModel with an fp8 adapter."""
    states = find_scaling_states(model)
    if not states:
        raise ValueError(
            "this model has no fp8 base layers: create the adapter with SitsLoraConfig(fp8='hybrid', ...). With "
            "fp8_layers='auto' (the default) a layer gets the fp8 base only where fp8 is faster at its shape; "
            "sits_lora.fp8.fp8_layer_plan(model) says why each stayed bf16, and fp8_layers='all' quantizes them all.")
    return states[0]


def update_scaling(model: nn.Module) -> None:
    """Advance the fp8 scales once; call after each ``optimizer.step()`` in a hand-written loop.

    ``sits_lora.SitsHardwareCallback`` does this by itself in a transformers Trainer. Without any
    call the casts keep using each tensor's own amax (current scaling: correct, one more read of
    each activation and gradient).
    """
    for state in find_scaling_states(model):
        state.update()
