"""Per-token dynamic rank (issue 5): the reference path, the layer, routing, budget, merge, save / load."""

from __future__ import annotations

import ast
import copy
import json
import os
import warnings

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn

import sits_lora
from sits_lora import DynamicRankLinear, RankBudget, SitsLoraConfig, truncate_rank
from sits_lora.dynamic_rank import (
    RoutingMergeError,
    dynamic_rank_lora_linear_grouped,
    dynamic_rank_lora_linear_reference,
    group_tokens_by_bucket,
    rank_parameter_counts,
)
from sits_lora.ops.reference import rank_step_matrix

from conftest import randomize_lora_weights, rel_err, tiny_llama

TARGETS = ["q_proj", "v_proj", "down_proj"]
BUCKETS = [2, 4, 6, 8]


def dyn_config(scheduler="learned", **overrides):
    kwargs = dict(r=8, lora_alpha=8, target_modules=TARGETS, use_dynamic_rank=True, rank_scheduler=scheduler,
                  rank_buckets=BUCKETS)
    if scheduler in ("learned", "entropy-gated"):
        kwargs["target_mean_rank"] = 4
    if scheduler == "random":
        kwargs["rank_histogram"] = [0.25, 0.25, 0.25, 0.25]
    kwargs.update(overrides)
    return SitsLoraConfig(**kwargs)


def dyn_model(scheduler="learned", seed=0, fit_probes=True, **overrides):
    model = get_peft_model(tiny_llama(seed=seed), dyn_config(scheduler, **overrides))
    randomize_lora_weights(model)  # routers and probes too: lora_B = 0 would make every gradient vanish
    if fit_probes:
        for m in model.modules():
            if isinstance(m, DynamicRankLinear):
                for probe in m.lora_entropy_probe.values():
                    probe.fitted.fill_(True)  # as TokenEntropySampler leaves them (test_dynamic_rank_sampler.py)
    return model


def ids(batch=3, seq=7, seed=3):
    return torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


def layers(model):
    return [m for m in model.modules() if isinstance(m, DynamicRankLinear)]


# ---------------------------------------------------------------- the reference path (oracle of the kernel)


def _operands(t=37, d_in=24, d_out=19, r=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d_in, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(d_out, d_in, generator=g, dtype=dtype)
    b = torch.randn(d_out, generator=g, dtype=dtype)
    a = torch.randn(r, d_in, generator=g).requires_grad_()
    bb = torch.randn(d_out, r, generator=g).requires_grad_()
    bucket_ids = torch.randint(0, len(BUCKETS), (t,), generator=g)
    return x, w, b, a, bb, bucket_ids


def test_reference_is_a_per_token_truncation():
    x, w, b, a, bb, bucket_ids = _operands()
    y = dynamic_rank_lora_linear_reference(x, x, w, b, a, bb, 0.5, bucket_ids, BUCKETS)
    for t in range(x.shape[0]):
        k = BUCKETS[bucket_ids[t]]
        expected = x[t] @ w.t() + b + 0.5 * (x[t] @ a[:k].t()) @ bb[:, :k].t()
        torch.testing.assert_close(y[t], expected, rtol=1e-5, atol=1e-5)


def test_grouped_algorithm_equals_the_mask_reference_with_gradients():
    """The kernel's algorithm (tokens sorted by bucket, first b_k columns only) against the oracle."""
    x, w, b, a, bb, bucket_ids = _operands()
    x = x.detach().reshape(1, 37, 24).requires_grad_()  # a leading batch dim
    outs, grads = [], []
    for fn in (dynamic_rank_lora_linear_reference, dynamic_rank_lora_linear_grouped):
        for t in (x, a, bb):
            t.grad = None
        y = fn(x, x, w, b, a, bb, 0.7, bucket_ids, BUCKETS)
        y.backward(torch.ones_like(y) + y.detach())
        outs.append(y.detach())
        grads.append([t.grad.clone() for t in (x, a, bb)])
    assert outs[0].shape == (1, 37, 19)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for g_grouped, g_ref in zip(grads[1], grads[0]):
        assert rel_err(g_grouped, g_ref) < 1e-5


def test_bucket_weight_gradient_is_prefix_sums_of_h_times_g():
    """The router's gradient the kernel must return: d bucket_weights = s·(h ⊙ g) stepᵀ."""
    x, w, b, a, bb, bucket_ids = _operands()
    weights = torch.nn.functional.one_hot(bucket_ids, len(BUCKETS)).float().requires_grad_()
    y = dynamic_rank_lora_linear_reference(x, x, w, b, a, bb, 0.3, bucket_ids, BUCKETS, weights)
    dy = torch.randn_like(y)
    y.backward(dy)
    h = x.detach() @ a.detach().t()
    g = dy @ bb.detach()
    expected = 0.3 * (h * g) @ rank_step_matrix(BUCKETS, 8).t()
    torch.testing.assert_close(weights.grad, expected, rtol=1e-4, atol=1e-5)


def test_group_tokens_by_bucket_layout():
    bucket_ids = torch.tensor([2, 0, 2, 1, 0, 2, 2])
    groups = group_tokens_by_bucket(bucket_ids, 4, block_size=2)
    assert groups.token_order.tolist() == [1, 4, 3, 0, 2, 5, 6]
    assert groups.bucket_offsets.tolist() == [0, 2, 3, 7, 7]
    # padded to blocks of 2 with the sentinel 7 (= T): [1 4 | 3 7 | 0 2 | 5 6]
    assert groups.padded_token_order.tolist() == [1, 4, 3, 7, 0, 2, 5, 6]
    assert groups.block_bucket.tolist() == [0, 1, 2, 2]
    with pytest.raises(ValueError, match=r"bucket_ids must lie in \[0, 2\)"):
        group_tokens_by_bucket(bucket_ids, 2)


# ---------------------------------------------------------------- nesting and truncation


@pytest.mark.parametrize("k_index", range(len(BUCKETS)))
def test_truncated_adapter_equals_the_masked_full_adapter(k_index):
    one_hot = [0.0] * len(BUCKETS)
    one_hot[k_index] = 1.0
    masked = dyn_model("random", rank_histogram=one_hot, use_rslora=True).eval()  # every token at bucket k
    truncated = truncate_rank(copy.deepcopy(masked), BUCKETS[k_index])
    assert not any(l.routing_on("default") for l in layers(truncated))
    assert truncated.peft_config["default"].r == BUCKETS[k_index]
    for layer in layers(truncated):
        assert layer.lora_A["default"].weight.shape[0] == BUCKETS[k_index]
        assert "default" not in layer.lora_router and "default" not in layer.lora_entropy_probe
    with torch.no_grad():
        torch.testing.assert_close(truncated(input_ids=ids()).logits, masked(input_ids=ids()).logits, rtol=1e-5, atol=1e-6)


def test_static_scheduler_trains_nested_and_infers_at_full_rank():
    model = dyn_model("static")
    stats = RankBudget(model)
    model.train()
    torch.manual_seed(0)
    model(input_ids=ids(32, 4)).logits.sum().backward()  # one bucket per sequence: 32 draws
    assert min(stats.read_stats()["histogram"].values()) > 0.05  # every bucket is drawn
    assert stats.read_stats()["token_layer_pairs"] == 0  # the read above reset the counts
    model.eval()
    assert not any(l.routing_on("default") for l in layers(model))  # eval: plain SitsLoraLinear at r
    full = truncate_rank(copy.deepcopy(model), 8)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids()).logits, full(input_ids=ids()).logits, rtol=0, atol=0)


