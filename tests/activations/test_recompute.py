"""The LoRA inputs rebuilt in backward (sits_lora.activations.recompute) against the saved-input path:
the same gradients, and the inputs really freed after forward, on every decoder family that is patched."""

from __future__ import annotations

import copy
import logging
import weakref

import pytest
import torch
from peft import get_peft_model

from sits_lora import SitsLoraConfig
from sits_lora.activations import input_recompute_report
from sits_lora.layers.linear import SitsLoraLinear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _family(name: str, attn: str = "sdpa"):
    """(tiny random model, target module names) of one decoder family."""
    import transformers

    config_cls, model_cls, targets, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", TARGETS, {}),
        "mistral": ("MistralConfig", "MistralForCausalLM", TARGETS, {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TARGETS, {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", TARGETS, {"head_dim": 12}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", TARGETS, {"head_dim": 12}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                 {"pad_token_id": 0}),
    }[name]
    config = getattr(transformers, config_cls)(**SHAPE, **extra)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).float(), targets


def _peft(model, targets, recompute: bool, kernel: str = "torch", dropout: float = 0.0):
    torch.manual_seed(1)
    config = SitsLoraConfig(r=4, lora_alpha=8, target_modules=targets, kernel=kernel, init_lora_weights=False,
                            lora_dropout=dropout, recompute_lora_inputs=recompute)
    return get_peft_model(copy.deepcopy(model), config)


def _grads(model, ids, seed: int = 2) -> dict:
    model.train()
    torch.manual_seed(seed)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(expected: dict, actual: dict, **tolerance) -> None:
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=name, **tolerance)


def _attention_keeps(x) -> bool:
    """Whether x is a view of the output that scaled_dot_product_attention keeps for its own backward (its CPU and
    flash kernels write (batch, seq, heads, dim), so o_proj's input is that tensor transposed back, not a copy)."""
    node = x.grad_fn
    while node is not None and not type(node).__name__.startswith("ScaledDotProduct"):
        node = node.next_functions[0][0] if node.next_functions else None
    out = getattr(node, "_saved_output", None) if node is not None else None
    return out is not None and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _inputs_alive_after_forward(model, ids, count_attention_views: bool = False) -> dict:
    """Per adapted layer: whether its input tensor is still alive once forward has finished (kept for backward).
    An input that is a view of what attention keeps anyway costs nothing and counts as not kept, unless
    ``count_attention_views``."""
    seen, handles = {}, []

    def remember(name):
        def hook(module, args):
            seen.setdefault(name, weakref.ref(args[0]))  # returns None: the input goes on unchanged
        return hook

    for name, module in model.named_modules():
        if isinstance(module, SitsLoraLinear):
            handles.append(module.register_forward_pre_hook(remember(name)))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    for handle in handles:
        handle.remove()
    alive = {name.removeprefix("base_model.model.model."):
             ref() is not None and (count_attention_views or not _attention_keeps(ref())) for name, ref in seen.items()}
    loss.backward()
    return alive


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
def test_same_gradients_and_no_saved_inputs(family):
    base, targets = _family(family)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 11))
    saved, rebuilt = _peft(base, targets, recompute=False), _peft(base, targets, recompute=True)
    # the same ops on the same values: bit-identical
    _assert_same_grads(_grads(saved, ids), _grads(rebuilt, ids), rtol=0, atol=0)

    assert all(_inputs_alive_after_forward(saved, ids, count_attention_views=True).values())
    alive = _inputs_alive_after_forward(rebuilt, ids)
    # the first block's norm reads the embeddings, which need no gradient: that norm keeps nothing, so the
    # layers it feeds save their input; every other adapted layer keeps none
    first_norm_readers = {f"layers.0.self_attn.{t}" for t in targets if t in ("q_proj", "k_proj", "v_proj", "qkv_proj")}
    assert {name for name, kept in alive.items() if kept} == first_norm_readers
    rows = input_recompute_report(rebuilt)
    assert len(rows) == len(alive) and all(r["forwards"] == 2 for r in rows)  # the 2 training forwards above
    assert sum(r["rebuilt"] for r in rows) == 2 * (len(alive) - len(first_norm_readers))


def test_input_grads_on_rebuild_the_first_block_too():
    base, targets = _family("llama")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 9))
    model = _peft(base, targets, recompute=True)
    model.enable_input_require_grads()
    assert not any(_inputs_alive_after_forward(model, ids).values())


def _x_pass_inputs(monkeypatch) -> list:
    """The type of x in each x pass the fused kernels run from now on."""
    from sits_lora.ops import fused

    seen, run = [], fused.lora_x_pass_parts
    monkeypatch.setattr(fused, "lora_x_pass_parts", lambda x, *a, **k: seen.append(x) or run(x, *a, **k))
    return seen


