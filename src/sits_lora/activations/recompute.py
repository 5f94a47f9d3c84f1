"""LoRA inputs rebuilt in backward from tensors the frozen model keeps anyway.

A LoRA layer needs its input x for dA = s·(dY B)ᵀ x, so every LoRA implementation saves x. A frozen
decoder layer saves none of these inputs as such, but it does save what they are made from:

* q/k/v and gate/up read the output of an RMSNorm whose backward keeps the norm's input h (Liger's
  norm, and any norm that saves its input): x = norm(h) is rebuilt by running the norm again;
* o_proj reads the attention output in (batch, seq, heads·dim) layout, a transposed copy of the
  tensor that scaled_dot_product_attention keeps for its own backward: x = out.transpose(1, 2);
* down_proj reads act(gate)·up, whose multiply (or Liger's fused SiLU·mul) keeps its two factors:
  x = a·b again. The fused kernels' x pass goes further: it reads the two factors and multiplies them as it
  loads (``InputRecompute.product_of``, ops.ProductInput), so that x is neither saved nor rebuilt in memory.

While an adapted layer runs, a ``saved_tensors_hooks`` pair swaps x, wherever an op saves it, for a
``RebuiltInput`` that holds references to those kept tensors (no new memory) and recomputes x when
backward unpacks it. The recomputation runs the same ops on the same values, so the gradients are
bit-identical to saving x. Each producer is recognized at run time, per call, from the tensor
itself (the norm's last output, or x's autograd node), so a model whose layer does not match simply
saves x as before; each such layer is named once in the log.

Eager only: under torch.compile the graph partitioner decides what to save. Inside gradient
checkpointing or any other saved-tensor hooks (sits_lora's offload included), the outer hooks own every
saved tensor and this stays out of their way.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ..ops import ProductInput

logger = logging.getLogger("sits_lora")

# The saved-tensor hooks in force, or None (private in torch; absent there, nothing is recomputed).
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

# norm module -> [its last input, its last output, the RebuiltInput made from them], all weak; written by a
# forward hook, so that q, k and v called one by one on one norm output share one rebuild
_NORM_IO: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()

# grad_fn names of ops that only move values (the attention output's way to o_proj)
_LAYOUT_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "CloneBackward0"})
# Liger's fused gated activations: forward(ctx, a, b) saves exactly (a, b)
_FUSED_PRODUCTS = frozenset({"LigerSiLUMulFunctionBackward", "LigerGELUMulFunctionBackward"})


class RebuiltInput:
    """What a LoRA op saves instead of its input: the kept tensors and the function that rebuilds x.

    The value is computed on the first unpack and kept while any saving op still holds this object,
    so q, k and v run one by one share one rebuild; it is freed with the last of them.
    """

    __slots__ = ("_rebuild", "_sources", "_versions", "_value", "__weakref__")

    def __init__(self, rebuild: Callable[..., Tensor], sources: tuple) -> None:
        self._rebuild, self._sources, self._value = rebuild, sources, None
        # the sources are plain references, not saved tensors: autograd's in-place check does not cover them
        self._versions = tuple(t._version for t in sources if isinstance(t, Tensor))

    def value(self) -> Tensor:
        if self._value is None:
            versions = tuple(t._version for t in self._sources if isinstance(t, Tensor))
            if versions != self._versions:
                raise RuntimeError(
                    "sits_lora: a tensor that a LoRA layer's input is rebuilt from was modified in place between "
                    "forward and backward, so the rebuilt input would be wrong. Set "
                    "SitsLoraConfig(recompute_lora_inputs=False) for this model (the layers then save their inputs)."
                )
            with torch.no_grad():
                self._value = self._rebuild(*self._sources)
        return self._value


class _ViewOf:
    """A saved view of x (an op that flattened x to 2-D before saving it)."""

    __slots__ = ("rebuilt", "shape")

    def __init__(self, rebuilt: RebuiltInput, shape: torch.Size) -> None:
        self.rebuilt, self.shape = rebuilt, shape


def _unpack(packed):
    kind = type(packed)
    if kind is RebuiltInput:
        return packed.value()
    if kind is _ViewOf:
        return packed.rebuilt.value().view(packed.shape)
    return packed


def _saving_rebuilt(x: Tensor, rebuilt: RebuiltInput) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that replace x (or a contiguous view of it) by ``rebuilt``.

    Every tensor saved under the hooks keeps a reference to the pack hook until its node has run backward.
    So the hook holds x only weakly (or x would stay alive through the very hooks that were to free it),
    and it is a closure that does not refer to the hooks object (a bound method would: the object holds
    its hook, the hook its object, a cycle that only the garbage collector frees, with the rebuilt x in it).
    """
    x_ref, ptr, numel, dtype = weakref.ref(x), x.data_ptr(), x.numel(), x.dtype

    def pack(t: Tensor):
        if t is x_ref():
            return rebuilt
        if t.data_ptr() == ptr and t.numel() == numel and t.dtype == dtype and t.is_contiguous():
            return _ViewOf(rebuilt, t.shape)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