def _capture_buckets(monkeypatch):
    """The bucket ids every dynamic-rank layer computes with, in call order."""
    from sits_lora.dynamic_rank import variant as layer_module  # the module whose forward_routed calls the op

    seen = []
    original = layer_module.dynamic_rank_lora_linear

    def spy(x, x_lora, weight, bias, lora_A, lora_B, scaling, bucket_ids, *args, **kwargs):
        seen.append(bucket_ids.clone())
        return original(x, x_lora, weight, bias, lora_A, lora_B, scaling, bucket_ids, *args, **kwargs)

    monkeypatch.setattr(layer_module, "dynamic_rank_lora_linear", spy)
    return seen


def test_nested_training_draws_one_bucket_per_sequence_for_every_layer_of_a_forward(monkeypatch):
    """Each sequence trains one truncation of the whole model (nested.py): every layer of a forward reads
    the same buckets, constant along each sequence; over forwards every bucket comes up; a layer called
    on its own draws per token for itself."""
    seen = _capture_buckets(monkeypatch)
    model = dyn_model("static")
    model.train()
    torch.manual_seed(0)
    drawn = set()
    for step in range(8):
        model(input_ids=ids(4, 16)).logits.sum().backward()
        first = seen[6 * step]
        assert len(seen) == 6 * (step + 1)  # 2 blocks x (q_proj, v_proj, down_proj)
        assert all(torch.equal(b, first) for b in seen[6 * step + 1:])
        per_sequence = first.view(4, 16)
        assert torch.equal(per_sequence, per_sequence[:, :1].expand(4, 16))
        drawn.update(per_sequence[:, 0].tolist())
    assert drawn == set(range(len(BUCKETS)))
    assert not all(torch.equal(seen[0], seen[6 * s]) for s in range(1, 8))  # forwards draw anew
    layer = layers(model)[0]
    layer(torch.randn(64, layer.in_features))
    layer(torch.randn(64, layer.in_features))
    assert seen[-1].shape == (64,) and not torch.equal(seen[-1], seen[-2])
    assert len(set(seen[-1].tolist())) > 1


