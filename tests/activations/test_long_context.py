"""What long-context training stands on: the MLP run in tiles (sits_lora.activations.tiled_mlp) and saved
tensors kept on the host (sits_lora.activations.offload), each against the plain step on the CPU."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from peft import get_peft_model
from torch.utils.checkpoint import checkpoint

from sits_lora import SitsLoraConfig
from sits_lora.activations import (enable_offloaded_checkpointing, input_recompute_report, offload_saved_tensors,
                                   tile_mlp, untile_mlp)
from sits_lora.activations.offload import _Offloaded, offloads_checkpoints

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _peft(model, dropout: float = 0.0):
    torch.manual_seed(1)
    return get_peft_model(copy.deepcopy(model), SitsLoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, kernel="torch", init_lora_weights=False, lora_dropout=dropout))


def _step(model, ids, seed: int = 2) -> tuple[float, dict]:
    model.train()
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss), grads


def _assert_same(expected: tuple, actual: tuple, **tolerance) -> None:
    assert expected[1].keys() == actual[1].keys() and expected[1]
    assert actual[0] == pytest.approx(expected[0], rel=1e-6)
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], msg=name, **tolerance)


# ----------------------------------------------------------------------------- tiled MLP


@pytest.mark.parametrize("tokens,tile", [(2 * 37, 16), (2 * 37, 37), (2 * 37, 73)])
def test_tiled_mlp_gives_the_plain_gradients(tokens, tile):
    """Odd tiles (the last one short), a tile equal to a sequence, and one just under the batch's tokens."""
    base = _llama()
    ids = torch.randint(0, 97, (2, tokens // 2), generator=torch.Generator().manual_seed(3))
    expected = _step(_peft(base), ids)
    model = _peft(base)
    assert tile_mlp(model, tile_tokens=tile) == 2
    actual = _step(model, ids)
    _assert_same(expected, actual, rtol=1e-5, atol=1e-6)
    # every MLP ran tiled, and its input is what it kept
    assert all(m.forward.calls == 1 for m in model.modules() if type(vars(m).get("forward")).__name__ == "TiledForward")


def test_tiled_mlp_at_or_below_one_tile_runs_the_plain_mlp():
    model = _peft(_llama())
    tile_mlp(model, tile_tokens=64)
    ids = torch.randint(0, 97, (2, 32))
    _step(model, ids)
    tiled = [vars(m)["forward"] for m in model.modules() if type(vars(m).get("forward")).__name__ == "TiledForward"]
    assert len(tiled) == 2 and all(t.calls == 0 for t in tiled)


def test_tiled_mlp_recompute_draws_the_forward_dropout_masks():
    """With LoRA dropout, the tiles recomputed in backward must see the masks forward drew: the gradients equal
    those of the same tiles run with autograd on in forward (torch.manual_seed fixes both runs' draws)."""
    from sits_lora.activations import tiled_mlp as tiled_module

    base = _llama()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    model = _peft(base, dropout=0.3)
    tile_mlp(model, tile_tokens=10)
    actual = _step(model, ids, seed=5)

    reference = _peft(base, dropout=0.3)
    tile_mlp(reference, tile_tokens=10)
    # the same tiles without the recompute: forward keeps everything, backward is plain autograd
    original = tiled_module._TiledMLPFunction.apply
    try:
        tiled_module._TiledMLPFunction.apply = staticmethod(
            lambda forward, tile, x, *params: tiled_module._tiled(forward, x, tile))
        expected = _step(reference, ids, seed=5)
    finally:
        tiled_module._TiledMLPFunction.apply = original
    _assert_same(expected, actual, rtol=1e-5, atol=1e-6)


def test_untile_mlp_restores_the_forward_and_bad_tile_is_named():
    model = _peft(_llama())
    with pytest.raises(ValueError, match="tile_tokens=0"):
        tile_mlp(model, tile_tokens=0)
    tile_mlp(model, tile_tokens=8)
    untile_mlp(model)
    assert not any(type(vars(m).get("forward")).__name__ == "TiledForward" for m in model.modules())
    with pytest.raises(ValueError, match="no decoder layers"):
        tile_mlp(torch.nn.Linear(3, 3))


# ----------------------------------------------------------------------------- offload


def _spied(hooks, packed: list, record=lambda packed_value: packed_value):
    """``hooks`` with its pack hook also appending ``record(what it packed)`` to ``packed``."""
    pack = hooks.pack_hook

    def spy(t):
        out = pack(t)
        packed.append(record(out))
        return out

    hooks.pack_hook = spy
    return hooks



def test_offloaded_saved_tensors_round_trip_with_prefetch():
    """Every saved tensor above min_bytes goes to a host copy and comes back; the handles chain in save order
    and unpacking one starts the copy of the one saved before it."""
    w = [torch.randn(64, 64, requires_grad=True) for _ in range(4)]
    x = torch.randn(8, 64, requires_grad=True)
    packed = []
    hooks = _spied(offload_saved_tensors(min_bytes=1024, device_types=("cpu",)), packed)
    with hooks:
        h = x
        for weight in w:
            h = torch.tanh(h @ weight)
    loss = h.square().sum()
    handles = list({id(p): p for p in packed if isinstance(p, _Offloaded)}.values())  # a tensor saved twice: once
    assert len(handles) >= 4 and all(isinstance(p, (_Offloaded, torch.Tensor)) for p in packed)
    # the chain: each handle points to the one packed before it
    for earlier, later in zip(handles, handles[1:]):
        assert later.previous() is earlier
    assert all(handle.back is None for handle in handles)  # nothing fetched back before backward
    loss.backward()
    expected = [weight.grad.clone() for weight in w] + [x.grad.clone()]
    for t in w + [x]:
        t.grad = None
    h = x
    for weight in w:
        h = torch.tanh(h @ weight)
    h.square().sum().backward()
    for got, want in zip(expected, [weight.grad for weight in w] + [x.grad]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_host_copies_are_pieces_of_power_of_two_bytes():
    """The caching host allocator rounds every pinned block up to a power of two: a copy made of such pieces (and
    one last piece under a MiB) takes what the tensor weighs."""
    from sits_lora.activations.offload import _piece_sizes

    sizes = _piece_sizes(3_276_800 * 1024, 2)  # 6.25 GiB of bf16
    assert [s * 2 for s in sizes] == [4 << 30, 2 << 30, 256 << 20]
    sizes = _piece_sizes(3000 * 1024 + 5, 4)
    assert sum(sizes) == 3000 * 1024 + 5 and all((s * 4) & (s * 4 - 1) == 0 for s in sizes[:-1])
    assert sizes[-1] * 4 < 1 << 20
    x = torch.randn(3000, 1024 + 1, requires_grad=True)  # 12 MB: several pieces
    hooks = offload_saved_tensors(min_bytes=0, device_types=("cpu",))
    with hooks:
        y = x.exp()
    y.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().exp(), rtol=0, atol=0)


def test_parameters_stay_and_views_of_one_tensor_go_once():
    """A parameter (or its transpose) is alive anyway: not copied. Views of one live tensor with the same layout (each
    layer's unsqueezed RoPE table) share one host copy."""
    weight = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    table = torch.randn(8, 16)
    x = torch.randn(8, 16, requires_grad=True)
    packed = []
    hooks = _spied(offload_saved_tensors(min_bytes=0, device_types=("cpu",)), packed)
    with hooks:
        y = (x @ weight.t()) * table.unsqueeze(0)
        y = y * table.unsqueeze(0)
    assert any(p is weight or (isinstance(p, torch.Tensor) and p._base is weight) for p in packed)
    copies = [p for p in packed if isinstance(p, _Offloaded)]
    assert len(copies) >= 2 and len({id(p) for p in copies}) < len(copies)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (table * table) @ weight)


def test_one_chain_prefetches_across_hooks_objects():
    """Layers offloaded by separate hooks objects share one chain: in backward, unpacking one layer's tensor starts
    the copy of the layer below it."""
    from sits_lora.activations.offload import _Chain

    chain, packed = _Chain(), []
    x = torch.randn(32, 32, requires_grad=True)
    h = x * 1
    for _ in range(3):  # three "layers", each under its own hooks object
        hooks = _spied(offload_saved_tensors(min_bytes=0, device_types=("cpu",), chain=chain), packed)
        with hooks:
            h = torch.tanh(h)
    handles = [p for p in packed if isinstance(p, _Offloaded)]
    assert len(handles) == 3 and handles[2].previous() is handles[1] and handles[1].previous() is handles[0]
    # unpacking the top layer's tensor (what backward does first) fetches the next one down ahead of time
    torch.testing.assert_close(hooks.unpack_hook(handles[2]), torch.tanh(torch.tanh(torch.tanh(x.detach()))))
    assert handles[1].back is not None and handles[0].back is None
    hooks.unpack_hook(handles[1])
    assert handles[1].taken and handles[0].back is not None
    # unpacking the top one again (a second backward) does not fetch the one below again: it was taken
    hooks.unpack_hook(handles[2])
    assert handles[1].back is None
    h.sum().backward()
    assert x.grad is not None


def test_tiled_mlp_returns_the_parameter_gradients_once():
    """The adapters' gradients come out of the tiled op's backward (torch.autograd.grad sees them) and are accumulated
    once per step (DDP's and ZeRO's gradient hooks count on that)."""
    base = _llama()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(9))
    model = _peft(base)
    tile_mlp(model, tile_tokens=8)
    params = [p for n, p in model.named_parameters() if p.requires_grad and ".mlp." in n]
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    loss.backward()
    assert len(fired) == len(params)


