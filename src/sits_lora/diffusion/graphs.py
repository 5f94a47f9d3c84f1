"""CUDA graphs over the denoiser's forward: each denoising step replays one recorded launch sequence.

A U-Net call issues a few thousand small kernels; on a fast GPU the host's time to issue them is the
step (docs/diffusion.md). ``graph_denoiser(pipe)`` records the denoiser's forward once per input
signature (shapes, dtypes, non-tensor arguments, and what each LoRA layer would do: active adapters, scales,
merged or not) and replays it: a step then costs a copy of each input tensor into the recorded buffers, one
replay, and a copy of the output. It works for any ``nn.Module`` denoiser (a U-Net or a DiT, with sits_lora's,
PEFT's or no adapter), under ``torch.no_grad`` / ``torch.inference_mode`` in eval mode; any other call runs the
forward as before (a no-grad call in training mode, or with arguments it cannot record, says so once in the log).

What a replay does not see, and how to make it see it:
- a parameter *replaced* by a new tensor (not written in place: in-place writes, as ``load_state_dict`` and an
  optimizer do, are seen): ``graphs.reset()``;
- Python work in forward hooks (``LatentGuard(watch_modules=True)``): it ran once, at recording. The latent check of
  ``LatentGuard`` itself runs outside the denoiser and works as before.
Cross-attention K / V kept across steps (``reuse_cross_attention_kv``, sits_lora.layers.siblings) is decided in Python,
which a replay does not run; so each signature is recorded twice: once computing to_k / to_v into buffers the
recording owns, once reading those buffers instead. A call replays the second only when its
``encoder_hidden_states`` is the very tensor of the last computing replay, unchanged (its version counter), and the
kept layers' weights are unchanged too; anything else replays the first. Under ``torch.inference_mode`` (no version
counters) and for denoisers without sits_lora cross-attention groups there is one recording.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch
from torch import nn

from ..utils.cuda_graphs import AdapterState, NotGraphable, capture_or_undo, copy_output, describe_call, substitute
from ..utils import validation
from .reuse import cross_attention_groups, denoiser_of

logger = logging.getLogger("sits_lora")

class _Recording:
    """The recordings of one input signature: ``graph`` computes everything; ``kept_graph`` (when the denoiser has
    cross-attention groups that keep K / V) reads the K / V the last replay of ``graph`` wrote instead of computing
    them. ``kept`` holds the groups' records of those buffers (x, weights with versions, outputs): alive as long as
    the recording, so no later allocation takes their memory."""

    def __init__(self, graph, inputs: list, output: Any) -> None:
        self.graph, self.inputs, self.output = graph, inputs, output
        self.kept_graph = self.kept_output = None
        self.kept: list = []
        self._weights: list = []
        self._text: Optional[torch.Tensor] = None     # the text states of the last computing replay, and versions
        self._versions: Optional[tuple] = None

    def add_kept(self, graph, output: Any, kept: list) -> None:
        self.kept_graph, self.kept_output, self.kept = graph, output, kept
        self._weights = [t for record in kept for t, _ in record[2]]

    def _state(self, text: torch.Tensor) -> tuple:
        return (text._version, *(t._version for t in self._weights))

    def computed_from(self, text: Any) -> None:
        usable = isinstance(text, torch.Tensor) and self.kept_graph is not None and not text.is_inference()
        self._text = text if usable else None          # a reference: no other tensor can take its identity
        self._versions = self._state(text) if usable else None

    def may_read_kept(self, text: Any) -> bool:
        """Whether the last computing replay saw this very tensor, unchanged, and the same weights."""
        return (self._text is not None and text is self._text and not text.is_inference()
                and self._state(text) == self._versions)


class DenoiserGraphs:
    """The recorded forwards of one denoiser (see the module docstring); made by :func:`graph_denoiser`."""

    def __init__(self, model: nn.Module, max_graphs: int = 4, warmup: int = 2) -> None:
        self.model = model
        self._adapter_state = AdapterState(model)   # asked every step: walking the module tree is host time
        self.max_graphs = max_graphs
        self.warmup = warmup
        self._eager_forward = model.forward
        self._graphs: dict = {}
        # the groups that keep K / V across eager calls; off between recordings (a replay decides it, see _Recording)
        self._kv_groups = [g for g in cross_attention_groups(model) if g.reuse_across_calls]
        for group in self._kv_groups:
            group.reuse_across_calls = False
            group.release()
        self._eager_reasons: set = set()
        self._full_warned = False
        self.replays = 0      # read by tests and bench/diffusion.py
        self.kept_replays = 0  # of which replays of a recording that reads kept K / V
        self.recordings = 0
        model.forward = self   # an instance attribute: nn.Module.__call__ (and its hooks) reach it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return self._eager_forward(*args, **kwargs)
        if self.model.training:   # dropout and training-mode branches: not what a recording may stand for
            self._note_eager("the denoiser in training mode (call .eval() to replay recordings)")
            return self._eager_forward(*args, **kwargs)
        tensors: list = []
        try:
            key = (describe_call((args, kwargs), tensors), torch.is_inference_mode_enabled(),
                   self._adapter_state())
        except NotGraphable as reason:
            self._note_eager(str(reason))
            return self._eager_forward(*args, **kwargs)
        if key not in self._graphs:
            if len(self._graphs) >= self.max_graphs:
                if not self._full_warned:
                    self._full_warned = True
                    warnings.warn(
                        f"graph_denoiser: {len(self._graphs)} recordings already (max_graphs={self.max_graphs}); "
                        "further input signatures run eagerly. A Python number that changes every step (a float "
                        "timestep) makes a new signature each step: pass it as a tensor.", stacklevel=2)
                return self._eager_forward(*args, **kwargs)
            self._graphs[key] = self._record(args, kwargs, tensors)
        entry = self._graphs[key]
        if entry is None:
            return self._eager_forward(*args, **kwargs)
        for static, given in zip(entry.inputs, tensors):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        text = kwargs.get("encoder_hidden_states")
        if entry.kept_graph is not None and entry.may_read_kept(text):
            entry.kept_graph.replay()
            self.kept_replays += 1
            output = entry.kept_output
        else:
            entry.graph.replay()
            entry.computed_from(text)
            output = entry.output
        self.replays += 1
        return copy_output(output)

    def _record(self, args: tuple, kwargs: dict, tensors: list) -> Optional["_Recording"]:
        """The recordings of this signature, or None when it cannot be recorded."""
        static_inputs = [t.clone() for t in tensors]
        static_args, static_kwargs = substitute((args, kwargs), iter(static_inputs))
        inference = torch.is_inference_mode_enabled()
        groups = [] if inference else self._kv_groups
        # K / V reuse on from the warm-up on: under compile_blocks the groups' setting is part of what dynamo
        # compiled for (an operator around a kept to_k / to_v), so the warm-up compiles what the recordings run
        # (compiling inside a recording would fail)
        for group in groups:
            group.release()
            group.reuse_across_calls = True
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # first calls off the recording: autotuning, allocator growth, lazy init
                for _ in range(self.warmup):
                    out = self._eager_forward(*static_args, **static_kwargs)
            torch.cuda.current_stream().wait_stream(side)
            try:
                copy_output(out)
            except NotGraphable as reason:
                self._note_eager(str(reason))
                return None
            for group in groups:   # the computing recording keeps each group's K / V in its own memory
                group.release()
            graph = torch.cuda.CUDAGraph()
            with capture_or_undo(graph):
                static_output = self._eager_forward(*static_args, **static_kwargs)
            recording = _Recording(graph, static_inputs, static_output)
            kept = [group.kept for group in groups]
            if any(k is not None for k in kept):
                kept_graph = torch.cuda.CUDAGraph()
                with capture_or_undo(kept_graph, pool=graph.pool()):
                    kept_output = self._eager_forward(*static_args, **static_kwargs)
                # a group that gave its kept outputs back still holds the same record; one that computed again
                # (its input was not the text states themselves) made a new one, inside this recording
                read = [k for group, k in zip(groups, kept) if k is not None and group.kept is k]
                if read:
                    recording.add_kept(kept_graph, kept_output, read)
        finally:
            for group in groups:
                group.reuse_across_calls = False
                group.release()
        self.recordings += 1
        return recording

    def _note_eager(self, reason: str) -> None:
        if reason not in self._eager_reasons:   # once per reason: a pipeline makes this call every step
            self._eager_reasons.add(reason)
            logger.warning("graph_denoiser: a call with %s runs eagerly (not recorded)", reason)

    def reset(self) -> None:
        """Drop every recording (after a parameter was replaced by a new tensor); the next call records again."""
        self._graphs.clear()
        self._full_warned = False

    def release(self) -> None:
        """Uninstall: the denoiser's own forward again, its recordings freed, K / V reuse as it was."""
        self.reset()
        if self.model.__dict__.get("forward") is self:
            del self.model.forward
        for group in self._kv_groups:
            group.reuse_across_calls = True


def graph_denoiser(pipe_or_model, max_graphs: int = 4, warmup: int = 2) -> DenoiserGraphs:
    """Record the denoiser's forward (``pipe.unet`` or ``pipe.transformer``, or the model given) as CUDA graphs and
    replay them on later calls with the same signature. Returns the installed :class:`DenoiserGraphs`
    (``.release()`` uninstalls it)."""
    model = denoiser_of(pipe_or_model, "graph_denoiser")
    if isinstance(model.__dict__.get("forward"), DenoiserGraphs):
        raise ValueError("graph_denoiser: this denoiser's forward is already recorded; call .release() on the "
                         "DenoiserGraphs first")
    validation.check_arguments("graph_denoiser", max_graphs=(max_graphs, validation.positive_int()),
                               warmup=(warmup, validation.positive_int()))
    parameter = next(model.parameters(), None)
    if parameter is None or not parameter.is_cuda:
        where = "no parameters" if parameter is None else f"parameters on {parameter.device}"
        raise ValueError(f"graph_denoiser records CUDA graphs: the denoiser has {where}; move it to a GPU first "
                         "(pipe.to('cuda'))")
    return DenoiserGraphs(model, max_graphs=max_graphs, warmup=warmup)
