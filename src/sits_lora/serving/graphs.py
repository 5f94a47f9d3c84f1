"""CUDA graphs over decoding: each generated token's forward replays one recorded launch sequence.

A decode step of a 1B Llama issues a few hundred small kernels for a few megabytes of work per layer; eager, the
host's time to issue them is the step (docs/serving.md, "Decode steps as CUDA graphs"), with or without an
adapter. ``graph_decode(model)`` replaces the causal LM's forward with a recorder: a call that feeds at most
``max_tokens`` new tokens per sample (a decode step) into a *static* KV cache is recorded once per signature and
replayed after that; every other call (the prefill, a call with a growing cache, a call with gradients) runs the
model's own forward::

    graphs = sits_lora.serving.graph_decode(model)       # a PeftModel (sits_lora or PEFT) or a transformers LM
    out = model.generate(input_ids=ids, max_new_tokens=128, cache_implementation="static")
    out = model.generate(input_ids=ids, max_new_tokens=128, cache_implementation="static",
                         adapter_names=names)            # a mixed batch: its own recording
    graphs.release()                                      # the model's own forward again

A signature is: the shapes, dtypes and Python values of the call's arguments; the cache's tensors by address (a
recording writes the cache it was recorded with: a new cache at another address records again); what each adapter
layer does (active adapters, scales, merged / disabled, the adapter set); the batch's ``adapter_names``; train /
eval mode. The adapter state is read at each call that is not recorded (the prefill that starts every
``generate``), not at every decode step (reading it costs more than a 1B model's replayed step): changing the
active adapter *between the decode steps of one generation* is not seen; between generations it is.

What a replay sees: in-place writes to weights (``load_state_dict``, ``sits_lora.AdapterPool`` filling a slot; the
mixed-batch stacks are refreshed by the prefill). Not seen: a parameter replaced by a new tensor (``reset()``).
transformers' own compilation of the decode step is turned off while the recorder is installed (it would compile
the recorder); a dynamic cache (the default) grows every step, so those calls run eagerly, with one log line
naming ``cache_implementation="static"``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch
from torch import nn

from ..utils.cast_copies import kept_cast_copies, refresh_cast_copies
from ..utils import validation
from ..utils.cuda_graphs import (NotGraphable, adapter_state, capture_or_undo, copy_output, describe_call, first_line,
                                 run_on_side_stream, substitute)
from .mixed_batch import buffers_in_use

logger = logging.getLogger("sits_lora")


class _Recording:
    __slots__ = ("graph", "inputs", "output", "kept")

    def __init__(self, graph, inputs: list, output: Any, kept: list) -> None:
        self.graph, self.inputs, self.output, self.kept = graph, inputs, output, kept


# Stands for the KV cache in a recorded output: a recording must not hold the cache itself (its memory would stay
# taken, so the next request's cache would land at another address and record again); a replay returns the
# caller's cache in its place.
_CACHE = object()


def _without_cache(out: Any, cache: Any) -> Any:
    """``out`` (a transformers ModelOutput or a tuple) with ``cache`` replaced by the _CACHE marker."""
    if isinstance(out, dict):
        return type(out)(**{k: _CACHE if v is cache else v for k, v in out.items()})
    if type(out) in (tuple, list):
        return type(out)(_CACHE if v is cache else v for v in out)
    return out


def _is_cache(value: Any) -> bool:
    return hasattr(value, "update") and hasattr(value, "get_seq_length") and not isinstance(value, torch.Tensor)


def _cache_key(cache: Any) -> tuple:
    """A static cache described by its tensors' addresses, shapes and dtypes; NotGraphable for a cache that grows
    (a recording writes fixed addresses)."""
    if not getattr(cache, "is_compileable", False):
        raise NotGraphable(f"a {type(cache).__name__}, which grows every step (generate with "
                           "cache_implementation=\"static\", or pass a transformers.StaticCache)")
    layers = getattr(cache, "layers", None)
    if not layers:
        raise NotGraphable(f"a {type(cache).__name__} without layers (this transformers' cache is not supported)")
    described = []
    for layer in layers:
        tensors = tuple((name, value.data_ptr(), tuple(value.shape), value.dtype)
                        for name, value in sorted(vars(layer).items()) if isinstance(value, torch.Tensor))
        if not getattr(layer, "is_initialized", True) or not tensors:
            raise NotGraphable("a static cache not yet filled (a decode step before any prefill)")
        if any(getattr(layer, name).device.type != "cuda" for name, *_ in tensors):
            raise NotGraphable("a static cache off the GPU (offloaded, or a CPU model)")
        described.append(tensors)
    return (type(cache), tuple(described))


def _new_tokens(args: tuple, kwargs: dict) -> Optional[int]:
    for name, position in (("input_ids", 0), ("inputs_embeds", None)):
        value = kwargs.get(name)
        if value is None and position is not None and len(args) > position:
            value = args[position]
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[1]
    return None


def _batch_adapter_names(layers: list) -> Optional[tuple]:
    """The ``adapter_names`` PEFT's ``generate`` / ``forward`` hands every adapter layer through a pre-forward hook
    (a mixed batch), read from the first layer: None when there is none."""
    if not layers:
        return None
    for hook in layers[0]._forward_pre_hooks.values():
        names = getattr(hook, "keywords", {}).get("adapter_names")
        if names is not None:
            return tuple(names)
    return None


class DecodeGraphs:
    """The recorded decode steps of one causal LM (module docstring); made by :func:`graph_decode`. ``active``
    False runs the model's own forward without dropping the recordings. ``replays``, ``recordings`` and
    ``eager_calls`` count what the calls did."""

    def __init__(self, model: nn.Module, lm: nn.Module, max_graphs: int, warmup: int, max_tokens: int) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model, self.lm = model, lm
        self.max_graphs, self.warmup, self.max_tokens = max_graphs, warmup, max_tokens
        self.active = True
        self._layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self._eager_forward = lm.forward
        self._graphs: dict = {}        # signature -> _Recording, or None: runs eagerly
        self._seen: dict = {}          # signature -> eager calls so far
        self._state: Optional[tuple] = None
        self._eager_reasons: set = set()
        self._full_warned = False
        self.replays = self.recordings = self.eager_calls = 0
        config = getattr(lm, "generation_config", None)
        self._disable_compile = getattr(config, "disable_compile", None) if config is not None else None
        if config is not None and hasattr(config, "disable_compile"):
            config.disable_compile = True   # transformers would torch.compile this recorder for a static cache
        lm.forward = self   # an instance attribute: nn.Module.__call__ (and its hooks) reach it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tokens = _new_tokens(args, kwargs)
        if (not self.active or tokens is None or tokens > self.max_tokens or torch.is_grad_enabled()
                or self.lm.training):
            self._state = None          # a prefill (or another call): the adapter state is read again next time
            refresh_cast_copies(self._layers)   # weights written since the last request: the replays read the copies
            return self._eager(args, kwargs)
        caches = {key: value for key, value in kwargs.items() if _is_cache(value)}
        rest = {key: value for key, value in kwargs.items() if key not in caches}
        tensors: list = []
        try:
            if len(caches) != 1:
                raise NotGraphable("no KV cache (use_cache=False)" if not caches else "several KV caches")
            (cache_name, cache), = caches.items()
            if self._state is None:
                self._state = adapter_state(self.model) + tuple(tuple(layer.lora_A) for layer in self._layers
                                                               if hasattr(layer, "lora_A"))
            key = (describe_call((args, rest), tensors), cache_name, _cache_key(cache), self._state,
                   _batch_adapter_names(self._layers), torch.is_inference_mode_enabled())
        except NotGraphable as reason:
            self._note_eager(str(reason))
            return self._eager(args, kwargs)
        if key not in self._graphs:
            seen = self._seen.get(key, 0)
            if seen < self.warmup:
                self._seen[key] = seen + 1
                self.eager_calls += 1
                return run_on_side_stream(self._eager_forward, args, kwargs)
            if len(self._graphs) >= self.max_graphs:
                if not self._full_warned:
                    self._full_warned = True
                    warnings.warn(
                        f"graph_decode: {len(self._graphs)} recordings already (max_graphs={self.max_graphs}); "
                        "decode steps of another signature (batch size, cache, adapters) run eagerly. A new cache "
                        "each generate at a new address records again: pass one StaticCache (cache.reset() between "
                        "requests) or raise max_graphs.", stacklevel=2)
                return self._eager(args, kwargs)
            self._graphs[key] = self._record(args, kwargs, tensors, cache)
        entry = self._graphs[key]
        if entry is None:
            return self._eager(args, kwargs)
        for static, given in zip(entry.inputs, tensors):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        entry.graph.replay()
        self.replays += 1
        return copy_output(entry.output, {id(_CACHE): cache})

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        self.eager_calls += 1
        return self._eager_forward(*args, **kwargs)

    def _record(self, args: tuple, kwargs: dict, tensors: list, cache: Any) -> Optional[_Recording]:
        """The recording of this signature (nothing runs while recording: the replay that follows makes the step),
        or None when it cannot be recorded."""
        static_inputs = [t.clone() for t in tensors]
        static_args, static_kwargs = substitute((args, kwargs), iter(static_inputs))
        graph = torch.cuda.CUDAGraph()
        try:
            with capture_or_undo(graph):
                static_output = _without_cache(self._eager_forward(*static_args, **static_kwargs), cache)
            copy_output(static_output, {id(_CACHE): cache})
        except NotGraphable as reason:
            self._note_eager(str(reason))
            return None
        except Exception as error:   # noqa: BLE001 (the call runs eagerly; the reason is logged once)
            self._note_eager(f"a step that could not be recorded ({first_line(error)}; a host sync in the model's "
                             "forward?)")
            return None
        self.recordings += 1
        return _Recording(graph, static_inputs, static_output,
                          buffers_in_use(self._layers) + kept_cast_copies(self._layers))

    def _note_eager(self, reason: str) -> None:
        if reason not in self._eager_reasons:   # once per reason: generate makes this call every token
            self._eager_reasons.add(reason)
            logger.warning("graph_decode: a decode step with %s runs eagerly (not recorded)", reason)

    def reset(self) -> None:
        """Drop every recording (after a parameter was replaced by a new tensor); decode steps record again."""
        self._graphs.clear()
        self._seen.clear()
        self._state = None
        self._full_warned = False

    def release(self) -> None:
        """Uninstall: the model's own forward again, the recordings freed, transformers' compile setting back."""
        self.reset()
        if self.lm.__dict__.get("forward") is self:
            del self.lm.forward
        config = getattr(self.lm, "generation_config", None)
        if config is not None and hasattr(config, "disable_compile"):
            config.disable_compile = self._disable_compile


def graph_decode(model: nn.Module, max_graphs: int = 8, warmup: int = 2, max_tokens: int = 1) -> DecodeGraphs:
    """Record ``model``'s decode steps (a PeftModel or a transformers causal LM, on a CUDA GPU) as CUDA graphs and
    replay them (module docstring). ``max_tokens``: the most new tokens per sample a recorded call may feed (1:
    plain decoding). Returns the installed :class:`DecodeGraphs` (``.release()`` uninstalls it)."""
    validation.check_arguments("graph_decode", max_graphs=(max_graphs, validation.positive_int()),
                               warmup=(warmup, validation.positive_int()),
                               max_tokens=(max_tokens, validation.positive_int()))
    if not isinstance(model, nn.Module):
        raise TypeError(f"graph_decode: model must be a PeftModel or a transformers causal LM, got "
                        f"{type(model).__name__}")
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(lm, "generate") or not hasattr(lm, "config"):
        raise TypeError(f"graph_decode: {type(lm).__name__} is not a transformers causal LM (no generate / config)")
    if isinstance(lm.__dict__.get("forward"), DecodeGraphs):
        raise ValueError("graph_decode: this model's decode steps are already recorded; call .release() on the "
                         "DecodeGraphs first")
    parameter = next(lm.parameters(), None)
    if parameter is None or not parameter.is_cuda:
        where = "no parameters" if parameter is None else f"parameters on {parameter.device}"
        raise ValueError(f"graph_decode records CUDA graphs: the model has {where}; move it to a GPU first "
                         "(model.to('cuda'))")
    return DecodeGraphs(model, lm, max_graphs=max_graphs, warmup=warmup, max_tokens=max_tokens)


__all__ = ["DecodeGraphs", "graph_decode"]
