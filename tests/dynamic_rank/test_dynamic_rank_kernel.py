"""The dynamic-rank Triton path against the reference (mask multiply): outputs and every gradient.

On the CPU the kernels run under the Triton interpreter (conftest turns it on): fp32 to 1e-5,
fp16 by relative error. Mixed buckets, a bucket of rank 0, ranks that are not multiples of 16,
tokens grouped by bucket or not, dropout (a separate LoRA input), and the router's gradient.
"""

from __future__ import annotations

import pytest
import torch

from sits_lora import DynamicRankLinear, ops
from sits_lora.dynamic_rank import dynamic_rank_lora_linear, dynamic_rank_lora_linear_reference
from sits_lora.ops.fused import limit_grad, lora_expand, lora_shrink, lora_shrink_limited

from conftest import rel_err
from test_dynamic_rank import dyn_model, ids, layers

# the kernels' tiling: their odd shapes span several programs (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("small_interpreter_blocks")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}

# T, d_in, d_out, buckets, bucket histogram ("mixed" draws all buckets), lead dims
CASES = [
    (37, 48, 40, (16, 32, 48, 64), "mixed", ()),
    (37, 48, 40, (16, 32, 48, 64), "all-min", ()),
    (29, 40, 72, (16, 32, 48, 64), "all-max", (1,)),
    (19, 24, 40, (0, 5, 17, 40), "mixed", (2,)),
    (64, 64, 96, (8, 24), "mixed", ()),
]


def _bucket_ids(tokens, k, histogram, seed):
    if histogram == "all-min":
        return torch.zeros(tokens, dtype=torch.long)
    if histogram == "all-max":
        return torch.full((tokens,), k - 1, dtype=torch.long)
    return torch.randint(0, k, (tokens,), generator=torch.Generator().manual_seed(seed))


def _run(kernel, x, x_lora_mask, W, b, A, B, s, ids_, buckets, with_router, dy, group=True):
    x = x.detach().clone().requires_grad_(True)
    A = A.detach().clone().requires_grad_(True)
    B = B.detach().clone().requires_grad_(True)
    weights = None
    if with_router:
        weights = torch.nn.functional.one_hot(ids_, len(buckets)).to(torch.float32).requires_grad_(True)
    x_lora = x if x_lora_mask is None else x * x_lora_mask
    if kernel == "torch":
        y = dynamic_rank_lora_linear_reference(x, x_lora, W, b, A, B, s, ids_, buckets, weights)
    else:
        ends = torch.tensor(buckets, device=x.device)
        limit = ends[ids_].to(torch.int32)
        y = ops.lora_linear_dynamic_rank_triton(x, None if x_lora is x else x_lora, W, b, A, B, s, limit, ends,
                                                weights, group_tokens=group)
    y.backward(dy)
    return y, x.grad, A.grad, B.grad, None if weights is None else weights.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_router", [True, False], ids=["router", "hard"])
@pytest.mark.parametrize("T,d_in,d_out,buckets,histogram,lead", CASES,
                         ids=[f"T{c[0]}-{c[1]}x{c[2]}-b{'_'.join(map(str, c[3]))}-{c[4]}" for c in CASES])
def test_triton_path_matches_reference(T, d_in, d_out, buckets, histogram, lead, with_router, dtype):
    g = torch.Generator().manual_seed(T + d_in)
    r = buckets[-1]
    x = torch.randn(*lead, T, d_in, generator=g).to(DEVICE, dtype)
    W = (torch.randn(d_out, d_in, generator=g) / d_in**0.5).to(DEVICE, dtype)
    b = torch.randn(d_out, generator=g).to(DEVICE, dtype)
    A = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(DEVICE)
    B = (torch.randn(d_out, r, generator=g) / max(r, 1)**0.5).to(DEVICE)
    dy = torch.randn(*lead, T, d_out, generator=g).to(DEVICE, dtype)
    tokens = x.numel() // d_in
    ids_ = _bucket_ids(tokens, len(buckets), histogram, seed=T).to(DEVICE)
    # the reference runs the LoRA branch in fp32 (the adapter dtype); the kernels cast A, B to fp16 for the dot
    ref = _run("torch", x.float() if dtype == torch.float16 else x, None, W.float(), b.float(), A, B, 0.7, ids_,
               buckets, with_router, dy.float())
    out = _run("triton", x, None, W, b, A, B, 0.7, ids_, buckets, with_router, dy)
    for name, got, want in zip(("y", "dx", "dA", "dB", "d bucket_weights"), out, ref):
        if want is None:
            assert got is None, name
            continue
        assert got.shape == want.shape, name
        assert torch.isfinite(got).all(), name
        if want.abs().max() == 0:  # e.g. dA / dB of a bucket-0-only batch
            assert got.abs().max() == 0, name
        else:
            assert rel_err(got.float(), want.float()) < TOL[dtype], name


@pytest.mark.parametrize("group", [True, False], ids=["grouped", "in-order"])
def test_dropout_input_and_ungrouped_tokens(group):
    """A separate LoRA input (dropout) gets its own gradient; token order does not change the result."""
    g = torch.Generator().manual_seed(5)
    T, d_in, d_out, buckets = 41, 32, 24, (16, 32, 48)
    x = torch.randn(T, d_in, generator=g).to(DEVICE)
    W, b = torch.randn(d_out, d_in, generator=g).to(DEVICE), None
    A, B = torch.randn(48, d_in, generator=g).to(DEVICE), torch.randn(d_out, 48, generator=g).to(DEVICE)
    keep = (torch.rand(T, d_in, generator=g) > 0.3).float().to(DEVICE) / 0.7
    dy = torch.randn(T, d_out, generator=g).to(DEVICE)
    ids_ = _bucket_ids(T, len(buckets), "mixed", seed=2).to(DEVICE)
    ref = _run("torch", x, keep, W, b, A, B, 0.5, ids_, buckets, True, dy)
    out = _run("triton", x, keep, W, b, A, B, 0.5, ids_, buckets, True, dy, group=group)
    for name, got, want in zip(("y", "dx", "dA", "dB", "d bucket_weights"), out, ref):
        assert rel_err(got, want) < 1e-5, name