def _triton_rebuilt_against_saved(monkeypatch, base, targets):
    """The fused kernels with inputs rebuilt against those with inputs saved (fp32, same gradients); returns the
    rebuilt model, the ids and the ProductInputs its x passes read."""
    from sits_lora.ops import ProductInput

    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    saved = _peft(base, targets, recompute=False, kernel="triton")
    rebuilt = _peft(base, targets, recompute=True, kernel="triton")
    expected = _grads(saved, ids)
    x_passes = _x_pass_inputs(monkeypatch)
    _assert_same_grads(expected, _grads(rebuilt, ids), rtol=1e-5, atol=1e-6)
    return rebuilt, ids, [x for x in x_passes if isinstance(x, ProductInput)]


def test_triton_path_under_the_interpreter_matches(monkeypatch):
    """The fused kernels (siblings q/k/v and gate/up in one op each) with rebuilt inputs, fp32; down_proj's x pass
    reads act(gate) and up, which the multiply keeps, instead of its input."""
    base, targets = _family("llama")
    rebuilt, ids, products = _triton_rebuilt_against_saved(monkeypatch, base, targets)
    assert len(products) == SHAPE["num_hidden_layers"] and not any(p.silu for p in products)
    alive = _inputs_alive_after_forward(rebuilt, ids)
    assert not alive["layers.1.self_attn.q_proj"] and not alive["layers.1.mlp.down_proj"]


def test_dropout_keeps_the_dropped_input_and_the_same_gradients():
    base, targets = _family("llama")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    saved = _peft(base, targets, recompute=False, dropout=0.2)
    rebuilt = _peft(base, targets, recompute=True, dropout=0.2)
    _assert_same_grads(_grads(saved, ids), _grads(rebuilt, ids), rtol=0, atol=0)


def test_eager_attention_saves_o_proj_input_and_says_so(caplog):
    base, targets = _family("llama", attn="eager")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    saved, rebuilt = _peft(base, targets, recompute=False), _peft(base, targets, recompute=True)
    with caplog.at_level(logging.INFO, logger="sits_lora"):
        _assert_same_grads(_grads(saved, ids), _grads(rebuilt, ids), rtol=0, atol=0)
        alive = _inputs_alive_after_forward(rebuilt, ids)
    assert alive["layers.1.self_attn.o_proj"] and not alive["layers.1.self_attn.q_proj"]
    o_proj_lines = [r.getMessage() for r in caplog.records if "o_proj" in r.getMessage()]
    assert len(o_proj_lines) == 2  # one line per o_proj layer, once
    assert "layers.1.self_attn.o_proj saves its LoRA input" in o_proj_lines[1]


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_owns_the_saved_tensors(reentrant):
    base, targets = _family("llama")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    expected = _grads(_peft(base, targets, recompute=False), ids)
    model = _peft(base, targets, recompute=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    actual = _grads(model, ids)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_off_attaches_nothing_and_unload_removes_the_hooks():
    base, targets = _family("llama")
    off = _peft(base, targets, recompute=False)
    assert not input_recompute_report(off)
    on = _peft(base, targets, recompute=True)
    norms = [m for n, m in on.named_modules() if n.endswith("layernorm")]
    assert norms and all(len(m._forward_hooks) == 1 for m in norms)
    merged = on.merge_and_unload()
    assert all(not m._forward_hooks for m in norms)
    assert not input_recompute_report(merged)


def test_rejects_a_non_bool():
    with pytest.raises(ValueError, match="recompute_lora_inputs"):
        SitsLoraConfig(target_modules=["q_proj"], recompute_lora_inputs="yes")


def test_nothing_of_a_rebuild_outlives_backward_without_the_garbage_collector(monkeypatch):
    """The rebuilt inputs (and the tensors they are made from) go with the graph, by reference counting: a
    cycle would keep every layer's rebuilt input until the collector runs, more memory than saving them."""
    import gc

    from sits_lora.activations import recompute

    made = []
    init = recompute.RebuiltInput.__init__

    def remember(self, *args):
        init(self, *args)
        made.append(weakref.ref(self))

    monkeypatch.setattr(recompute.RebuiltInput, "__init__", remember)
    base, targets = _family("llama")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    model = _peft(base, targets, recompute=True)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            _grads(model, ids)
            assert made and all(ref() is None for ref in made)
    finally:
        gc.enable()


class LigerSiLUMulFunction(torch.autograd.Function):
    """Liger-Kernel's fused SiLU·mul contract (its Triton kernel does not run on the CPU): forward(a, b,
    gate_multiplier, down_multiplier) saves a and b flattened to 2-D and keeps the multipliers on its context."""

    @staticmethod
    def forward(ctx, a, b, gate_multiplier=1.0, down_multiplier=1.0):
        ctx.gate_multiplier, ctx.down_multiplier = gate_multiplier, down_multiplier
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        ctx.save_for_backward(a2, b2)
        return (torch.nn.functional.silu(a2 * gate_multiplier) * b2 * down_multiplier).view(a.shape)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        with torch.enable_grad():
            a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
            c = torch.nn.functional.silu(a * ctx.gate_multiplier) * b * ctx.down_multiplier
            da, db = torch.autograd.grad(c, (a, b), dc.reshape(c.shape))
        return da.view(dc.shape), db.view(dc.shape), None, None


def test_a_fused_gated_product_is_rebuilt_through_its_function():
    from transformers.models.llama.modeling_llama import LlamaMLP

    class FusedMLP(LlamaMLP):  # what Liger's LigerSwiGLUMLP does
        def forward(self, x):
            return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x), 1.0, 0.5))

    base, targets = _family("llama")
    for layer in base.model.layers:
        layer.mlp.__class__ = FusedMLP
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    saved, rebuilt = _peft(base, targets, recompute=False), _peft(base, targets, recompute=True)
    _assert_same_grads(_grads(saved, ids), _grads(rebuilt, ids), rtol=0, atol=0)
    alive = _inputs_alive_after_forward(rebuilt, ids)
    assert not alive["layers.0.mlp.down_proj"] and not alive["layers.1.mlp.down_proj"]


