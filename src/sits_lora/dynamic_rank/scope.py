"""The dynamic-rank layers' view of the current forward: counted or not, which tokens are padding.

The model's forward hooks (installed by :class:`~sits_lora.dynamic_rank.budget.RankBudget`) and
:func:`valid_tokens` write it; each dynamic-rank layer (DynamicRankVariant) reads it to decide what its rank statistics count.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor


class _ForwardState:
    """What the layers of the current forward need to know, per thread: inside a counted scope (the
    forward of a model with a RankBudget, or ``valid_tokens``), its attention mask (B, S) as given (0 =
    padding) or None, and whether ``RankBudget.measuring()`` is on.

    Attributes of one plain object, not context variables or a threading.local: torch.compile traces
    their writes in the model's forward hooks and their reads in the layers (torch 2.11 and 2.13), while
    ContextVar.get broke the graph in every dynamic-rank layer (12 breaks in a 2-layer Llama,
    bench/graph_breaks.py) and a threading.local's writes inside the graph were not seen by its reads
    on torch 2.13 (the compiled layers then counted nothing). The cost: one process runs one counted
    forward at a time (nn.DataParallel's threaded replicas would share it; DDP, one process per GPU,
    does not). The mask is stored as given and turned to bool where it is read: a store of a tensor
    made inside the graph breaks it."""

    def __init__(self):
        self.in_scope = False
        self.mask: Optional[Tensor] = None
        self.measuring = False


_STATE = _ForwardState()


def enter_scope(mask: Optional[Tensor]) -> tuple:
    previous = (_STATE.in_scope, _STATE.mask)
    _STATE.in_scope, _STATE.mask = True, mask
    return previous


def leave_scope(previous: tuple) -> None:
    _STATE.in_scope, _STATE.mask = previous


@contextlib.contextmanager
def valid_tokens(attention_mask: Optional[Tensor]):
    """Within the block, dynamic-rank layers count their training tokens in the rank statistics (as inside
    the forward of a model with a RankBudget) and, when their input has the mask's leading shape, skip
    the masked tokens. For loops that call parts of a model themselves."""
    previous = enter_scope(attention_mask)
    try:
        yield
    finally:
        leave_scope(previous)


def in_token_scope() -> bool:
    """True inside the forward of a model with a RankBudget, or inside ``valid_tokens``."""
    return _STATE.in_scope


def measuring_active() -> bool:
    """True inside ``RankBudget.measuring()``."""
    return _STATE.measuring


def set_measuring(on: bool) -> bool:
    """Turn counting of evaluation and no_grad forwards on or off; returns the previous setting."""
    previous, _STATE.measuring = _STATE.measuring, on
    return previous


def current_valid_tokens(leading_shape: torch.Size) -> Optional[Tensor]:
    """(T,) bool for the current forward, or None when no mask applies to an input of this shape.

    A mask of another shape (e.g. (B, past + 1) during cached generation) does not describe the
    tokens of this input; then every token counts.
    """
    mask = _STATE.mask
    if not _STATE.in_scope or mask is None or tuple(mask.shape) != tuple(leading_shape):
        return None
    return mask.reshape(-1).bool()