# ----------------------------------------------------------------------------- producers


def remember_norm_io(module: nn.Module, args: tuple, output) -> None:
    """Forward hook on a norm that feeds adapted layers: remember (weakly) its last input and output."""
    if torch.compiler.is_compiling() or not args or not isinstance(output, Tensor):
        return
    _NORM_IO[module] = [weakref.ref(args[0]), weakref.ref(output), None]


# norm module -> whether its backward keeps its input (decided once: it is the norm's code, not the call's)
_NORM_KEEPS_INPUT: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
_SAVED_NAMES = ("_saved_self", "_saved_other", "_saved_result")


def _keeps(x: Tensor, h: Tensor, nodes: int = 8) -> bool:
    """Whether the autograd graph between h and x saves h itself (its storage), so that referring to h costs
    nothing. Liger's norm saves its input; transformers' RMSNorm under bf16 saves an fp32 copy instead, and
    referring to h would keep as many bytes alive as x did: no gain, and a recompute to pay."""
    ptr, stop, queue, seen = h.data_ptr(), h.grad_fn, [x.grad_fn], 0
    while queue and seen < nodes:
        node = queue.pop(0)
        if node is None or node is stop:
            continue
        seen += 1
        saved = getattr(node, "saved_tensors", None) if hasattr(node, "_forward_cls") else None
        tensors = saved if saved is not None else [getattr(node, n, None) for n in _SAVED_NAMES]
        if any(isinstance(t, Tensor) and t.data_ptr() == ptr for t in tensors):
            return True
        queue.extend(fn for fn, _ in node.next_functions)
    return False


def _run_norm(norm: nn.Module, h: Tensor) -> Tensor:
    # forward, not the module call: the hooks (ours included) are not part of the value; an instance's own
    # forward (Liger patches loaded models that way) is the one that ran
    return norm.forward(h)


def _from_norm(x: Tensor, norms: tuple) -> Optional[RebuiltInput]:
    for norm in norms:
        io = _NORM_IO.get(norm)
        if io is None or io[1]() is not x:
            continue
        shared = io[2]() if io[2] is not None else None
        if shared is not None:
            return shared
        h = io[0]()
        # a norm whose input needs no gradient keeps nothing for backward: h would be kept for us alone
        if h is None or not h.requires_grad:
            return None
        keeps = _NORM_KEEPS_INPUT.get(norm)
        if keeps is None:
            keeps = _NORM_KEEPS_INPUT[norm] = _keeps(x, h)
        if not keeps:
            return None
        rebuilt = RebuiltInput(_run_norm, (norm, h))
        io[2] = weakref.ref(rebuilt)
        return rebuilt
    return None


# what a producer returns when x itself is a tensor the frozen model keeps: saving x holds no extra memory
ALREADY_KEPT = object()


def _transpose_back(out: Tensor, transposes: tuple, shape: torch.Size) -> Tensor:
    for dim0, dim1 in transposes:
        out = out.transpose(dim0, dim1)
    return out.reshape(shape)


def _from_attention(x: Tensor) -> Optional[RebuiltInput]:
    """x = reshape(transpose(sdpa_out)): the attention output that scaled_dot_product_attention keeps."""
    node, transposes = x.grad_fn, []
    while node is not None:
        name = type(node).__name__
        if name in _LAYOUT_NODES:
            pass
        elif name == "TransposeBackward0":
            transposes.append((node._saved_dim0, node._saved_dim1))
        elif name.startswith("ScaledDotProduct"):
            out = getattr(node, "_saved_output", None)
            if out is None or out.numel() != x.numel() or not transposes:
                return None
            if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
                # flash attention writes (batch, seq, heads, dim): x is a view of what attention keeps, saving
                # it costs nothing and there is nothing to rebuild
                return ALREADY_KEPT
            return RebuiltInput(_transpose_back, (out, tuple(reversed(transposes)), x.shape))
        else:
            return None
        inputs = node.next_functions
        node = inputs[0][0] if inputs else None
    return None


def _mul(a: Tensor, b: Tensor) -> Tensor:
    return a * b


def _apply_function(function, a: Tensor, b: Tensor, extra: tuple, shape: torch.Size) -> Tensor:
    return function.apply(a, b, *extra).view(shape)