@pytest.mark.parametrize("down_multiplier", [1.0, 0.5])
def test_liger_swiglu_factors_reach_the_x_pass_when_it_can_form_them(monkeypatch, down_multiplier):
    """Liger's SiLU·mul without multipliers: down_proj's x pass reads (gate, up) and forms silu(gate)·up itself; with
    a multiplier it cannot (the product is no longer silu(gate)·up), and the input is rebuilt through the Function."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    class FusedMLP(LlamaMLP):
        def forward(self, x):
            return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x), 1.0, down_multiplier))

    base, targets = _family("llama")
    for layer in base.model.layers:
        layer.mlp.__class__ = FusedMLP
    rebuilt, ids, products = _triton_rebuilt_against_saved(monkeypatch, base, targets)
    assert len(products) == (SHAPE["num_hidden_layers"] if down_multiplier == 1.0 else 0)
    assert all(p.silu for p in products)
    assert not _inputs_alive_after_forward(rebuilt, ids)["layers.1.mlp.down_proj"]


def test_a_norm_that_keeps_a_copy_is_not_worth_rebuilding():
    """transformers' RMSNorm on bf16 saves an fp32 copy of its input, not the input: keeping the input for a
    rebuild would hold as many bytes as the LoRA input did, so q/k/v and gate/up save their input as before."""
    base, targets = _family("llama")
    base = base.to(torch.bfloat16)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    saved, rebuilt = _peft(base, targets, recompute=False), _peft(base, targets, recompute=True)
    _assert_same_grads(_grads(saved, ids), _grads(rebuilt, ids), rtol=0, atol=0)
    alive = _inputs_alive_after_forward(rebuilt, ids)
    assert {name.rsplit(".", 1)[-1] for name, kept in alive.items() if not kept} == {"o_proj", "down_proj"}


def test_siblings_report_the_op_that_ran_for_them():
    """On the fused path k/v (and up) hand over what the q (gate) call computed: they report that call."""
    base, targets = _family("llama")
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 7))
    model = _peft(base, targets, recompute=True, kernel="triton")
    _grads(model, ids)
    rows = {r["layer"].split("model.", 2)[-1]: r for r in input_recompute_report(model)}
    assert rows["layers.1.self_attn.k_proj"]["via"].endswith("layers.1.self_attn.q_proj")
    assert rows["layers.1.self_attn.k_proj"]["rebuilt"] == rows["layers.1.self_attn.q_proj"]["rebuilt"] == 1
    assert rows["layers.1.mlp.up_proj"]["via"].endswith("layers.1.mlp.gate_proj")
    assert rows["layers.1.self_attn.o_proj"]["via"] is None and rows["layers.1.self_attn.o_proj"]["rebuilt"] == 1


def test_a_source_changed_in_place_is_an_error_not_a_wrong_gradient():
    """The tensors an input is rebuilt from are references, not saved tensors: autograd's in-place check does not
    see them, so the rebuild checks their versions itself."""
    from sits_lora.activations.recompute import RebuiltInput

    h = torch.randn(3, 4)
    rebuilt = RebuiltInput(lambda t: t * 2, (h,))
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified in place between forward and backward.*recompute_lora_inputs=False"):
        rebuilt.value()
    fine = RebuiltInput(lambda t: t * 2, (h,))
    torch.testing.assert_close(fine.value(), h * 2)