def test_nested_draw_is_reproducible_under_a_seed_and_attached_once(monkeypatch):
    seen = _capture_buckets(monkeypatch)
    model = dyn_model("static")
    inner = model.base_model.model
    hooks = (len(inner._forward_pre_hooks), len(inner._forward_hooks))
    model.add_adapter("second", dyn_config("static"))
    assert (len(inner._forward_pre_hooks), len(inner._forward_hooks)) == hooks
    model.train()
    for _ in range(2):
        torch.manual_seed(5)
        model(input_ids=ids(8, 8)).logits.sum().backward()
    assert torch.equal(seen[0], seen[6])


def test_a_deep_copy_draws_with_its_own_seed():
    """An EMA or reference copy of a nested model: its layers share the copy's draw, which changes every step
    (the hooks find the seed on the model they run for, not on the original)."""
    import copy

    model = dyn_model("static")
    twin = copy.deepcopy(model).train()
    draws = []
    for step in range(4):
        torch.manual_seed(step)
        twin(input_ids=ids(8, 8)).logits.sum().backward()
        kept = [m.nested_ids["default"] for m in layers(twin)]
        assert all(torch.equal(k, kept[0]) for k in kept)
        draws.append(kept[0].clone())
    assert len({tuple(d.tolist()) for d in draws}) > 1
    assert layers(twin)[0]._sits_lora_draw_seed is not layers(model)[0]._sits_lora_draw_seed


def test_rank_counts_follow_the_layer_and_survive_meta_init():
    from sits_lora.dynamic_rank import valid_tokens

    model = dyn_model("learned")
    layer = layers(model)[0]
    model.train()
    with valid_tokens(None):  # a counted forward, as inside a model with a RankBudget
        model(input_ids=ids()).logits.sum().backward()
    counted = layer.rank_counts("default", reset=False)
    assert int(counted.sum()) > 0
    model.half()
    assert layer._rank_counts["default"].dtype == torch.long          # a dtype cast leaves the counts int64
    assert torch.equal(layer.rank_counts("default", reset=True), counted)
    assert int(layer.rank_counts("default").sum()) == 0               # reset zeroed them in place
    model.to("meta")
    model.to_empty(device="cpu")                                       # meta-device init: counts start at zero
    assert layer._rank_counts["default"].device.type == "cpu" and int(layer._rank_counts["default"].sum()) == 0


def test_forward_draw_is_per_row_of_a_batch_and_per_token_for_a_flat_input():
    from sits_lora.dynamic_rank.nested import shared_bucket_ids

    seed = torch.tensor(3)
    batched = shared_bucket_ids(seed, (6, 5), 4, torch.device("cpu"))
    assert batched.shape == (30,) and torch.equal(batched.view(6, 5), batched.view(6, 5)[:, :1].expand(6, 5))
    # every layer of the forward computes the same draw from the same seed (no shared cache needed)
    assert torch.equal(shared_bucket_ids(seed, (6, 5), 4, torch.device("cpu")), batched)
    flat = shared_bucket_ids(seed, (64,), 4, torch.device("cpu"))
    assert flat.shape == (64,) and len(set(flat.tolist())) > 1
    assert not torch.equal(shared_bucket_ids(torch.tensor(4), (64,), 4, torch.device("cpu")), flat)


def test_forward_draw_is_close_to_uniform():
    """The hash draw: each of k buckets gets about 1/k of many sequences, for seeds near and far apart."""
    from sits_lora.dynamic_rank.nested import shared_bucket_ids

    for seed in (0, 1, 2**40 + 7):
        ids = shared_bucket_ids(torch.tensor(seed), (40000,), 4, torch.device("cpu"))
        share = torch.bincount(ids, minlength=4).float() / ids.numel()
        assert (share - 0.25).abs().max() < 0.01, (seed, share)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_nested_draw_survives_gradient_checkpointing(use_reentrant):
    """The recompute in backward takes each layer's buckets from its forward: the same gradients as
    without checkpointing (the draw consumes no random numbers inside the model, so dropout replays too)."""
    grads = []
    for checkpointing in (False, True):
        model = dyn_model("static", lora_dropout=0.1)
        inner = model.base_model.model
        if checkpointing:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            if use_reentrant:
                inner.enable_input_require_grads()
        model.train()
        torch.manual_seed(11)
        model(input_ids=ids(), labels=ids()).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_truncate_rank_takes_the_peft_model_or_its_tuner_and_returns_what_it_was_given():
    """sits_lora.truncate_rank accepts the PeftModel and its tuner (model.base_model, the SitsLoraModel, which a
    SitsLoraModel.truncate_rank method would pass), truncates in place and returns its argument."""
    model = dyn_model("learned")
    assert truncate_rank(model.base_model, 4) is model.base_model
    assert model.peft_config["default"].r == 4 and layers(model)[0].r["default"] == 4
    peft_model = dyn_model("learned")
    assert truncate_rank(peft_model, 6) is peft_model and layers(peft_model)[0].r["default"] == 6