def test_expand_skips_rank_tiles_above_each_token_limit():
    """A token's h beyond its limit never reaches the output: filling it with NaN changes nothing."""
    g = torch.Generator().manual_seed(1)
    T, R, N = 33, 64, 40
    h = torch.randn(T, R, generator=g).to(DEVICE)
    B = torch.randn(N, R, generator=g).to(DEVICE)
    limit = torch.tensor([16, 32, 48, 64, 0] * 6 + [16, 16, 64], dtype=torch.int32, device=DEVICE)
    poisoned = h.clone()
    poisoned[torch.arange(R, device=DEVICE)[None, :] >= limit[:, None].long()] = float("nan")
    order = torch.argsort(limit).to(torch.int32)
    got = lora_expand(poisoned, B, 0.5, None, torch.float32, rank_limit=limit, token_order=order)
    masked = h * (torch.arange(R, device=DEVICE)[None, :] < limit[:, None].long())
    assert rel_err(got, 0.5 * masked @ B.t()) < 1e-5


@pytest.mark.parametrize("T,R,ends", [(70, 64, (16, 32, 48, 64)), (19, 40, (0, 5, 17, 40)), (1, 8, (8,))])
def test_limit_grad_limits_g_and_gives_the_prefix_sum_formula(T, R, ends):
    """g zeroed from each token's limit on; the bucket gradient s · cumsum(h ⊙ g) read at each bucket's
    end (0 for a bucket of rank 0), over the unlimited h and g; without h, no bucket gradient."""
    gen = torch.Generator().manual_seed(3)
    h, g = (torch.randn(T, R, generator=gen).to(DEVICE) for _ in range(2))
    bucket_ends = torch.tensor(ends, device=DEVICE)
    limit = bucket_ends[torch.randint(0, len(ends), (T,), generator=gen).to(DEVICE)].to(torch.int32)
    keep = torch.arange(R, device=DEVICE)[None, :] < limit[:, None].long()
    prefix = torch.nn.functional.pad(torch.cumsum(h * g, dim=1), (1, 0))
    g_limited, d_weights = limit_grad(g, limit, 0.25, h, bucket_ends)
    assert torch.equal(g_limited, g * keep)
    assert d_weights.shape == (T, len(ends)) and d_weights.dtype == torch.float32
    assert rel_err(d_weights, 0.25 * prefix.index_select(1, bucket_ends)) < 1e-5
    g_only, none = limit_grad(g, limit, 0.25)
    assert none is None and torch.equal(g_only, g_limited)
    with pytest.raises(ValueError, match="h_full needs bucket_ends"):
        limit_grad(g, limit, 0.25, h)


@pytest.mark.parametrize("keep_full", [True, False])
def test_shrink_limited_zeroes_h_from_each_limit_and_keeps_the_full_h_on_request(keep_full):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 48, generator=gen).to(DEVICE)
    A = torch.randn(40, 48, generator=gen).to(DEVICE)
    limit = torch.tensor([0, 5, 17, 40] * 9 + [40], dtype=torch.int32, device=DEVICE)
    h, h_full = lora_shrink_limited(x, A, limit, keep_full)
    full = lora_shrink(x, A)
    assert torch.equal(h, full * (torch.arange(40, device=DEVICE)[None, :] < limit[:, None].long()))
    assert (h_full is None) != keep_full
    if keep_full:
        assert torch.equal(h_full, full)


@pytest.mark.parametrize("scheduler", ["learned", "entropy-gated", "random", "static"])
def test_layer_with_kernel_triton_matches_kernel_torch(scheduler, monkeypatch):
    """The whole routed model: same outputs and gradients (routers included) with either kernel."""
    calls = []
    from sits_lora.ops import dynamic_rank as dynamic_rank_op

    fused = dynamic_rank_op.lora_linear_dynamic_rank_triton
    monkeypatch.setattr(dynamic_rank_op, "lora_linear_dynamic_rank_triton",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    results = {}
    for kernel in ("torch", "triton"):
        model = dyn_model(scheduler, kernel=kernel).train()
        torch.manual_seed(11)  # the same Gumbel / random draws in both runs
        out = model(input_ids=ids(), labels=ids())
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
        results[kernel] = (out.loss.detach(), grads)
        assert all(isinstance(m, DynamicRankLinear) for m in layers(model))
    assert len(calls) == 6  # 2 blocks x (q_proj, v_proj, down_proj), each on the fused path once
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    assert rel_err(loss_k, loss_t) < 1e-5
    assert grads_t.keys() == grads_k.keys()
    routers = [n for n in grads_t if "lora_router" in n]
    assert bool(routers) == (scheduler in ("learned", "entropy-gated"))
    for name in grads_t:
        assert rel_err(grads_k[name], grads_t[name]) < 1e-4, name


def test_dynamic_rank_kernel_name_is_checked():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="unknown dynamic-rank kernel 'cuda'; available: torch, triton"):
        dynamic_rank_lora_linear(x, x, torch.randn(4, 8), None, torch.randn(2, 8), torch.randn(4, 2), 1.0,
                                 torch.zeros(3, dtype=torch.long), [2], kernel="cuda")
