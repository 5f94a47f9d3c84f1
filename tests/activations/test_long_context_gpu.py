"""Long-context training on the GPU: checkpointed layer inputs in pinned host memory (side-stream copies, fetched
back one layer ahead) and the MLP in tiles, in bf16 on a moderate Llama: the gradients of the plain step, and
the device memory that forward leaves for backward lower by what moved to the host or was not kept."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from peft import get_peft_model  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.activations import enable_offloaded_checkpointing, offload_saved_tensors, tile_mlp  # noqa: E402
from sits_lora.activations.offload import _Offloaded  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HIDDEN, INTER, LAYERS, SEQ = 1024, 4096, 4, 8192


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=SEQ)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    torch.manual_seed(1)
    return get_peft_model(base, SitsLoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False))


def _plain_checkpointing(model):
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


def _step(model, ids):
    """(loss, gradients, bytes held once forward is done, peak bytes), above the memory in use before."""
    model.train()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss), grads, held, peak


def _same_grads(expected, actual, rtol=1e-2, atol=1e-3):
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=name)


def test_offloaded_checkpoints_hold_no_layer_input_on_the_device():
    ids = torch.randint(0, 4096, (1, SEQ), device="cuda")
    base = _model()
    plain = _plain_checkpointing(copy.deepcopy(base))
    _step(plain, ids)
    loss, grads, held, peak = _step(plain, ids)
    del plain
    offloaded = enable_offloaded_checkpointing(copy.deepcopy(base))
    _step(offloaded, ids)
    loss_o, grads_o, held_o, peak_o = _step(offloaded, ids)
    # the copies are exact: the forward is plain checkpointing's (flash attention's backward accumulates in
    # a nondeterministic order, so the gradients are compared within bf16 tolerance)
    assert loss_o == loss
    _same_grads(grads, grads_o)
    # each checkpointed layer's bf16 input (SEQ x HIDDEN) waits on the host instead, but the first: the embeddings'
    # output, which its gradient accumulator keeps on the device (enable_input_require_grads)
    assert held - held_o >= 0.95 * (LAYERS - 1) * SEQ * HIDDEN * 2, (held, held_o)
    # backward brings one input back ahead of its layer: the peak is no higher than plain checkpointing's
    assert peak_o <= peak, (peak, peak_o)


def test_offloaded_saved_tensors_are_pinned_copies_made_on_a_side_stream():
    x = torch.randn(3000, 1024, device="cuda", requires_grad=True)  # 12 MB: pieces of 8, 2, 1 MiB and the rest
    w = torch.randn(1024, 1024, device="cuda")
    packed = []
    hooks = offload_saved_tensors(min_bytes=0)
    pack = hooks.pack_hook
    hooks.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
    with hooks:
        y = torch.tanh(x @ w)
    handles = [p for p in packed if isinstance(p, _Offloaded)]
    assert handles and all(piece.is_pinned() for h in handles for piece in h.pieces)
    # the pinned pieces take what the tensor weighs, not its size rounded up to a power of two
    assert all(h.host_bytes <= h.nbytes + (1 << 20) for h in handles)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (1 - torch.tanh(x.detach() @ w) ** 2) @ w.T, rtol=1e-4, atol=1e-4)


def test_tiled_mlp_keeps_its_input_alone_and_the_gradients():
    ids = torch.randint(0, 4096, (1, SEQ), device="cuda")
    base = _model()
    plain = copy.deepcopy(base)
    _step(plain, ids)
    loss, grads, held, _ = _step(plain, ids)
    del plain
    tiled = copy.deepcopy(base)
    tile_mlp(tiled, tile_tokens=2048)
    _step(tiled, ids)
    loss_t, grads_t, held_t, _ = _step(tiled, ids)
    assert loss_t == pytest.approx(loss, rel=1e-3)
    _same_grads(grads, grads_t)
    # an untiled MLP keeps gate, up and act(gate) (SEQ x INTER each, bf16); tiled, its SEQ x HIDDEN input
    assert held - held_t >= 0.9 * LAYERS * SEQ * (2 * INTER - HIDDEN) * 2, (held, held_t)