def test_model_truncate_rank_method():
    """Issue 5's spelling, model.truncate_rank(k): the PeftModel hands it to its SitsLoraModel."""
    if not hasattr(sits_lora.SitsLoraModel, "truncate_rank"):
        pytest.skip("SitsLoraModel.truncate_rank is not in model.py yet; sits_lora.truncate_rank(model, k) works")
    model = dyn_model("learned")
    model.truncate_rank(4)
    assert model.peft_config["default"].r == 4 and not any(l.routing_on("default") for l in layers(model))
    with pytest.raises(ValueError, match=r"rank=9 is invalid"):
        dyn_model("learned").truncate_rank(9)


def test_truncate_rank_refuses_bad_input():
    with pytest.raises(ValueError, match=r"rank=9 is invalid: it must be an integer between 1 and the adapter's rank r=8"):
        truncate_rank(dyn_model(), 9)
    static = get_peft_model(tiny_llama(), SitsLoraConfig(r=4, target_modules=TARGETS))
    with pytest.raises(ValueError, match="was not trained with nested rank dimensions"):
        truncate_rank(static, 2)
    with pytest.raises(TypeError, match="expects the PeftModel"):
        truncate_rank(tiny_llama(), 2)


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("scheduler", ["learned", "entropy-gated"])
def test_router_gradients_exist_and_are_finite(scheduler):
    model = dyn_model(scheduler)
    budget = RankBudget(model)
    budget.lam = 0.5
    for layer in layers(model):
        layer.rank_lambda["default"] = 0.5
    model.train()
    out = model(input_ids=ids(), labels=ids())
    out.loss.backward()
    names = ["weight", "bias"] + (["entropy_weight"] if scheduler == "entropy-gated" else [])
    for layer in layers(model):
        router = layer.lora_router["default"]
        for name in names:
            grad = getattr(router, name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        assert all(p.grad is None and not p.requires_grad for p in layer.lora_entropy_probe.parameters())


def test_budget_term_pushes_router_towards_small_buckets():
    """With a zero task gradient, the λ term alone lowers the logits of the big buckets (relative to small)."""
    model = dyn_model("learned")
    budget = RankBudget(model)
    for layer in layers(model):
        layer.rank_lambda["default"] = 1.0
    model.train()
    (model(input_ids=ids()).logits * 0).sum().backward()
    for layer in layers(model):
        grad = layer.lora_router["default"].bias.grad
        assert grad[-1] > grad[0]  # gradient descent raises small-bucket logits relative to the largest
    budget.close()


def test_price_mode_shifts_router_biases_and_adds_no_gradient_term(tmp_path):
    """rank_budget_mode="price": λ's change moves every router's bias by -Δλ·b_k/r (the next decisions follow at
    once), the layers keep λ = 0 for the gradient, and the price saves with the adapter (it is in the biases)."""
    model = dyn_model("learned", rank_budget_mode="price", target_mean_rank=3)
    budget = RankBudget(model)
    before = [layer.lora_router["default"].bias.detach().clone() for layer in layers(model)]
    model.train()
    model(input_ids=ids()).logits.sum().backward()
    stats = budget.step()
    change = budget.step_size * (stats["mean_active_rank"] - 3) / budget.r
    assert stats["lambda"] == pytest.approx(change) and change != 0
    cost = torch.tensor([float(b) for b in budget.buckets]) / budget.r
    for layer, old in zip(layers(model), before):
        torch.testing.assert_close(layer.lora_router["default"].bias.detach(), old - change * cost)
        assert layer.rank_lambda["default"] == 0.0
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0), tmp_path)
    for layer, mine in zip(layers(loaded), layers(model)):
        torch.testing.assert_close(layer.lora_router["default"].bias, mine.lora_router["default"].bias)
    budget.close()


@pytest.mark.parametrize("mode, step, expected", [("price", None, 6.0), ("target", None, 0.5), ("ceiling", None, 0.5),
                                                  ("price", 0.75, 0.75)])
def test_budget_step_size_defaults_per_mode(mode, step, expected):
    model = dyn_model("learned", rank_budget_mode=mode, rank_budget_step_size=step)
    budget = RankBudget(model)
    assert budget.mode == mode and budget.step_size == expected
    budget.close()
    assert SitsLoraConfig(r=8, target_modules=TARGETS).rank_budget_mode == "price"