def test_one_tensor_saved_twice_goes_to_the_host_once():
    shared = torch.randn(32, 32)
    x = torch.randn(32, 32, requires_grad=True)
    packed = []
    hooks = _spied(offload_saved_tensors(min_bytes=0, device_types=("cpu",)), packed)
    with hooks:
        y = (x * shared) * shared
    # each multiply saves `shared` (x's gradient needs it): two saves, one host copy
    assert len(packed) == 2 and all(isinstance(p, _Offloaded) for p in packed) and packed[0] is packed[1]
    y.sum().backward()
    torch.testing.assert_close(x.grad, shared * shared)


def test_offload_min_bytes_is_checked():
    with pytest.raises(ValueError, match="min_bytes=-1"):
        offload_saved_tensors(min_bytes=-1)


def test_checkpoint_with_offloaded_inputs_keeps_the_gradients():
    """Non-reentrant checkpointing under the offload hooks, on the CPU (host copies of host tensors): the same
    gradients as no checkpointing. Under offload hooks alone the LoRA layers save their inputs (to the host): finding
    a rebuild would unpack what the hooks packed, bringing it back to the device in forward."""
    base = _llama()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(6))
    expected = _step(_peft(base), ids)

    model = _peft(base)
    inner = model.base_model.model
    func = lambda fn, *args, **kw: _offloaded_cpu_checkpoint(fn, *args, **kw)  # noqa: E731
    inner._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    _assert_same(expected, _step(model, ids), rtol=1e-5, atol=1e-6)

    model = _peft(base)
    with offload_saved_tensors(min_bytes=0, device_types=("cpu",)):
        actual = _step(model, ids)
    _assert_same(expected, actual, rtol=1e-5, atol=1e-6)
    assert not any(r["rebuilt"] for r in input_recompute_report(model))


