"""Copies of adapter weights cast to the activations' dtype, kept on their layer for calls that read them often.

A decode step's kernel reads every adapter weight it needs once per program (ops.decode): PEFT keeps adapters in
fp32 over a bf16 base, and the kernel casts each tile to the activations' dtype anyway, so a copy cast once gives
the same outputs from half the bytes. A copy is made again, in its old memory where the shape holds (a CUDA graph
recorded over the layer reads that memory), when a source tensor moved or was written: its address and version
counter, and the replays counted by :func:`note_replayed_weight_writes`, because a replayed CUDA graph that writes
weights (an optimizer step recorded by ``sits_lora.graph_train_step``) moves no version counter.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch
from torch import nn

_replayed_writes = 0
_unprovable = itertools.count()   # keys of sources whose version cannot be read: never equal to an older one


def note_replayed_weight_writes() -> None:
    """Called after each replay of a recorded step that may write weights: every cast copy is made again."""
    global _replayed_writes
    _replayed_writes += 1


def source_key(tensors: tuple) -> tuple:
    """What a copy of ``tensors`` depends on: their addresses, version counters, and the replayed writes. An
    inference tensor (made under ``torch.inference_mode``) has no version counter: its key is new at every call, so
    a copy of it is made again every time."""
    return (_replayed_writes,) + tuple(
        (t.data_ptr(), next(_unprovable) if t.is_inference() else t._version, t.dtype, tuple(t.shape), t.device)
        for t in tensors)


def written_into(old: Optional[tuple], new: tuple) -> tuple:
    """``new``'s values in ``old``'s memory where the shapes, dtypes and devices hold (a recorded graph reads that
    memory), else ``new`` (also when an old tensor is an inference tensor, which only inference mode may write)."""
    if old is None or len(old) != len(new) or any(o.shape != n.shape or o.dtype != n.dtype or o.device != n.device
                                                  or o.is_inference() for o, n in zip(old, new)):
        return new
    for o, n in zip(old, new):
        o.copy_(n)
    return old


_SLOT = "_sits_cast_copies"


def cast_copies(owner: nn.Module, name: str, sources: Callable[[], tuple], dtype: torch.dtype) -> tuple:
    """The tensors ``sources()`` returns, cast to ``dtype`` (no autograd), kept on ``owner`` under ``name`` and made
    again when :func:`source_key` changes (module docstring). ``sources`` is kept too: :func:`refresh_cast_copies`
    asks it for the tensors of now (an adapter's weights may have been replaced). Not a buffer: no state dict
    entry, not moved by ``.to()`` (the layer drops its copies then: :func:`drop_cast_copies`)."""
    tensors = sources()
    if any(t.is_inference() for t in tensors):
        return tensors   # weights made under inference mode: no version to prove a copy current; read them as they are
    store = owner.__dict__.setdefault(_SLOT, {})
    entry = store.get((name, dtype))
    key = source_key(tensors)
    if entry is None or entry[0] != key:
        with torch.no_grad(), torch.inference_mode(False):   # a plain tensor either mode may write again
            copies = written_into(None if entry is None else entry[2],
                                  tuple(t.detach().to(dtype, copy=True) for t in tensors))
        entry = store[(name, dtype)] = (key, sources, copies)
    return entry[2]


def refresh_cast_copies(modules) -> int:
    """Make again, in place, every cast copy of ``modules`` whose sources changed since (what an eager call would
    do before a replay reads them); a copy whose sources are gone (an adapter deleted) is dropped. Returns how many
    were made again."""
    made = 0
    for module in modules:
        store = module.__dict__.get(_SLOT)
        for (name, dtype), (key, sources, _) in list((store or {}).items()):
            try:
                tensors = sources()
            except (KeyError, AttributeError):
                del store[(name, dtype)]
                continue
            if source_key(tensors) != key:
                cast_copies(module, name, sources, dtype)
                made += 1
    return made


def kept_cast_copies(modules) -> list:
    """The copies ``modules`` hold now: a CUDA graph that reads them keeps them alive."""
    return [entry[2] for module in modules for entry in module.__dict__.get(_SLOT, {}).values()]


def drop_cast_copies(owner: nn.Module, name: Optional[str] = None) -> None:
    """Forget ``owner``'s copies under ``name`` (an adapter deleted), or all of them (the module moved or cast):
    they are made again from the weights of the next call that asks."""
    store = owner.__dict__.get(_SLOT)
    if store:
        for key in [k for k in store if name is None or k[0] == name]:
            del store[key]