def test_compiled_routing_decision_equals_eager_in_values_and_gradients():
    """On a GPU the layer runs router.routing_decision through torch.compile (route()); compiled here on the CPU,
    with one dynamic graph over token counts, it gives the eager values and gradients."""
    from sits_lora.dynamic_rank.router import route, routing_decision

    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(routing_decision, dynamic=True)
    for T in (37, 64, 129):
        raw = torch.randn(T, 5, generator=g).requires_grad_()
        inv_rms = torch.rand(T, generator=g) + 0.5
        bias, entropy_weight = torch.randn(5, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()
        entropy, uniform, upstream = torch.randn(T, generator=g), torch.rand(T, 5, generator=g), torch.randn(T, 5, generator=g)
        results = []
        for fn in (routing_decision, compiled):
            logits, decided, used, weights = fn(raw, inv_rms, bias, entropy, entropy_weight, uniform, 0.7)
            grads = torch.autograd.grad((weights * upstream).sum() + logits.sum(), (raw, bias, entropy_weight))
            results.append((logits, decided, used, weights, *grads))
        for eager, fused in zip(*results):
            torch.testing.assert_close(fused, eager)
        assert torch.equal(results[0][3], torch.nn.functional.one_hot(results[0][2], 5).float())
    # on the CPU route() is the eager function: same values with the same noise
    out = route(raw.detach(), inv_rms, bias.detach(), entropy, entropy_weight.detach(), uniform, 0.7)
    assert torch.equal(out[2], results[0][2])


def test_compiled_routing_switch(monkeypatch):
    from sits_lora.dynamic_rank.router import compiled_routing_wanted

    monkeypatch.delenv("SITS_LORA_COMPILE_ROUTER", raising=False)
    assert not compiled_routing_wanted()  # eager by default (measured no slower on the H200, no compile wait)
    monkeypatch.setenv("SITS_LORA_COMPILE_ROUTER", "0")
    assert not compiled_routing_wanted()
    monkeypatch.setenv("SITS_LORA_COMPILE_ROUTER", "1")
    assert compiled_routing_wanted()


def test_eval_mode_routes_with_hard_buckets_deterministically():
    model = dyn_model("entropy-gated").eval()
    layer = layers(model)[0]
    x = torch.randn(2, 5, layer.in_features)
    used, weights, decided = layer.choose_buckets("default", x)
    assert weights is None and torch.equal(used, decided)
    router = sits_lora.dynamic_rank.router
    flat = x.reshape(10, -1)
    logits = layer.lora_router["default"].from_raw(flat, router.inverse_rms(flat),
                                                   layer.probe_entropy("default", flat, router.inverse_rms(flat)))
    assert torch.equal(decided, logits.argmax(-1))
    x_hat = router.rms_normalize(flat)  # the normalized form the sampler fits the probes on: the same values
    torch.testing.assert_close(logits, layer.lora_router["default"](x_hat, layer.lora_entropy_probe["default"](x_hat)))
    y1, y2 = layer(x), layer(x)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    expected = dynamic_rank_lora_linear_reference(
        x, x, layer.base_layer.weight, layer.base_layer.bias, layer.lora_A["default"].weight,
        layer.lora_B["default"].weight, layer.scaling["default"], decided, BUCKETS)
    torch.testing.assert_close(y1, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_from_raw_input_matches_the_normalized_form_and_keeps_no_fp32_copy(dtype):
    """Logits and router gradients from (x Wᵀ)·inv_rms equal those from rms_normalize(x) Wᵀ; autograd keeps x and
    inv_rms (T,) only, not a (T, d_in) fp32 copy (128 MiB per layer at 8192 tokens x 4096)."""
    from sits_lora.dynamic_rank.router import EntropyProbe, TokenRouter, inverse_rms, rms_normalize

    g = torch.Generator().manual_seed(0)
    T, d = 37, 64
    x = (torch.randn(T, d, generator=g) * 3).to(dtype)
    entropy = torch.randn(T, generator=g)
    router = TokenRouter(d, [0, 16, 32, 48, 64], 16, use_entropy=True)
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=g)
    probe = EntropyProbe(d)
    inv = inverse_rms(x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(probe.from_raw(x, inv), probe(rms_normalize(x)), **tol)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        raw = router.from_raw(x, inv, entropy)
    reference = router(rms_normalize(x), entropy)
    torch.testing.assert_close(raw, reference, **tol)
    assert not [t for t in saved if t.shape == (T, d) and t.dtype == torch.float32 and dtype != torch.float32]
    # besides x itself: inv_rms (T,) and the entropy (T,) that the entropy weight's gradient reads
    assert sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != x.data_ptr()) == 2 * T * 4
    grad = torch.randn(T, 5, generator=g)
    d_raw = torch.autograd.grad(raw, (router.weight, router.bias, router.entropy_weight), grad)
    d_ref = torch.autograd.grad(reference, (router.weight, router.bias, router.entropy_weight), grad)
    for a, b in zip(d_raw, d_ref):
        torch.testing.assert_close(a, b, **tol)


def test_training_samples_around_the_decision_and_budget_reads_both():
    model = dyn_model("learned")
    budget = RankBudget(model)
    model.train()
    model(input_ids=ids(4, 32))
    stats = budget.read_stats()
    assert stats["token_layer_pairs"] == 4 * 32 * len(layers(model))
    assert 2 <= stats["mean_active_rank"] <= 8 and 2 <= stats["mean_computed_rank"] <= 8


def test_routed_training_without_a_budget_warns():
    model = dyn_model("learned")
    model.train()
    with pytest.warns(UserWarning, match="training without a rank budget"):
        model(input_ids=ids()).logits.sum().backward()


def _toy_router_run(delta_rank: int, target: float, mode: str = "target", step_size=None, steps: int = 200):
    """A learned router on y = x (W + Δ), Δ of rank delta_rank, r 16, buckets 4/8/12/16: the mean active rank and
    λ over the last 50 steps, and the budget's state."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32, bias=False))
    delta = torch.randn(32, delta_rank) @ torch.randn(delta_rank, 32) * 0.3
    config = SitsLoraConfig(r=16, lora_alpha=4, target_modules=["0"], use_dynamic_rank=True, rank_scheduler="learned",
                            rank_buckets=[4, 8, 12, 16], target_mean_rank=target, rank_budget_mode=mode)
    model = get_peft_model(base, config)
    budget = RankBudget(model)
    if step_size is not None:
        budget.step_size = step_size
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    means, lams = [], []
    for _ in range(steps):
        x = torch.randn(64, 32)
        y = x @ (base[0].weight.t() + delta)
        ((model(x) - y).pow(2).mean() / y.pow(2).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = budget.step()
        means.append(stats["mean_active_rank"])
        lams.append(stats["lambda"])
    return sum(means[-50:]) / 50, sum(lams[-50:]) / 50, budget.state_dict()


@pytest.mark.slow
def test_budget_controller_holds_the_mean_rank_on_a_toy_problem():
    """A regression that rewards rank (a rank-16 change): without the budget the router takes more rank; with it,
    dual ascent raises λ until the mean active rank sits at the target."""
    free_mean, _, _ = _toy_router_run(16, 8, step_size=0.0)
    held_mean, lam, _ = _toy_router_run(16, 8)
    assert free_mean > 10.0
    assert abs(held_mean - 8.0) < 1.0 and lam > 0


@pytest.mark.slow
def test_budget_target_mode_raises_a_mean_rank_below_target_and_ceiling_mode_does_not():
    """A rank-2 change: the free router settles near 12.7 of 16. A target of 14 is a ceiling that does not bind
    in "ceiling" mode (λ stays 0); in "target" mode λ turns negative and lifts the mean to the target."""
    ceiling_mean, ceiling_lam, _ = _toy_router_run(2, 14, mode="ceiling")
    target_mean, target_lam, state = _toy_router_run(2, 14, mode="target")
    assert ceiling_mean < 13.5 and ceiling_lam == 0.0
    assert abs(target_mean - 14.0) < 0.75 and target_lam < 0
    assert state["mode"] == "target"


@pytest.mark.slow
def test_budget_price_mode_at_its_default_step_holds_the_target_from_both_sides():
    """The price (the default mode, η 6): the rank-16 change pushes the mean up, the price holds it at 8; the rank-2
    change leaves it below 14, the price turns negative and lifts it (η 2 sat at 8.71 and 13.87: it lags)."""
    high_mean, high_lam, state = _toy_router_run(16, 8, mode="price")
    low_mean, low_lam, _ = _toy_router_run(2, 14, mode="price")
    assert state["mode"] == "price" and state["step_size"] == 6.0
    assert abs(high_mean - 8.0) < 0.5 and high_lam > 0
    assert abs(low_mean - 14.0) < 0.5 and low_lam < 0


def test_callback_logs_every_step_in_a_trainer(tmp_path):
    """The issue's user flow: get_peft_model, TokenEntropySampler.annotate, a plain Trainer with the callback."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    model = dyn_model("entropy-gated", fit_probes=False)
    data = Dataset.from_dict({"input_ids": ids(12, 16).tolist(), "labels": ids(12, 16).tolist(),
                              "attention_mask": [[1] * 16] * 12})
    data = sits_lora.TokenEntropySampler(model, batch_size=4, cache_dir=tmp_path / "cache", progress=False).annotate(data)
    assert "token_entropy" in data.column_names  # Trainer drops it: the router reads the fitted probes instead
    callback = sits_lora.DynamicRankCallback()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                             report_to="none", save_strategy="no", use_cpu=True, logging_steps=100)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                      callbacks=[callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "without a rank budget" in str(w.message)]  # the callback attached the budget
    assert [e["step"] for e in callback.history] == [1, 2, 3]
    entries = [e for e in trainer.state.log_history if "rank_lambda" in e]
    assert len(entries) == 3 and all(2 <= e["rank_mean_active"] <= 8 for e in entries)
    assert set(entries[0]["rank_histogram"]) == {"2", "4", "6", "8"}
    lines = (tmp_path / "rank_budget.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["rank_target"] == 4.0


# ---------------------------------------------------------------- merge, save / load, parameter counts


def test_merge_refused_while_routing_and_allowed_after_truncation():
    model = dyn_model("entropy-gated").eval()
    x = ids()
    with pytest.raises(RoutingMergeError, match=r"cannot merge adapter 'default': it gives each token its own rank .*"
                                                 r"truncate_rank\(model, 4\)"):
        model.merge_and_unload()
    with pytest.raises(RoutingMergeError):
        model.merge_adapter()
    truncate_rank(model, 4)
    with torch.no_grad():
        expected = model(input_ids=x).logits
        merged = model.merge_and_unload()
        assert not any(isinstance(m, DynamicRankLinear) for m in merged.modules())
        torch.testing.assert_close(merged(input_ids=x).logits, expected, rtol=1e-4, atol=1e-5)


def test_static_nested_adapter_merges_at_full_rank():
    model = dyn_model("static").eval()
    with torch.no_grad():
        expected = model(input_ids=ids()).logits
        torch.testing.assert_close(model.merge_and_unload()(input_ids=ids()).logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheduler", ["entropy-gated", "learned", "random"])
def test_save_load_with_router_and_probe(scheduler, tmp_path):
    model = dyn_model(scheduler).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        expected = model(input_ids=ids()).logits
    model.save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["use_dynamic_rank"] and config["rank_scheduler"] == scheduler and config["rank_buckets"] == BUCKETS
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    if scheduler != "random":
        assert {f"{name}.lora_router.weight", f"{name}.lora_router.bias"} <= keys
    if scheduler == "entropy-gated":
        assert {f"{name}.lora_entropy_probe.w1", f"{name}.lora_entropy_probe.fitted",
                f"{name}.lora_router.entropy_weight"} <= keys
    again = PeftModel.from_pretrained(tiny_llama(), tmp_path).eval()
    torch.manual_seed(0)  # the random scheduler draws buckets at inference too
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids()).logits, expected, rtol=0, atol=0)
    # under another adapter name the router and probe load too (keys carry no adapter name)
    again.load_adapter(str(tmp_path), adapter_name="other")
    again.set_adapter("other")
    torch.manual_seed(0)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids()).logits, expected, rtol=0, atol=0)