def _offloaded_cpu_checkpoint(function, *args, **kwargs):
    with offload_saved_tensors(min_bytes=0, device_types=("cpu",)):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def test_enable_offloaded_checkpointing_sets_every_layer_and_names_bad_input():
    model = _peft(_llama(3))
    enable_offloaded_checkpointing(model)
    blocks = model.base_model.model.model.layers
    assert all(offloads_checkpoints(b) for b in blocks)
    # on the CPU nothing moves (device tensors only), the step is plain checkpointing
    ids = torch.randint(0, 97, (1, 12))
    loss, grads = _step(model, ids)
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    enable_offloaded_checkpointing(model, keep_on_device=2)
    assert [offloads_checkpoints(b) for b in blocks] == [True, False, False]
    assert all(b.gradient_checkpointing for b in blocks)
    with pytest.raises(ValueError, match="keep_on_device=-1"):
        enable_offloaded_checkpointing(model, keep_on_device=-1)
    with pytest.raises(ValueError, match="every_n_layers=0"):
        enable_offloaded_checkpointing(model, every_n_layers=0)
    with pytest.raises(TypeError, match="not a transformers model"):
        enable_offloaded_checkpointing(torch.nn.Linear(2, 2))


def test_offloaded_handles_die_with_the_graph():
    x = torch.randn(64, 64, requires_grad=True)
    x = x * 1  # not a leaf: a leaf that needs a gradient is not offloaded (its accumulator keeps it anyway)
    packed = []
    hooks = _spied(offload_saved_tensors(min_bytes=0, device_types=("cpu",)), packed, weakref.ref)
    with hooks:
        y = torch.tanh(x @ x)
    y.sum().backward()
    del y
    gc.collect()
    assert packed and all(ref() is None for ref in packed)


