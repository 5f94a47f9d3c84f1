"""The MLP of a decoder layer run over the sequence in tiles, keeping only its input for backward.

A gated MLP keeps gate and up (T x I each, I about 3.5 h) for its backward, and its backward holds a few
more T x I gradients at once: at long context the MLP of one layer outweighs everything else the layer
keeps, and under gradient checkpointing it is what one layer's recompute costs. The MLP is token-wise,
so it can run ``tile_tokens`` tokens at a time: forward under no_grad keeping nothing but its input
(T x h), backward recomputing one tile with autograd on and back-propagating it before the next. The
parameters' gradients (the LoRA adapters of gate/up/down) are summed over the tiles and returned by the
op's backward, like any op's; the values are those of the untiled MLP up to the summation order of dA and dB.

Below ``tile_tokens`` tokens the MLP runs as it is. Under torch.compile it runs as it is too (the
compiler decides what to keep).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from ..utils.model_structure import decoder_layers, restore_forwards, unwrap_model
from ..utils import validation

DEFAULT_TILE_TOKENS = 8192


def _tiled(forward, x: Tensor, tile: int) -> Tensor:
    flat = x.reshape(-1, x.shape[-1])
    first = forward(flat[:tile])
    out = first.new_empty((flat.shape[0], first.shape[-1]))
    out[:tile] = first
    for start in range(tile, flat.shape[0], tile):
        out[start:start + tile] = forward(flat[start:start + tile])
    return out.view(*x.shape[:-1], first.shape[-1])


class _RngState:
    """The RNG states a forward ran under, so that the recompute draws the same dropout masks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restored(self):
        devices = [self.device] if self.cuda is not None else []
        fork = torch.random.fork_rng(devices=devices)

        class _Restore:
            def __enter__(_self):
                fork.__enter__()
                torch.set_rng_state(self.cpu)
                if self.cuda is not None:
                    torch.cuda.set_rng_state(self.cuda, self.device)

            def __exit__(_self, *exc):
                return fork.__exit__(*exc)

        return _Restore()


class _TiledMLPFunction(torch.autograd.Function):
    """forward(forward_fn, tile, x, *params): the parameters that need gradients are inputs, and backward returns
    their gradients (summed over the tiles), so that autograd accumulates them once, as for any op (DDP's and
    ZeRO's gradient hooks fire once per step)."""

    @staticmethod
    def forward(ctx, forward, tile: int, x: Tensor, *params: Tensor) -> Tensor:
        ctx.forward, ctx.tile = forward, tile
        ctx.rng = _RngState(x.device)
        device_type = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return _tiled(forward, x, tile)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, *params = ctx.saved_tensors
        flat_x = x.reshape(-1, x.shape[-1])
        flat_dy = dy.reshape(-1, dy.shape[-1])
        want_dx = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        dx = torch.empty_like(flat_x) if want_dx else None
        sums: list = [None] * len(wanted)
        enabled, dtype = ctx.autocast
        # tiles in forward order under the forward's RNG state: each tile draws the masks it drew then
        with ctx.rng.restored(), torch.enable_grad(), torch.autocast(x.device.type, enabled=enabled, dtype=dtype):
            for start in range(0, flat_x.shape[0], ctx.tile):
                tile_x = flat_x[start:start + ctx.tile].detach().requires_grad_(want_dx)
                tile_y = ctx.forward(tile_x)
                inputs = ([tile_x] if want_dx else []) + wanted
                if not tile_y.requires_grad or not inputs:
                    continue
                grads = torch.autograd.grad(tile_y, inputs, flat_dy[start:start + ctx.tile], allow_unused=True)
                if want_dx:
                    dx[start:start + ctx.tile] = grads[0]
                    grads = grads[1:]
                sums = [g if s is None else (s if g is None else s.add_(g)) for s, g in zip(sums, grads)]
        param_grads = iter(sums)
        out = [next(param_grads) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, dx.view_as(x) if want_dx else None, *out)


class TiledForward:
    """Set as an MLP module's ``forward``: the module's own forward, in tiles at long sequences."""

    def __init__(self, module: nn.Module, tile_tokens: int) -> None:
        # the module holds this object in its __dict__: a strong reference back would be a cycle only the garbage
        # collector frees
        self._module = weakref.ref(module)
        self.tile_tokens = tile_tokens
        self.original = vars(module).get("forward")  # an instance forward (Liger patches loaded models so)
        self.calls = 0  # forwards that ran tiled

    @property
    def module(self) -> nn.Module:
        return self._module()

    def plain_forward(self, x: Tensor) -> Tensor:
        if self.original is not None:
            return self.original(x)
        module = self.module
        return type(module).forward(module, x)

    def __call__(self, x: Tensor, *args, **kwargs) -> Tensor:
        if args or kwargs:  # not the one-tensor MLP call this tiles
            forward = self.original or type(self.module).forward.__get__(self.module)
            return forward(x, *args, **kwargs)
        if torch.compiler.is_compiling() or x.dim() < 2 or x.numel() // x.shape[-1] <= self.tile_tokens:
            return self.plain_forward(x)
        self.calls += 1
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or (not x.requires_grad and not params):
            return _tiled(self.plain_forward, x, self.tile_tokens)
        return _TiledMLPFunction.apply(self.plain_forward, self.tile_tokens, x, *params)


def tile_mlp(model: nn.Module, tile_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Run the MLP of every decoder layer of ``model`` in tiles of ``tile_tokens`` tokens when a batch holds more
    (see the module docstring). Returns how many MLPs were tiled; undo with :func:`untile_mlp`."""
    validation.check_arguments("tile_mlp", tile_tokens=(tile_tokens, validation.positive_int(
        f" (tokens per tile; {DEFAULT_TILE_TOKENS} keeps a tile's T x I tensors under a GiB on 8B shapes)")))
    _, blocks = decoder_layers(unwrap_model(model))
    count = 0
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if not isinstance(mlp, nn.Module):
            continue
        current = vars(mlp).get("forward")
        if isinstance(current, TiledForward):
            current.tile_tokens = tile_tokens
        else:
            mlp.forward = TiledForward(mlp, tile_tokens)
        count += 1
    if not count:
        raise ValueError(f"tile_mlp: {type(model).__name__} has no decoder layers with an `mlp` module to tile.")
    return count


def untile_mlp(model: nn.Module) -> None:
    """Undo :func:`tile_mlp`."""
    restore_forwards(model, TiledForward)


def mlp_tile_tokens(mlp: nn.Module):
    """The tile size of a tiled MLP, or None when it runs untiled."""
    current = vars(mlp).get("forward")
    return current.tile_tokens if isinstance(current, TiledForward) else None