def test_parameter_counts():
    model = dyn_model("entropy-gated")
    counts = rank_parameter_counts(model)
    # 2 blocks × (q_proj, v_proj: d_in 48; down_proj: d_in 80); K = 4 buckets; probe hidden 8
    d_ins = [48, 48, 80] * 2
    assert counts["layers"] == 6
    assert counts["router"] == sum(4 * d + 4 + 4 for d in d_ins)
    assert counts["entropy_probe"] == sum(8 * d + 8 + 8 + 1 for d in d_ins)


# ---------------------------------------------------------------- refusals


def test_routed_adapter_must_be_alone():
    model = dyn_model("learned").eval()
    model.add_adapter("plain", SitsLoraConfig(r=2, target_modules=TARGETS))
    model.base_model.set_adapter(["default", "plain"])
    with pytest.raises(ValueError, match="must be the only active adapter"):
        model(input_ids=ids())
    model.base_model.set_adapter("default")
    with pytest.raises(ValueError, match="adapter_names \\(a mixed batch\\) is not supported"):
        model(input_ids=ids(), adapter_names=["default", "plain", "__base__"])


def test_dynamic_rank_refuses_non_linear_targets():
    with pytest.raises(ValueError, match=r"use_dynamic_rank=True supports torch.nn.Linear layers only; target "
                                         r"'model.embed_tokens' is a torch.nn.modules.sparse.Embedding"):
        get_peft_model(tiny_llama(), dyn_config(target_modules=["embed_tokens"]))