# ----------------------------------------------------------------------------- selective checkpointing


def _checkpointed(model, kwargs):
    inner = model.base_model.model
    if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()
    return model


def _attention_runs(model, ids) -> int:
    """How many times an attention kernel computed (allocated its output) in one training step."""
    model.train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(1 for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")
               and not e.name.endswith("_backward")
               and any(c.name in ("aten::empty", "aten::empty_like") for c in e.cpu_children))


def test_selective_checkpointing_keeps_attention_and_the_gradients():
    from sits_lora.activations import selective_checkpointing_kwargs
    from sits_lora.activations.selective import is_selective

    base = _llama()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(7))
    expected = _step(_peft(base), ids)
    full = _checkpointed(_peft(base), {"use_reentrant": False})
    selective = _checkpointed(_peft(base), selective_checkpointing_kwargs())
    assert all(is_selective(b) for b in selective.base_model.model.model.layers)
    assert not any(is_selective(b) for b in full.base_model.model.model.layers)
    _assert_same(expected, _step(selective, ids), rtol=0, atol=0)
    # plain checkpointing runs attention again in backward; the selective policy replays its kept output
    assert _attention_runs(full, ids) == 2 * 2 and _attention_runs(selective, ids) == 2


# ----------------------------------------------------------------------------- per-layer offload


def test_layer_offload_round_trip_keeps_rebuilt_inputs_and_the_gradients():
    from sits_lora.activations import disable_activation_offload, enable_activation_offload
    from sits_lora.activations.offload import offloads_activations

    base = _llama(3)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(8))
    expected = _step(_peft(base), ids)
    model = _peft(base)
    assert enable_activation_offload(model, [2, 0], min_bytes=0, device_types=("cpu",)) == [0, 2]
    blocks = model.base_model.model.model.layers
    assert [offloads_activations(b) for b in blocks] == [True, False, True]
    _assert_same(expected, _step(model, ids), rtol=0, atol=0)
    # the offloaded layers save their LoRA inputs (to the host); the others rebuild theirs
    rebuilt = {r["layer"].split("layers.")[1].split(".")[0] for r in input_recompute_report(model) if r["rebuilt"]}
    assert rebuilt == {"1"}
    with pytest.raises(ValueError, match=r"layers=\[3\] are out of range"):
        enable_activation_offload(model, [3])
    disable_activation_offload(model)
    assert not any(offloads_activations(b) for b in blocks)


def test_choose_offloaded_layers_hides_the_copies_behind_the_forward():
    from sits_lora.training import choose_offloaded_layers

    model = _peft(_llama(4))
    fast = choose_offloaded_layers(model, 2, 64, pinned_bandwidth=1e15, matmul_flops=1e12)
    assert fast["layers"] == [0, 1, 2, 3] and fast["copy_seconds_per_layer"] <= fast["forward_seconds_per_layer"]
    # a copy twice as long as a layer's forward: half the layers, the first ones
    ratio = fast["forward_seconds_per_layer"] / fast["saved_bytes_per_layer"]
    half = choose_offloaded_layers(model, 2, 64, pinned_bandwidth=1 / (2 * ratio) * 1.0001, matmul_flops=1e12)
    assert half["layers"] == [0, 1]
    with pytest.raises(ValueError, match="pinned_bandwidth=0"):
        choose_offloaded_layers(model, 2, 64, pinned_bandwidth=0, matmul_flops=1e12)
