"""Rebuilt LoRA inputs on the GPU: bf16, the fused kernels, with and without Liger-Kernel, in a Llama of
moderate size: the same gradients as saving the inputs, and the peak memory lower by what they weighed."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from peft import get_peft_model  # noqa: E402

from sits_lora import SitsLoraConfig  # noqa: E402
from sits_lora.activations import input_recompute_report  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HIDDEN, INTER, LAYERS, BATCH, SEQ = 1024, 4096, 4, 2, 1024


@pytest.fixture
def liger_patch_undone(monkeypatch):
    """Liger's patch replaces transformers' Llama classes and functions module-wide: undone after the test, or
    every later test of the process would build Liger models (and compile Liger's RoPE, a graph break)."""
    from transformers.models.llama import modeling_llama

    for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)


def _model(liger: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=SEQ)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    if liger:
        liger_kernel = pytest.importorskip("liger_kernel.transformers")
        liger_kernel.apply_liger_kernel_to_llama(model=model)
    return model


def _step(model, ids) -> tuple[dict, int, int]:
    """(gradients, bytes held for backward once forward is done, peak bytes of the step), both above the
    memory in use before the step."""
    model.train()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    held = torch.cuda.memory_allocated() - start
    loss.backward()
    del loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, held, peak


def _o_proj_input_is_a_copy(model, ids) -> bool:
    """Whether o_proj reads a copy of the attention output (a clone between attention and o_proj), or a view of
    the tensor attention keeps for its own backward (flash attention writes (batch, seq, heads, dim) and the
    transpose back to that order is free)."""
    seen = []

    def look(module, args):
        node = args[0].grad_fn
        while node is not None and not type(node).__name__.startswith("ScaledDotProduct"):
            seen.append(type(node).__name__)
            node = node.next_functions[0][0] if node.next_functions else None

    handle = model.base_model.model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(look)
    try:
        model(input_ids=ids, labels=ids)
    finally:
        handle.remove()
    return "CloneBackward0" in seen


@pytest.mark.parametrize("liger", [False, True], ids=["hf", "liger"])
def test_rebuilt_inputs_save_their_memory_and_change_no_gradient(liger, liger_patch_undone):
    base = _model(liger)
    ids = torch.randint(0, 4096, (BATCH, SEQ), device="cuda")
    results = {}
    for recompute in (False, True):
        torch.manual_seed(1)
        model = get_peft_model(copy.deepcopy(base), SitsLoraConfig(
            r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False, recompute_lora_inputs=recompute))
        _step(model, ids)  # warm-up: kernels compiled, allocator settled
        if not recompute:
            o_proj_copies = _o_proj_input_is_a_copy(model, ids)
        results[recompute] = _step(model, ids)
        if recompute:
            rows = input_recompute_report(model)
            rebuilt = {r["layer"].split("model.layers.")[-1] for r in rows if r["rebuilt"]}
            # Liger: every adapted layer but the first block's q/k/v (its norm reads the embeddings, which need no
            # grad); transformers' bf16 RMSNorm keeps an fp32 copy of its input, not the input: o_proj and
            # down_proj only
            assert len(rebuilt) == (7 * LAYERS - 3 if liger else 2 * LAYERS), sorted(rebuilt)
        del model
    (saved_grads, saved_held, saved_peak), (rebuilt_grads, rebuilt_held, rebuilt_peak) = results[False], results[True]
    for name, grad in saved_grads.items():
        torch.testing.assert_close(rebuilt_grads[name], grad, rtol=1e-2, atol=1e-3, msg=name)
    tokens, a = BATCH * SEQ, 2
    # the o_proj input weighs only where it is a copy of the attention output (not under flash attention)
    # the down_proj (and o_proj) inputs of every block; with Liger also the q/k/v and gate/up inputs but the first
    # block's q/k/v input
    expected = LAYERS * a * tokens * (INTER + o_proj_copies * HIDDEN) + (liger * (2 * LAYERS - 1) * a * tokens * HIDDEN)
    # what forward leaves for backward is lower by those inputs (give or take the allocator's rounding)
    assert saved_held - rebuilt_held >= 0.95 * expected, (saved_held, rebuilt_held, expected)
    # and the step's peak (in backward, where transient gradients add to it) is not higher
    assert rebuilt_peak <= saved_peak, (saved_peak, rebuilt_peak)