def test_entropy_gated_needs_fitted_probes():
    model = dyn_model("entropy-gated", fit_probes=False).eval()
    with pytest.raises(sits_lora.dynamic_rank.ProbeNotFittedError, match=r"TokenEntropySampler\(model, tokenizer\)"):
        model(input_ids=ids())


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(rank_buckets=[4, 2, 8]), "SitsLoraConfig.rank_buckets=[4, 2, 8] is invalid: the buckets must be strictly increasing"),
        (dict(rank_buckets=[2, 4, 4, 8]), "must be strictly increasing"),
        (dict(rank_buckets=[2, 4, 16]), "SitsLoraConfig.rank_buckets=[2, 4, 16] is invalid: bucket 16 is above r=8"),
        (dict(rank_buckets=[2, 4, 6]), "the last bucket (6) must equal r=8"),
        (dict(rank_buckets=[2, -4, 8]), "every bucket must be a non-negative integer rank, found -4"),
        (dict(rank_buckets=[]), "it must be a non-empty list of ranks"),
        (dict(rank_buckets=None), "SitsLoraConfig.rank_buckets=None is invalid: with r=8 (not a multiple of 16"),
        (dict(target_mean_rank=1), "SitsLoraConfig.target_mean_rank=1 is invalid: it must lie within the buckets, between 2 and 8"),
        (dict(target_mean_rank=9.5), "SitsLoraConfig.target_mean_rank=9.5 is invalid: it must lie within the buckets"),
        (dict(target_mean_rank=None), "SitsLoraConfig.target_mean_rank=None is invalid: rank_scheduler='learned' routes tokens"),
        (dict(target_mean_rank=-2), "SitsLoraConfig.target_mean_rank=-2 is invalid: it must be a positive number or None"),
        (dict(rank_scheduler="adaptive"), "SitsLoraConfig.rank_scheduler='adaptive' is invalid: allowed values are "
                                          "'entropy-gated', 'learned', 'random', 'static'"),
        (dict(rank_scheduler="static"), "SitsLoraConfig.target_mean_rank=4 is invalid: rank_scheduler='static' does not route"),
        (dict(rank_histogram=[0.5, 0.5, 0, 0]), "SitsLoraConfig.rank_histogram=[0.5, 0.5, 0, 0] is invalid: it applies only "
                                                "to rank_scheduler='random'"),
        (dict(rank_scheduler="random", target_mean_rank=None, rank_histogram=[0.5, 0.5]), "it has 2 entries but there are 4 buckets"),
        (dict(rank_scheduler="random", target_mean_rank=None, rank_histogram=[0.5, 0.6, 0, 0]), "its fractions sum to 1.1000"),
        (dict(rank_scheduler="random", target_mean_rank=7, rank_histogram=[0.5, 0.5, 0, 0]),
         "SitsLoraConfig.target_mean_rank=7 is invalid: rank_histogram=[0.5, 0.5, 0, 0] has mean rank 3.00"),
        (dict(rank_scheduler="random", target_mean_rank=None), "rank_scheduler='random' needs target_mean_rank or rank_histogram"),
        (dict(router_temperature=0), "SitsLoraConfig.router_temperature=0 is invalid: it must be a positive number"),
        (dict(rank_budget_step_size=-1.0), "SitsLoraConfig.rank_budget_step_size=-1.0 is invalid"),
        (dict(rank_budget_mode="floor"), "SitsLoraConfig.rank_budget_mode='floor' is invalid: allowed values are "
                                         "'target', 'ceiling', 'price'"),
        (dict(use_dynamic_rank="yes"), "SitsLoraConfig.use_dynamic_rank='yes' is invalid: it must be True or False"),
        (dict(rank_pattern={"q_proj": 4}), "SitsLoraConfig.rank_pattern={'q_proj': 4} is invalid: per-layer ranks and alphas"),
        (dict(use_dora=True), "SitsLoraConfig.use_dora=True is invalid: DoRA is not supported with use_dynamic_rank=True"),
        (dict(lora_bias=True), "SitsLoraConfig.lora_bias=True is invalid"),
        (dict(use_dynamic_rank=False), "SitsLoraConfig.rank_scheduler='learned' is invalid: it has no effect without "
                                       "use_dynamic_rank=True"),
    ],
)
def test_bad_dynamic_rank_configs_name_field_value_and_fix(kwargs, needle):
    with pytest.raises(ValueError) as info:
        dyn_config(**kwargs)
    assert needle in str(info.value)


