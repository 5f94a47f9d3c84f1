"""Saved tensors in pinned host memory, copied on a side stream while the GPU computes.

``offload_saved_tensors()`` is a ``saved_tensors_hooks`` pair, like ``torch.autograd.graph.save_on_cpu``,
with what training at long context needs from it:

* the device-to-host copy of a saved tensor runs on a side stream, after the op that produced it and
  concurrently with the forward that follows (``save_on_cpu`` copies on the compute stream and waits);
* in backward, unpacking one tensor starts the host-to-device copy of the tensors saved just before it
  (the next ones backward needs), so they arrive while the current layer computes;
* tensors under ``min_bytes`` stay where they are (a copy's fixed cost is not worth their memory), and one
  tensor saved by several ops (the RoPE tables every layer reads) goes to the host once.

``offloaded_checkpoint`` is gradient checkpointing whose kept layer inputs go to the host that way: with
it a decoder layer holds nothing on the GPU between its forward and its backward. It is transformers'
checkpoint function of the layers after ``enable_offloaded_checkpointing(model)``.

Under these hooks, as under any, the LoRA layers save their inputs (``recompute`` stays out of outer hooks'
way): the inputs go to the host with the rest.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..utils.model_structure import decoder_layers, restore_forwards, unwrap_model
from ..utils import validation

# Below this many bytes a saved tensor stays on its device.
DEFAULT_MIN_BYTES = 1 << 20


# Pinned memory comes from torch's caching host allocator, which rounds every block up to a power of two (a 3.2 GiB
# layer input would take 4 GiB). A host copy is therefore made of pieces whose sizes are powers of two, down to
# this size; the last piece rounds up by less than it.
_MIN_PIECE_BYTES = 1 << 20


def _piece_sizes(numel: int, element_size: int) -> list[int]:
    """Element counts of the pieces a host copy of ``numel`` elements is made of (their byte sizes are powers of
    two, largest first, but the last, under ``_MIN_PIECE_BYTES``)."""
    sizes, left = [], numel * element_size
    while left >= _MIN_PIECE_BYTES:
        piece = 1 << (left.bit_length() - 1)
        sizes.append(piece // element_size)
        left -= piece
    if left:
        sizes.append(left // element_size)
    return sizes


class _Offloaded:
    """One saved tensor's host copy (in pieces), and the device copy while it is on its way back."""

    __slots__ = ("pieces", "shape", "dtype", "device", "source", "copied", "back", "back_ready", "previous", "nbytes",
                 "taken", "__weakref__")

    def __init__(self, pieces: list, shape, dtype, device: torch.device, copied, previous) -> None:
        self.pieces, self.shape, self.dtype, self.device, self.copied = pieces, shape, dtype, device, copied
        self.source = None  # weakref to the device tensor while it lives (one host copy per tensor)
        self.back: Optional[Tensor] = None
        self.back_ready = None
        self.previous = previous  # weakref to the handle packed just before this one (what backward wants next)
        self.nbytes = sum(p.numel() for p in pieces) * pieces[0].element_size()
        self.taken = False  # unpacked once: a prefetch does not fetch it again

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the copy takes (each piece as the caching allocator rounds it)."""
        return sum(1 << max(p.numel() * p.element_size() - 1, 0).bit_length() for p in self.pieces)


class _Streams:
    """The side stream per device, made on first use (a CUDA stream needs an initialized device)."""

    def __init__(self) -> None:
        self._side: dict = {}

    def side(self, device: torch.device):
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        return stream


_STREAMS = _Streams()


def _copy_out(t: Tensor, pin: bool) -> list:
    """Host pieces holding t's values (t contiguous: flat pieces; otherwise one piece of t's shape)."""
    if not t.is_contiguous():
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        return [host]
    flat, pieces, start = t.reshape(-1), [], 0
    for size in _piece_sizes(flat.numel(), t.element_size()):
        host = torch.empty(size, dtype=t.dtype, pin_memory=pin)
        host.copy_(flat[start:start + size], non_blocking=pin)
        pieces.append(host)
        start += size
    return pieces


def _copy_in(handle: "_Offloaded", out: Tensor) -> None:
    if len(handle.pieces) == 1 and handle.pieces[0].shape == out.shape:
        out.copy_(handle.pieces[0], non_blocking=True)
        return
    flat, start = out.view(-1), 0
    for piece in handle.pieces:
        flat[start:start + piece.numel()].copy_(piece, non_blocking=True)
        start += piece.numel()


def _to_host(t: Tensor, previous) -> _Offloaded:
    if t.device.type != "cuda":
        # a host tensor (the CPU tests of the bookkeeping): plain copies, nothing to overlap
        return _Offloaded(_copy_out(t.detach(), pin=False), t.shape, t.dtype, t.device, None, previous)
    compute = torch.cuda.current_stream(t.device)
    side = _STREAMS.side(t.device)
    side.wait_stream(compute)  # t is written by work queued on the compute stream
    with torch.cuda.stream(side):
        pieces = _copy_out(t, pin=True)
        copied = torch.cuda.Event()
        copied.record(side)
    # the allocator may hand t's memory out again only after the side stream has read it
    t.record_stream(side)
    return _Offloaded(pieces, t.shape, t.dtype, t.device, copied, previous)


def _start_back(handle: _Offloaded) -> None:
    """Queue the host-to-device copy of ``handle`` on the side stream (prefetch)."""
    if handle.back is not None:
        return
    if handle.device.type != "cuda":
        back = torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        _copy_in(handle, back)
        handle.back = back
        return
    side = _STREAMS.side(handle.device)
    with torch.cuda.stream(side):
        if handle.copied is not None:
            side.wait_event(handle.copied)
        back = torch.empty(handle.shape, dtype=handle.dtype, device=handle.device)
        _copy_in(handle, back)
        ready = torch.cuda.Event()
        ready.record(side)
    handle.back, handle.back_ready = back, ready


def _take_back(handle: _Offloaded) -> Tensor:
    _start_back(handle)
    handle.taken = True
    back, ready = handle.back, handle.back_ready
    # a tensor can be unpacked more than once (retain_graph); each unpack copies again rather than keep it here
    handle.back = handle.back_ready = None
    if ready is not None:
        compute = torch.cuda.current_stream(handle.device)
        compute.wait_event(ready)
        back.record_stream(compute)  # allocated on the side stream, used and freed on the compute stream
    return back


class _Chain:
    """The handles of one or several hooks objects in the order they were packed (each points to the one before)."""

    __slots__ = ("last", "by_address")

    def __init__(self) -> None:
        self.last = None  # weakref to the newest handle
        # (data_ptr, shape, stride, dtype, version) -> its handle, which counts only while the tensor it copied (its
        # base, for a view) is alive: a freed tensor's address is handed out again
        self.by_address: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def offload_saved_tensors(min_bytes: int = DEFAULT_MIN_BYTES, prefetch_bytes: Optional[int] = None,
                          device_types: Sequence[str] = ("cuda",),
                          chain: Optional["_Chain"] = None) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that keep what autograd saves in pinned host memory (see the module docstring).

    Args:
        min_bytes: smaller tensors stay on their device.
        prefetch_bytes: how far ahead backward fetches: unpacking a tensor starts the copies of the tensors
            saved before it until this many bytes are on their way (None: as many bytes as the tensor being
            unpacked, about one layer ahead when each layer saves one tensor).
        device_types: the devices whose tensors move (``("cpu",)`` exercises the bookkeeping on a CPU).
        chain: shared by several hooks objects (one per layer call), so that backward prefetches across them
            in the order they packed; None: this object's own.
    """
    if min_bytes < 0:
        raise ValueError(f"offload_saved_tensors: min_bytes={min_bytes} is invalid: it must be >= 0.")
    chain = _Chain() if chain is None else chain
    kinds = tuple(device_types)

    def pack(t: Tensor):
        if t.device.type not in kinds or t.numel() == 0 or t.numel() * t.element_size() < min_bytes:
            return t
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter) or (t.requires_grad and t.grad_fn is None):
            # a parameter (or a view of one: a frozen weight's transpose), or a leaf that needs a gradient (the
            # embeddings' output under enable_input_require_grads): alive anyway, a host copy would free nothing
            return t
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        handle = chain.by_address.get(key)
        if handle is not None and handle.source() is not None:
            # the same memory, alive, unchanged (same version): the same values. Views of one tensor (each layer's
            # unsqueezed RoPE table) are distinct objects over one storage, so the live base is what is tracked
            return handle
        handle = _to_host(t, chain.last)
        handle.source = weakref.ref(base)
        chain.last = weakref.ref(handle)
        chain.by_address[key] = handle
        return handle

    def unpack(packed):
        if type(packed) is not _Offloaded:
            return packed
        value = _take_back(packed)
        budget = packed.nbytes if prefetch_bytes is None else prefetch_bytes
        ahead = packed.previous() if packed.previous is not None else None
        while ahead is not None and budget > 0:
            if not ahead.taken:
                _start_back(ahead)
                budget -= ahead.nbytes
            ahead = ahead.previous() if ahead.previous is not None else None
        return value

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def offloaded_checkpoint(function, *args, use_reentrant: bool = False, min_bytes: int = DEFAULT_MIN_BYTES,
                         chain: Optional[_Chain] = None, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` whose kept inputs wait in pinned host memory (non-reentrant only:
    the reentrant variant keeps its inputs on its own context, out of reach of saved-tensor hooks). ``chain``:
    shared by the layers of one model, so that backward fetches the next layer's input ahead."""
    if use_reentrant:
        raise ValueError("offloaded_checkpoint: use_reentrant=True is not supported: its inputs are kept out of "
                         "reach of saved-tensor hooks. Use use_reentrant=False (the default).")
    with offload_saved_tensors(min_bytes=min_bytes, chain=chain):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _transformers_model(model: nn.Module) -> nn.Module:
    inner = unwrap_model(model)
    if not hasattr(inner, "_set_gradient_checkpointing"):
        raise TypeError(f"enable_offloaded_checkpointing: {type(model).__name__} is not a transformers model (or a "
                        f"PEFT model around one): it has no gradient checkpointing to offload.")
    return inner


def enable_offloaded_checkpointing(model: nn.Module, *, every_n_layers: int = 1, keep_on_device: int = 0,
                                   min_bytes: int = DEFAULT_MIN_BYTES) -> nn.Module:
    """Gradient checkpointing of the decoder layers with their kept inputs in pinned host memory.

    What stays on the GPU between a layer's forward and its backward is nothing: the layer's input goes
    to the host on a side stream while the next layers compute, and comes back one layer ahead of its
    backward. Call it after ``get_peft_model`` and instead of ``model.gradient_checkpointing_enable()``
    (and without ``TrainingArguments(gradient_checkpointing=True)``, which would replace it).

    ``keep_on_device``: the last this many checkpointed layers keep their inputs on the device (plain
    checkpointing; they are the first that backward needs). What the device has room for need not cross
    PCIe nor take host memory: ``plan_memory`` says how much room there is.

    Returns the model.
    """
    validation.check_arguments(
        "enable_offloaded_checkpointing",
        keep_on_device=(keep_on_device, validation.non_negative_int(" (layers whose inputs stay on the device)")),
        every_n_layers=(every_n_layers, validation.positive_int(" (1 checkpoints every layer)")))
    inner = _transformers_model(model)
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise ValueError(f"enable_offloaded_checkpointing: {type(inner).__name__} does not support gradient "
                         f"checkpointing.")
    # one chain for all layers: unpacking a layer's input in backward starts the copy of the layer's below it
    func = functools.partial(offloaded_checkpoint, min_bytes=min_bytes, chain=_Chain())
    func.sits_lora_offload = True  # read by plan_memory: the checkpointed inputs live on the host
    try:
        inner._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)
    except TypeError:  # transformers before every_n_layers
        if every_n_layers != 1:
            raise
        inner._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    if keep_on_device:
        checkpointed = [b for b in decoder_layers(inner)[1] if getattr(b, "gradient_checkpointing", False)]
        for block in checkpointed[max(len(checkpointed) - keep_on_device, 0):]:
            block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    if hasattr(inner, "enable_input_require_grads"):
        # a checkpointed layer's output must require grad for its backward to run, even with frozen embeddings
        inner.enable_input_require_grads()
    return model


def offloads_checkpoints(block: nn.Module) -> bool:
    """Whether ``block`` is checkpointed with its input offloaded (``enable_offloaded_checkpointing``)."""
    func = getattr(block, "_gradient_checkpointing_func", None)
    return bool(getattr(block, "gradient_checkpointing", False) and getattr(func, "sits_lora_offload", False))


class _OffloadedForward:
    """Set as a decoder layer's ``forward``: the layer's own forward under :func:`offload_saved_tensors`."""

    def __init__(self, block: nn.Module, min_bytes: int, device_types: Sequence[str], chain: _Chain) -> None:
        # the block holds this object in its __dict__: a strong reference back would be a cycle only the garbage
        # collector frees
        self.block = weakref.ref(block)
        self.min_bytes, self.device_types, self.chain = min_bytes, tuple(device_types), chain
        self.original = vars(block).get("forward")

    def __call__(self, *args, **kwargs):
        block = self.block()
        forward = self.original or type(block).forward.__get__(block)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with offload_saved_tensors(min_bytes=self.min_bytes, device_types=self.device_types, chain=self.chain):
            return forward(*args, **kwargs)


def enable_activation_offload(model: nn.Module, layers: Sequence[int], *, min_bytes: int = DEFAULT_MIN_BYTES,
                              device_types: Sequence[str] = ("cuda",)) -> list[int]:
    """Keep what the chosen decoder layers save for backward in pinned host memory (no recompute: the layers run
    once, their saved tensors cross PCIe twice). ``layers``: decoder layer indices; which ones can hide their
    copies behind compute is what ``sits_lora.training.choose_offloaded_layers`` answers from the measured pinned
    bandwidth. ``device_types=("cpu",)`` exercises it on a CPU. Returns the indices set; undo with
    :func:`disable_activation_offload`."""
    _, blocks = decoder_layers(unwrap_model(model))
    if not blocks:
        raise ValueError(f"enable_activation_offload: {type(model).__name__} has no decoder layers.")
    chosen = sorted(set(int(i) for i in layers))
    bad = [i for i in chosen if not 0 <= i < len(blocks)]
    if bad:
        raise ValueError(f"enable_activation_offload: layers={bad} are out of range: the model has {len(blocks)} "
                         f"decoder layers (0 to {len(blocks) - 1}).")
    chain = _Chain()  # one for the model: backward prefetches from one offloaded layer into the next
    for i in chosen:
        current = vars(blocks[i]).get("forward")
        if not isinstance(current, _OffloadedForward):
            blocks[i].forward = _OffloadedForward(blocks[i], min_bytes, device_types, chain)
    return chosen


def disable_activation_offload(model: nn.Module) -> None:
    """Undo :func:`enable_activation_offload`."""
    restore_forwards(model, _OffloadedForward)


def offloads_activations(block: nn.Module) -> bool:
    """Whether ``block``'s saved tensors go to the host (:func:`enable_activation_offload`)."""
    return isinstance(vars(block).get("forward"), _OffloadedForward)
