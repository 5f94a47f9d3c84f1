"""Sibling fusion (q/k/v, gate/up share one pass over x): same numbers, fewer passes, safe fallbacks."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from sits_lora import SitsLoraConfig, ops
from sits_lora.layers.siblings import SiblingGroup

from conftest import randomize_lora_weights, rel_err, tiny_llama

# these tests count the sibling-group / ATen paths at sizes the decode path would take (tests/ops/test_decode.py)
pytestmark = pytest.mark.usefixtures("no_decode_kernel", "small_interpreter_blocks")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(fuse, **kw):
    model = get_peft_model(tiny_llama(), SitsLoraConfig(r=5, lora_alpha=10, kernel="triton", target_modules=ALL,
                                                        fuse_siblings=fuse, **kw))
    randomize_lora_weights(model)
    return model.train()


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_fused_equals_unfused_every_gradient(monkeypatch):
    calls = []
    real = ops.lora_siblings_triton
    monkeypatch.setattr(ops, "lora_siblings_triton", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    logits_f, grads_f = _step(_model(True), ids)
    assert sorted(calls) == [2, 2, 3, 3]  # per decoder layer: gate/up and q/k/v
    logits_u, grads_u = _step(_model(False), ids)
    assert len(calls) == 4
    assert rel_err(logits_f, logits_u) < 1e-6
    for n in grads_u:
        assert rel_err(grads_f[n], grads_u[n]) < 1e-5, n


def test_groups_are_assigned_by_name():
    model = _model(True)
    attn = model.base_model.model.model.layers[0].self_attn
    mlp = model.base_model.model.model.layers[0].mlp
    assert isinstance(attn.q_proj.sibling_group, SiblingGroup)
    assert attn.q_proj.sibling_group is attn.k_proj.sibling_group is attn.v_proj.sibling_group
    assert mlp.gate_proj.sibling_group is mlp.up_proj.sibling_group
    assert attn.o_proj.sibling_group is None and mlp.down_proj.sibling_group is None
    assert _model(False).base_model.model.model.layers[0].self_attn.q_proj.sibling_group is None


def test_x_saved_once_for_a_group():
    model = _model(True)
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 7, 48, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert sum(t.data_ptr() == x.data_ptr() for t in saved) == 1
    (q.sum() + k.sum() * 2 + v.sum() * 3).backward()
    assert x.grad is not None


def test_sibling_called_with_another_input_falls_back_correctly():
    fused, plain = _model(True), _model(False)
    plain.load_state_dict(fused.state_dict())
    x1, x2 = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    a_f = fused.base_model.model.model.layers[0].self_attn
    a_p = plain.base_model.model.model.layers[0].self_attn
    out_f = [a_f.q_proj(x1), a_f.k_proj(x2), a_f.v_proj(x2)]   # cross-attention-like: q reads another tensor
    out_p = [a_p.q_proj(x1), a_p.k_proj(x2), a_p.v_proj(x2)]
    for f, p in zip(out_f, out_p):
        assert rel_err(f, p) < 1e-6
    assert a_f.q_proj.sibling_group.enabled is False


def test_dropout_and_reference_kernel_skip_fusion(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "lora_siblings_triton", lambda *a, **k: calls.append(1))
    ids = torch.randint(0, 97, (2, 5))
    _model(True, lora_dropout=0.1)(input_ids=ids)
    model = get_peft_model(tiny_llama(), SitsLoraConfig(r=4, kernel="torch", target_modules=ALL))
    model(input_ids=ids)
    assert calls == []


def test_fuse_siblings_must_be_bool():
    with pytest.raises(ValueError, match="SitsLoraConfig.fuse_siblings='yes' is invalid: it must be True or False"):
        SitsLoraConfig(target_modules=["q_proj"], fuse_siblings="yes")


@pytest.mark.skipif(not ops.triton_interpreter_on(), reason="runs the Triton kernels under TRITON_INTERPRET=1")
def test_siblings_backward_with_an_output_that_got_no_gradient():
    """A sibling whose output received no gradient (None) gets zero dA / dB; the others are unchanged."""
    from sits_lora.ops import siblings as siblings_op
    from sits_lora.ops.reference import lora_linear_torch

    gen = torch.Generator().manual_seed(3)
    T, K, ranks, outs, scales = 45, 40, (5, 8, 3), (24, 56, 17), (2.0, 0.5, 1.25)
    x = torch.randn(T, K, generator=gen)
    Ws = [torch.randn(n, K, generator=gen) / K**0.5 for n in outs]
    As = [torch.randn(r, K, generator=gen) / K**0.5 for r in ranks]
    Bs = [torch.randn(n, r, generator=gen) / r**0.5 for n, r in zip(outs, ranks)]
    dys = [torch.randn(T, n, generator=gen) for n in outs]
    dys[1] = None
    _, h, A_all = siblings_op.lora_siblings_forward(x, Ws, [None] * 3, As, Bs, scales, "cublas")
    dx, dAs, dBs = siblings_op.lora_siblings_backward(dys, x, Ws, As, Bs, h, scales, "cublas", True, A_all)
    dx_ref = torch.zeros_like(x)
    for i, (W, A, B, s, dy) in enumerate(zip(Ws, As, Bs, scales, dys)):
        if dy is None:
            assert torch.count_nonzero(dAs[i]) == 0 and torch.count_nonzero(dBs[i]) == 0
            continue
        xr, Ar, Br = x.clone().requires_grad_(), A.clone().requires_grad_(), B.clone().requires_grad_()
        lora_linear_torch(xr, xr, W, None, Ar, Br, s).backward(dy)
        dx_ref += xr.grad
        assert rel_err(dAs[i], Ar.grad) < 1e-5 and rel_err(dBs[i], Br.grad) < 1e-5, i
    assert rel_err(dx, dx_ref) < 1e-5


def test_inference_mode_runs_the_fused_siblings(monkeypatch):
    """Inference tensors have no version counter: the group must not read one (it raised before)."""
    calls = []
    real = ops.lora_siblings_triton
    monkeypatch.setattr(ops, "lora_siblings_triton", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    model = _model(True).eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with torch.inference_mode():
        got = model(input_ids=ids).logits
    assert sorted(calls) == [2, 2, 2, 2, 3, 3, 3, 3]
    assert torch.equal(got, expected)
