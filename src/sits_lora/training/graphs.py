"""CUDA graphs over a whole training step: forward, loss, backward and the optimizer's update replayed as one
recorded launch sequence.

A LoRA step of a diffusers U-Net (or of a small language model) issues a few thousand small kernels, and on a fast
GPU the host's time to issue them is the step: the SD1.5 U-Net's frozen forward + backward keeps the host busy far
longer than the GPU work it issues lasts (docs/diffusion.md). ``graph_train_step(step_fn, optimizer)``
runs ``step_fn`` eagerly for its first ``warmup`` calls per input signature (real steps on real batches, off the
recording: autotuning, allocator growth, the optimizer's state), records the next call as a CUDA graph, and from
then on a call copies its tensors into the recorded inputs, replays, and returns a copy of the outputs::

    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    def step(latents, noise, timesteps, text):
        pred = unet(scheduler.add_noise(latents, noise, timesteps), timesteps, text).sample
        loss = F.mse_loss(pred.float(), noise.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    step = sits_lora.training.graph_train_step(step, optimizer, model=unet)
    for batch in loader:                       # CUDA tensors of one shape
        loss = step(*batch)
        lr_scheduler.step()                    # outside the step: seen by the next replay

What a step function must be: one whole optimizer step on CUDA tensors passed as arguments, with no host sync
(``.item()``, ``.cpu()``, printing a CUDA tensor, data-dependent shapes such as ``torch.nonzero``): such a call
cannot be recorded and raises :class:`GraphCaptureError` naming what failed. Its Python runs once, at recording:
a counter it increments, a scheduler it steps or a branch on a Python value is frozen into the recording. What
the replays do see: in-place writes to parameters and buffers (``load_state_dict``, the optimizer), the learning
rate (made a 0-dim tensor on the parameters' device, which the torch schedulers write in place), and, through
``model``, the adapters' state (active adapter, scales, merged / disabled) and train / eval mode, each of which
records again when it changes. Another optimizer setting (weight decay, betas) changed after recording records
again, with one warning. A parameter *replaced* by a new tensor is not seen: call ``reset()``.
Gradient accumulation across calls is not supported (whether a backward creates or adds to ``.grad`` is fixed
at recording): accumulate inside the step function, over micro-batches passed together.

Attention in transformers models: eagerly, transformers looks at the batch (packed sequences? padding?) and, when
neither, calls ``scaled_dot_product_attention`` with ``is_causal=True`` and no mask. While a stream captures it
cannot look, so it builds the causal mask as a tensor (transformers 5.17 for every call; later versions when an
``attention_mask`` is passed), and a masked attention skips no blocks: cuDNN's attention kernels of a small Llama
step run several times slower in the replays (docs/performance.md). ``assume_causal_attention=True`` records those calls
as the eager warm-up step made them (``is_causal=True``, no mask): right only while no batch packs sequences or
pads on the left (right padding is exact: causal attention never reads later positions). Without it, a recording
that saw such masks says so once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..utils.cast_copies import note_replayed_weight_writes
from ..utils import validation
from ..utils.cuda_graphs import (AdapterState, NotGraphable, capture_or_undo, copy_output, describe_call, first_line,
                                 run_on_side_stream, substitute)

logger = logging.getLogger("sits_lora")

# Optimizer settings that change more often than this (a scheduler writing a float learning rate into an optimizer
# that bakes it in) make the step run eagerly: recording at every change costs more than it saves.
_MAX_SETTING_CHANGES = 3


class _AttentionDecisions:
    """The attention calls of an eager step as transformers made them (mask or none, causal or not, query and key
    lengths), in call order; while recording, the calls that were plain causal attention eagerly and now come with
    a mask tensor are counted and, on request, made as the eager step made them (module docstring)."""

    def __init__(self) -> None:
        self.eager: list = []
        self.masked_while_recording = 0
        self.rewritten = 0

    @contextlib.contextmanager
    def _patched(self, call, grouped_query=None):
        real = torch.nn.functional.scaled_dot_product_attention

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
            if torch.compiler.is_compiling():   # a compiled model's attention is its own business
                return real(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)
            return call(real, query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

        with contextlib.ExitStack() as stack:
            torch.nn.functional.scaled_dot_product_attention = sdpa
            stack.callback(setattr, torch.nn.functional, "scaled_dot_product_attention", real)
            if grouped_query is not None:
                stack.enter_context(_transformers_gqa_decision(grouped_query))
            yield

    @staticmethod
    def _decision(query, key, attn_mask, is_causal) -> tuple:
        return attn_mask is None, bool(is_causal), query.shape[-2], key.shape[-2]

    def watching(self):
        """Within: the attention calls are noted (the last eager step's notes are the ones a recording follows)."""
        self.eager = []

        def call(real, query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs):
            self.eager.append(self._decision(query, key, attn_mask, is_causal))
            return real(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

        return self._patched(call)

    def recording(self, rewrite: bool):
        """Within: call i with a mask where the eager step's call i was causal without one, at the same lengths, is
        counted, and with ``rewrite`` made causal without the mask. With ``rewrite``, transformers' choice of grouped
        query attention for such a call is made as for the eager call too: with a mask it copies the key and value
        heads out to the query's count (and sums their gradients back), where the eager call read them in place."""
        self.masked_while_recording = self.rewritten = 0
        index = [0]

        def was_plain_causal(i: int, q_len: int, kv_len: int) -> bool:
            eager = self.eager[i] if i < len(self.eager) else None
            return q_len == kv_len and eager == (True, True, q_len, kv_len)

        def call(real, query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs):
            i = index[0]
            index[0] += 1
            if attn_mask is not None and was_plain_causal(i, query.shape[-2], key.shape[-2]):
                self.masked_while_recording += 1
                if rewrite:
                    self.rewritten += 1
                    attn_mask, is_causal = None, True
            return real(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

        def grouped_query(real, attention_mask, key, *args, **kwargs):
            # asked just before attention call index[0]; the mask's rows are the query's length
            if (torch.is_tensor(attention_mask) and attention_mask.dim() >= 2
                    and was_plain_causal(index[0], attention_mask.shape[-2], key.shape[-2])):
                attention_mask = None
            return real(attention_mask, key, *args, **kwargs)

        return self._patched(call, grouped_query if rewrite else None)


@contextlib.contextmanager
def _transformers_gqa_decision(decide):
    """Within: transformers' ``use_gqa_in_sdpa(attention_mask, key, ...)`` answered by ``decide(real, attention_mask,
    key, ...)``; nothing where this transformers has no such function (older versions repeat the heads always)."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        yield
        return
    real = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if real is None:
        yield
        return
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: decide(real, *args, **kwargs)
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = real


class GraphCaptureError(RuntimeError):
    """A step function could not be recorded as a CUDA graph (a host sync, a data-dependent shape, an optimizer
    that cannot step inside a graph)."""


class GraphedTrainStep:
    """A training step recorded as CUDA graphs and replayed (see the module docstring); made by
    :func:`graph_train_step`. ``replays``, ``eager_calls`` and ``recordings`` count what the calls did."""

    def __init__(self, step_fn: Callable, optimizers: Sequence[torch.optim.Optimizer], model: Optional[nn.Module],
                 warmup: int, max_graphs: int, assume_causal_attention: bool = False) -> None:
        self.step_fn = step_fn
        self.assume_causal_attention = assume_causal_attention
        self._attention = _AttentionDecisions()
        self._attention_warned = False
        self.optimizers = list(optimizers)
        self.model = model
        self._adapter_state = AdapterState(model)   # asked every step: walking the module tree is host time
        self.warmup = warmup
        self.max_graphs = max_graphs
        self._graphs: dict = {}          # signature -> (graph, static inputs, static output), or None: runs eagerly
        self._seen: dict = {}            # signature -> eager calls made so far
        self._eager_reasons: set = set()
        self._full_warned = False
        self._setting_changes = 0
        self._prepare_optimizers()     # before the warm-up steps create the optimizers' state
        self._pool = None
        self.replays = 0
        self.eager_calls = 0
        self.recordings = 0

    # ------------------------------------------------------------------ optimizer settings
    def _optimizer_settings(self) -> dict:
        """{(optimizer, group, key): value} of the settings a recording bakes in: Python numbers, flags and tuples;
        a tensor setting (the learning rate) and the optimizer's state by identity: replays read their values, but a
        new tensor or state dict (``load_state_dict``) is memory the recording does not know."""
        settings = {}
        for i, optimizer in enumerate(self.optimizers):
            settings[(i, "state")] = ("state", id(optimizer.state))
            for j, group in enumerate(optimizer.param_groups):
                for key, value in group.items():
                    if key in ("params", "initial_lr"):
                        continue
                    if isinstance(value, torch.Tensor):
                        value = ("tensor", id(value))
                    if isinstance(value, (bool, int, float, str, tuple, type(None))):
                        settings[(i, j, key)] = value
        return settings

    def _check_settings(self) -> None:
        settings = self._optimizer_settings()
        if settings == self._settings:
            return
        missing = object()
        changed = sorted({k[-1] for k in set(settings) | set(self._settings)
                          if settings.get(k, missing) != self._settings.get(k, missing)})
        self._setting_changes += 1
        self.reset()
        self._prepare_optimizers()   # a loaded state dict turns capturable off and the learning rate into a float
        if self._setting_changes > _MAX_SETTING_CHANGES:
            self._note_eager(f"the optimizer's {', '.join(changed)} changing again and again (it bakes them into "
                             "a recording; torch's Adam and AdamW read a tensor learning rate at each replay)")
            return
        warnings.warn(f"graph_train_step: the optimizer's {', '.join(changed)} changed after the step was recorded; "
                      "recording again (each change costs one recording)", stacklevel=3)

    # ------------------------------------------------------------------ calls
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors: list = []
        try:
            key = (describe_call((args, kwargs), tensors), self._adapter_state(), torch.is_grad_enabled())
        except NotGraphable as reason:
            self._note_eager(str(reason))
            return self._eager(args, kwargs)
        self._check_settings()
        if self._setting_changes > _MAX_SETTING_CHANGES:
            return self._eager(args, kwargs)
        if key not in self._graphs:
            seen = self._seen.get(key, 0)
            if seen < self.warmup:
                self._seen[key] = seen + 1
                return self._warmup(args, kwargs)
            if len(self._graphs) >= self.max_graphs:
                if not self._full_warned:
                    self._full_warned = True
                    warnings.warn(
                        f"graph_train_step: {len(self._graphs)} recordings already (max_graphs={self.max_graphs}); "
                        "calls with another input signature (shapes, dtypes, Python values, adapter state) run "
                        "eagerly. A Python number that changes every call makes a new signature each call: pass it "
                        "as a tensor.", stacklevel=2)
                return self._eager(args, kwargs)
            self._graphs[key] = self._record(args, kwargs, tensors)
        entry = self._graphs[key]
        if entry is None:
            return self._eager(args, kwargs)
        graph, static_inputs, static_output = entry
        for static, given in zip(static_inputs, tensors):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        graph.replay()
        note_replayed_weight_writes()   # the recorded optimizer step moved no version counter
        self.replays += 1
        return copy_output(static_output)

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        self.eager_calls += 1
        return self.step_fn(*args, **kwargs)

    def _warmup(self, args: tuple, kwargs: dict) -> Any:
        """One step as written, on a side stream ordered with the current one both ways, as PyTorch asks of the
        calls before a recording (lazy initialization then happens off the stream a graph records)."""
        self.eager_calls += 1
        with self._attention.watching():
            return run_on_side_stream(self.step_fn, args, kwargs)

    def _record(self, args: tuple, kwargs: dict, tensors: list):
        """(graph, static inputs, static output) of this signature: the call recorded (nothing runs while recording)."""
        static_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        static_args, static_kwargs = substitute((args, kwargs), iter(static_inputs))
        # the warm-up steps left their activations' blocks cached; free them so the recording's own pool can
        # take that memory (a recording holds one step's activations for as long as it lives)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            # one memory pool for every recording of this step: they replay one at a time, and each copies its
            # outputs out, so a second input signature does not hold a second step's activations. A new pool after
            # reset() or a failed recording: a pool whose recordings are gone may still hold blocks, and torch
            # refuses to record into it again
            self._pool = torch.cuda.graph_pool_handle()
        before = self._python_state()
        try:
            with self._attention.recording(rewrite=self.assume_causal_attention), capture_or_undo(graph, self._pool):
                static_output = self.step_fn(*static_args, **static_kwargs)
            copy_output(static_output)
        except NotGraphable as reason:
            self._restore_python_state(before)
            self._pool = None
            self._note_eager(str(reason))
            return None
        except Exception as error:   # noqa: BLE001 (re-raised with the fix)
            self._restore_python_state(before)
            self._pool = None
            site = _failure_site(error)
            raise GraphCaptureError(
                f"graph_train_step: the step function could not be recorded as a CUDA graph ({first_line(error)})"
                f"{f', at {site}' if site else ''}. Nothing of this step was applied. A recorded step may not wait "
                "for the GPU: remove .item(), .cpu(), printing or comparing CUDA tensors in Python, and ops whose "
                "output shape depends on values (torch.nonzero, boolean indexing) from the step, or call the step "
                "function directly (eagerly)." + _known_sync_hint(site)
            ) from error
        self.recordings += 1
        self._note_attention()
        return graph, static_inputs, static_output

    def _python_state(self) -> tuple:
        """What a recording changes on the Python side that a failed one must undo: each parameter's ``.grad`` (a
        backward inside the capture assigns tensors of the recording's pool, never written: a later eager step
        would add to garbage) and the optimizers' per-parameter state (state created inside the capture holds
        the same unwritten memory)."""
        params = [p for o in self.optimizers for group in o.param_groups for p in group["params"]]
        if self.model is not None:
            params += [p for p in self.model.parameters() if p.requires_grad]
        return ([(p, p.grad) for p in params], [(o, set(o.state.keys())) for o in self.optimizers])

    @staticmethod
    def _restore_python_state(before: tuple) -> None:
        grads, states = before
        for p, grad in grads:
            p.grad = grad
        for optimizer, keys in states:
            for key in [k for k in optimizer.state if k not in keys]:
                del optimizer.state[key]
        torch.cuda.empty_cache()   # the failed recording's pool, released by ``capture_or_undo``

    def _note_attention(self) -> None:
        masked, rewritten = self._attention.masked_while_recording, self._attention.rewritten
        if rewritten:
            logger.info("graph_train_step: %d attention calls recorded causal without a mask, as the eager step made "
                        "them (assume_causal_attention=True)", rewritten)
        elif masked and not self._attention_warned:
            self._attention_warned = True
            logger.warning(
                "graph_train_step: %d attention calls got a mask tensor while recording where the eager step used "
                "is_causal=True without one (transformers cannot look at the batch while a stream captures); masked "
                "attention skips no blocks and runs several times slower. If no batch packs sequences or pads on "
                "the left, pass assume_causal_attention=True to graph_train_step.", masked)

    def _prepare_optimizers(self) -> None:
        """Make every group steppable inside a graph: ``capturable`` on (Adam, AdamW and the other optimizers that
        have it), and a float learning rate a 0-dim tensor on the parameters' device where the optimizer takes one,
        so that a scheduler's in-place writes reach the replays."""
        for optimizer in self.optimizers:
            # a group may be empty (the Trainer's no-decay group under LoRA): its rate is a tensor all the same, or
            # the scheduler's float writes to it would read as a setting changed at every step
            device = next((p.device for group in optimizer.param_groups for p in group["params"]), None)
            for group in optimizer.param_groups:
                if "capturable" in group and not group["capturable"]:
                    group["capturable"] = True
                    # an optimizer that stepped without it (or loaded a state dict) counts steps on the CPU; a
                    # capturable step reads them on the parameter's device
                    for p in group["params"]:
                        state = optimizer.state.get(p, {})
                        if isinstance(state.get("step"), torch.Tensor) and state["step"].device != p.device:
                            state["step"] = state["step"].to(p.device, torch.float32)
                lr = group.get("lr")
                if isinstance(lr, torch.Tensor) and device is not None and lr.device != device:
                    lr = float(lr)   # a state dict loaded onto the CPU (the Trainer's resume) brings a CPU tensor
                if (isinstance(lr, float) and device is not None and device.type == "cuda"
                        and group.get("capturable", False) and _takes_tensor_lr(optimizer)):
                    group["lr"] = torch.tensor(lr, dtype=torch.float32, device=device)
        self._settings = self._optimizer_settings()

    def _note_eager(self, reason: str) -> None:
        if reason not in self._eager_reasons:   # once per reason: a training loop makes this call every step
            self._eager_reasons.add(reason)
            logger.warning("graph_train_step: a call with %s runs eagerly (not recorded)", reason)

    def reset(self) -> None:
        """Drop every recording (after a parameter was replaced by a new tensor); the next call records again
        (after no further warm-up: the optimizer's state exists)."""
        self._graphs.clear()
        self._pool = None
        self._seen = {key: self.warmup for key in self._seen}
        self._full_warned = False


def _takes_tensor_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this optimizer steps with a tensor learning rate inside a graph (torch's Adam and AdamW, fused or
    capturable; the others bake a float in)."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def _failure_site(error: BaseException) -> str:
    """Where a failed recording stopped, as "package/module/file.py:line in function": the innermost frame outside
    torch's own package (a sync inside torch's Python, such as a check in clip_grad_norm_, names its caller)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(torch_dir)]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{'/'.join(frame.filename.replace(os.sep, '/').split('/')[-3:])}:{frame.lineno} in {frame.name}"


def _known_sync_hint(site: str) -> str:
    if "liger_kernel/" in site and "cross_entropy" in site:
        return (" Liger-Kernel's (fused linear) cross-entropy counts the labelled tokens with .item(): for a recorded "
                "step apply Liger with fused_linear_cross_entropy=False (e.g. apply_liger_kernel_to_llama("
                "fused_linear_cross_entropy=False)); transformers' own loss records.")
    return ""


def graph_train_step(step_fn: Callable,
                     optimizer: Union[None, torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                     model: Optional[nn.Module] = None, warmup: int = 2, max_graphs: int = 2,
                     assume_causal_attention: bool = False) -> GraphedTrainStep:
    """``step_fn`` (one whole training step on CUDA tensor arguments) recorded as a CUDA graph per input signature
    after ``warmup`` eager calls, and replayed (module docstring). ``optimizer``: the optimizer(s) ``step_fn``
    steps, made steppable inside a graph here (None: it steps none, e.g. forward + backward only). ``model``: the
    trained model, whose adapter state and train / eval mode become part of the signature. At most ``max_graphs``
    recordings (each holds one step's activations). ``assume_causal_attention``: record the attention calls that
    the last eager step made with ``is_causal=True`` and no mask that way, though transformers hands them a mask
    tensor while recording (module docstring: only for batches that never pack sequences nor pad on the left)."""
    if not callable(step_fn):
        raise TypeError(f"graph_train_step: step_fn must be callable, got {type(step_fn).__name__}")
    if optimizer is None:
        optimizers = []
    else:
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("graph_train_step: optimizer must be the torch.optim.Optimizer the step function steps "
                            f"(a list of them, or None), got {optimizer!r}")
    validation.check_arguments("graph_train_step", warmup=(warmup, validation.positive_int()),
                               max_graphs=(max_graphs, validation.positive_int()))
    if not isinstance(assume_causal_attention, bool):
        raise TypeError("graph_train_step: assume_causal_attention must be True or False, got "
                        f"{assume_causal_attention!r}")
    if not torch.cuda.is_available():
        raise ValueError("graph_train_step records CUDA graphs, and this machine has no CUDA GPU: call the step "
                         "function directly")
    params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    elsewhere = sorted({str(p.device) for p in params if not p.is_cuda})
    if elsewhere:
        raise ValueError(f"graph_train_step records CUDA graphs: the optimizer holds parameters on "
                         f"{', '.join(elsewhere)}; move the model to a GPU (model.to('cuda')) before building the "
                         "optimizer")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"graph_train_step: model must be the nn.Module being trained, got {type(model).__name__}")
    return GraphedTrainStep(step_fn, optimizers, model, warmup, max_graphs, assume_causal_attention)


__all__ = ["GraphCaptureError", "GraphedTrainStep", "NotGraphable", "graph_train_step"]