def test_config_loads_the_field_checks_and_no_feature():
    """The config validates each feature's fields with its module in sits_lora.config (dynamic_rank, fp8, int4), which
    imports nothing from sits_lora but the validation helpers (themselves standard library only): making a config
    loads no feature package (routers, budget, the fp8 and INT4 model steps, Triton; the layers load with the tuner
    that PEFT's registration imports), and the checks modules load without torch, so the recipe checks its options
    before torch loads."""
    import subprocess
    import sys

    code = ("import sys; import sits_lora.config.fp8, sits_lora.config.dynamic_rank, sits_lora.config.int4; "
            "print('torch' in sys.modules); from sits_lora import SitsLoraConfig; SitsLoraConfig(r=32, use_dynamic_rank=True, target_mean_rank=16); "
            "print(sorted(m for m in sys.modules if m.startswith(('sits_lora.dynamic_rank', 'sits_lora.fp8', "
            "'sits_lora.int4'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["False", "[]"]
    package = os.path.dirname(sits_lora.__file__)

    def own_imports(*path):
        with open(os.path.join(package, *path)) as f:
            tree = ast.parse(f.read())
        return [(n.level, n.module, [a.name for a in n.names]) for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and (n.level or "sits_lora" in (n.module or ""))]

    for feature in ("dynamic_rank.py", "fp8.py", "int4.py"):
        assert own_imports("config", feature) == [(2, "utils", ["validation"])], feature
    assert own_imports("utils", "validation.py") == []


def test_config_defaults_and_derived_values():
    config = SitsLoraConfig(r=64, target_modules=TARGETS, use_dynamic_rank=True, target_mean_rank=24)
    assert config.rank_buckets == [16, 32, 48, 64] and config.rank_scheduler == "entropy-gated"
    plain = SitsLoraConfig(r=8, target_modules=TARGETS)
    assert plain.use_dynamic_rank is False and plain.rank_buckets is None
    random = dyn_config("random", rank_histogram=None, target_mean_rank=4)
    model = get_peft_model(tiny_llama(), random)
    spec = layers(model)[0].rank_spec["default"]
    assert sum(p * b for p, b in zip(spec.histogram, BUCKETS)) == pytest.approx(4.0)  # spread-out histogram at the target
    with_zero = dyn_config("learned", rank_buckets=[0, 4, 8])
    assert with_zero.rank_buckets == [0, 4, 8]