def _factors(a: Tensor, b: Tensor, silu: bool) -> Optional[ProductInput]:
    """The factors as the x pass reads them (two contiguous tensors of one layout), or None."""
    return ProductInput(a, b, silu) if a.is_contiguous() and b.is_contiguous() and a.shape == b.shape else None


def _from_product(x: Tensor) -> tuple[Optional[RebuiltInput], Optional[ProductInput]]:
    """(rebuild, factors) for x = a·b where the multiply keeps a and b (act(gate)·up), or Liger's fused act·mul of
    (gate, up); factors None where the x pass cannot read them (Liger's multipliers other than 1, strided factors)."""
    node = x.grad_fn
    if node is None:
        return None, None
    name = type(node).__name__
    if name == "MulBackward0":
        a, b = node._saved_self, node._saved_other
        if a is None or b is None or a.shape != x.shape or b.shape != x.shape or a.dtype != x.dtype:
            return None, None  # a factor that needs no gradient is not kept: x would be kept as two tensors
        return RebuiltInput(_mul, (a, b)), _factors(a, b, silu=False)
    if name in _FUSED_PRODUCTS:
        saved = node.saved_tensors  # (a, b) flattened to 2-D by the kernel
        if len(saved) != 2 or saved[0].numel() != x.numel() or saved[0].dtype != x.dtype:
            return None, None
        # LigerSiLUMulFunction's optional multipliers, kept on its context
        extra = tuple(float(getattr(node, k)) for k in ("gate_multiplier", "down_multiplier") if hasattr(node, k))
        rebuilt = RebuiltInput(_apply_function, (node._forward_cls, saved[0], saved[1], extra, x.shape))
        plain_silu = name == "LigerSiLUMulFunctionBackward" and all(m == 1.0 for m in extra)
        return rebuilt, _factors(saved[0], saved[1], silu=True) if plain_silu else None
    return None, None


# ----------------------------------------------------------------------------- per layer


class InputRecompute:
    """Set on an adapted layer: finds how its input can be rebuilt, per call.

    ``norms`` are the norms of the layer's decoder block (the candidates for q/k/v and gate/up);
    the attention output and the gated product are recognized from x's autograd node.
    """

    def __init__(self, name: str, norms: tuple) -> None:
        self.name = name
        self.norms = norms
        self.calls = 0          # training forwards (autograd on, eager, no outer saved-tensor hooks)
        # of those, forwards whose input had a rebuild (any op saving it saved that) or was itself a tensor the
        # frozen model keeps (no hooks needed)
        self.rebuilt_calls = 0
        self._reported = False
        # (x, its two factors, silu), all weakly: the last forward's input if it is a product, what product_of hands
        # the op (weakly: a forward whose path does not ask must not keep the factors alive past its backward)
        self._product: Optional[tuple] = None

    def saving(self, x: Tensor) -> Optional[torch.autograd.graph.saved_tensors_hooks]:
        """The hooks to run the layer's forward under, or None to run it as is."""
        self._product = None
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or _top_hooks is None:
            return None
        if _top_hooks(False) is not None:
            # gradient checkpointing or an offload owns the saved tensors (and finding a rebuild would unpack the
            # tensors those hooks packed: an offload's would come back to the device in forward)
            return None
        self.calls += 1
        if x.grad_fn is None:
            return None  # x is a leaf (or needs no gradient): nothing upstream kept what it is made from
        rebuilt = (_from_norm(x, self.norms) if self.norms else None) or _from_attention(x)
        if rebuilt is None:
            rebuilt, factors = _from_product(x)
            if factors is not None:
                self._product = (weakref.ref(x), weakref.ref(factors.gate), weakref.ref(factors.up), factors.silu)
        if rebuilt is None:
            if not self._reported:
                self._reported = True
                producer = type(x.grad_fn).__name__
                logger.info("sits_lora: %s saves its LoRA input (made by %s, which keeps nothing it can be rebuilt "
                            "from)", self.name, producer)
            return None
        self.rebuilt_calls += 1
        return None if rebuilt is ALREADY_KEPT else _saving_rebuilt(x, rebuilt)

    def product_of(self, x: Tensor) -> Optional[ProductInput]:
        """x's two factors when this forward's input (the x ``saving`` just saw) is a product whose factors the
        frozen model keeps, else None. The hooks ``saving`` returned still cover anything else that saves x."""
        product, self._product = self._product, None
        if product is None or product[0]() is not x:
            return None
        gate, up = product[1](), product[2]()
        return None if gate is None or up is None else ProductInput(gate, up, product[3])

    def __repr__(self) -> str:
        return f"InputRecompute({self.name!r}, norms={len(self.norms)})"
