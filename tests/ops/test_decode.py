"""The one-kernel decode path (sits_lora.ops.decode) against the fp64 reference on odd shapes (rows 1 to 64, ranks
that are not powers of two, bias or none, fp32 adapters over fp16 activations), and the rule that sends a layer's
call to it: no gradients, at most 64 rows, the Triton kernel setting, no active dropout."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model

from sits_lora import SitsLoraConfig, ops
from sits_lora.ops.reference import lora_linear_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _problem(rows, d_in, d_out, r, dtype, bias, adapter_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g)
    W = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    b = torch.randn(d_out, generator=g) if bias else None
    A = torch.randn(r, d_in, generator=g) / d_in**0.5
    B = torch.randn(d_out, r, generator=g) / r**0.5
    cast = [t.to(DEVICE, dtype) if t is not None else None for t in (x, W, b)]
    adapters = [t.to(DEVICE, adapter_dtype or dtype) for t in (A, B)]
    return (*cast, *adapters)


def _reference(x, W, b, A, B, s):
    f = [t.double().cpu() if t is not None else None for t in (x, W, b, A, B)]
    return lora_linear_reference(f[0], f[0], f[1], f[2], f[3], f[4], s)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("shape", [(40, 24, 4), (72, 50, 20), (96, 33, 16)], ids=["r4", "r20", "r16-odd-out"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_decode_kernel_equals_the_reference_in_fp32(rows, shape, bias):
    d_in, d_out, r = shape
    x, W, b, A, B = _problem(rows, d_in, d_out, r, torch.float32, bias)
    y = ops.lora_linear_decode(x, W, b, A, B, 1.7)
    assert y.shape == (rows, d_out) and y.dtype == torch.float32
    torch.testing.assert_close(y.double().cpu(), _reference(x, W, b, A, B, 1.7), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("adapter_dtype", [torch.float16, torch.float32], ids=["fp16-adapters", "fp32-adapters"])
def test_decode_kernel_in_fp16_with_any_leading_shape(adapter_dtype):
    x, W, b, A, B = _problem(6, 64, 48, 8, torch.float16, True, adapter_dtype)
    x3 = x.reshape(2, 3, 64)
    y = ops.lora_linear_decode(x3, W, b, A, B, 0.5)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float16
    torch.testing.assert_close(y.reshape(6, 48).double().cpu(), _reference(x, W, b, A, B, 0.5), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split_k", [2, 3, 8])
@pytest.mark.parametrize("rows, bias", [(1, True), (17, False)], ids=["1-row-bias", "17-rows-nobias"])
def test_split_k_equals_the_reference(split_k, rows, bias):
    """K = 100 in slices of whole 32-blocks: 2 slices of 64 / 36, 3 of 64 / 36 / nothing (a plane of zeros), and
    8 asked for, 4 taken (no more slices than K blocks); the bias added once; the sum rounded once."""
    x, W, b, A, B = _problem(rows, 100, 40, 6, torch.float32, bias)
    cfg = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k, num_warps=4, num_stages=1)
    y = ops.lora_linear_decode(x, W, b, A, B, 1.3, config=cfg)
    assert y.shape == (rows, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y.double().cpu(), _reference(x, W, b, A, B, 1.3), rtol=1e-4, atol=1e-4)
    x16, W16, b16, A16, B16 = (t.half() if t is not None else None for t in (x, W, b, A, B))
    y16 = ops.lora_linear_decode(x16, W16, b16, A16, B16, 1.3, config=cfg)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.double().cpu(), _reference(x, W, b, A, B, 1.3), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split_k", [1, 2])
def test_wide_tiles_equal_the_reference(split_k):
    """The tuning space's widest tiles (BLOCK_N 128): N = 200 in a whole tile and a part one, K = 100 in 64-blocks."""
    x, W, b, A, B = _problem(3, 100, 200, 16, torch.float32, True)
    cfg = dict(BLOCK_N=128, BLOCK_K=64, SPLIT_K=split_k, num_warps=8, num_stages=1)
    y = ops.lora_linear_decode(x, W, b, A, B, 0.7, config=cfg)
    torch.testing.assert_close(y.double().cpu(), _reference(x, W, b, A, B, 0.7), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows_per_sample, config", [
    (1, None), (3, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=1))], ids=["decode", "split-k"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_mixed_adapters_in_one_kernel_equal_the_reference(rows_per_sample, config, dtype, tol):
    """Adapters of ranks 4, 8 and 5 stacked (R_max 8: rank G·R_max = 24, masked to a block of 32), rows of no
    adapter, an adapter twice, bias; fp32 adapters over the activations' dtype, as PEFT keeps them."""
    from sits_lora.ops import mixed_batch as mb

    gen = torch.Generator().manual_seed(0)
    K, N, ranks, scalings = 100, 40, [4, 8, 5], [2.0, 0.5, 1.25]
    As = [(torch.randn(r, K, generator=gen) / K**0.5).to(DEVICE) for r in ranks]
    Bs = [(torch.randn(N, r, generator=gen) / r**0.5).to(DEVICE) for r in ranks]
    samples = [2, -1, 0, 2, 1]
    plan = mb.mixed_batch_plan(samples, rows_per_sample, DEVICE)
    x = torch.randn(len(samples) * rows_per_sample, K, generator=gen).to(DEVICE, dtype)
    W = (torch.randn(N, K, generator=gen) / K**0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=gen).to(DEVICE, dtype)
    A, B, s = mb.stack_adapters(As, Bs, scalings)
    got = ops.lora_linear_decode_mixed(x, W, b, A, B, s, plan.row_adapter, config=config)
    base = x.double() @ W.double().t() + b.double()
    want = mb.lora_mixed_batch_reference(x.double(), base, [a.double() for a in As], [m.double() for m in Bs],
                                         scalings, plan.row_adapter)
    assert got.shape == (len(samples) * rows_per_sample, N) and got.dtype == dtype
    assert ((got.double() - want).norm() / want.norm()).item() < tol
    none = plan.row_adapter < 0
    torch.testing.assert_close(got[none].double(), base[none], rtol=tol, atol=tol)   # no adapter: the base output
    with pytest.raises(ValueError, match="4 row adapters for 5 rows"):
        ops.lora_linear_decode_mixed(x[:5], W, b, A, B, s, plan.row_adapter[:4])


@pytest.mark.parametrize("config", [None, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_warps=4, num_stages=1)],
                         ids=["default", "split-k"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_mixed_adapters_of_sibling_projections_in_one_kernel_equal_each_alone(config, dtype, tol):
    """Three projections of one x (widths 40, 24, 24: q / k / v), each with its own stacks of the same three adapters
    (ranks 4, 8, 5; each projection's own scalings): one launch equals each projection's mixed kernel alone."""
    from sits_lora.ops import mixed_batch as mb

    gen = torch.Generator().manual_seed(0)
    K, ranks = 100, [4, 8, 5]
    samples = [2, -1, 0, 2, 1]
    plan = mb.mixed_batch_plan(samples, 1, DEVICE)
    x = torch.randn(len(samples), K, generator=gen).to(DEVICE, dtype)
    siblings = []
    for i, N in enumerate((40, 24, 24)):
        As = [(torch.randn(r, K, generator=gen) / K**0.5).to(DEVICE, dtype) for r in ranks]
        Bs = [(torch.randn(N, r, generator=gen) / r**0.5).to(DEVICE, dtype) for r in ranks]
        W = (torch.randn(N, K, generator=gen) / K**0.5).to(DEVICE, dtype)
        siblings.append((W, None, *mb.stack_adapters(As, Bs, [2.0 + i, 0.5, 1.25 - i / 4])))
    got = ops.lora_linear_decode_mixed_siblings(x, siblings, plan.row_adapter, config=config)
    for y, (W, b, A, B, s) in zip(got, siblings):
        alone = ops.lora_linear_decode_mixed(x, W, b, A, B, s, plan.row_adapter, config=config)
        assert y.shape == alone.shape and y.is_contiguous()
        torch.testing.assert_close(y, alone, rtol=tol, atol=tol)
    wider = [(torch.randn(r, K, generator=gen) / K**0.5).to(DEVICE, dtype) for r in (4, 12, 5)]   # R_max 12, not 8
    other_rank = (siblings[1][0], None, *mb.stack_adapters(wider, [torch.randn(24, r, generator=gen).to(DEVICE, dtype)
                                                                   for r in (4, 12, 5)], [1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="same adapters at the same rank"):
        ops.lora_linear_decode_mixed_siblings(x, [siblings[0], other_rank], plan.row_adapter)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("shape", [(100, 40, 6), (72, 33, 16)], ids=["r6", "r16-odd-out"])
def test_the_one_row_kernel_equals_the_reference(split_k, shape):
    """GEMV=True: one row, products summed in registers; K = 100 / 72 in 32-blocks, N not a multiple of the tile,
    bias, fp32 and fp16 activations with fp32 adapters."""
    d_in, d_out, r = shape
    cfg = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k, num_warps=4, num_stages=1, GEMV=True)
    x, W, b, A, B = _problem(1, d_in, d_out, r, torch.float32, True)
    y = ops.lora_linear_decode(x, W, b, A, B, 1.3, config=cfg)
    torch.testing.assert_close(y.double().cpu(), _reference(x, W, b, A, B, 1.3), rtol=1e-5, atol=1e-5)
    x, W, b, A, B = _problem(1, d_in, d_out, r, torch.float16, True, torch.float32)
    y = ops.lora_linear_decode(x.reshape(1, 1, d_in), W, b, A, B, 1.3, config=cfg)
    assert y.shape == (1, 1, d_out) and y.dtype == torch.float16
    torch.testing.assert_close(y.reshape(1, d_out).double().cpu(), _reference(x, W, b, A, B, 1.3), rtol=2e-2,
                               atol=2e-2)
    with pytest.raises(ValueError, match="GEMV=True runs one row; this call has 2"):
        ops.lora_linear_decode(torch.cat([x, x]), W, b, A, B, 1.3, config=cfg)


def test_the_one_row_kernel_runs_only_where_a_measured_configuration_is_stored(monkeypatch):
    from sits_lora.ops import decode

    runs = []
    real = decode._gemv
    monkeypatch.setattr(decode, "_gemv", lambda *a: runs.append(a[0].shape) or real(*a))
    x, W, b, A, B = _problem(1, 64, 48, 8, torch.float32, False)
    ops.lora_linear_decode(x, W, b, A, B, 0.5)                 # none stored (and on a CPU never): the dot kernel
    assert runs == []
    asked = []
    stored = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
    monkeypatch.setattr(decode, "measured_config", lambda kernel, device, dims, dtype: asked.append((kernel, dims))
                        or stored)
    y = ops.lora_linear_decode(x, W, b, A, B, 0.5)
    ops.lora_linear_decode(torch.cat([x, x]), W, b, A, B, 0.5)   # two rows: never the one-row kernel
    assert runs == [(1, 64)] and asked == [("decode_gemv", (64, 48, 16))]
    torch.testing.assert_close(y.double().cpu(), _reference(x, W, b, A, B, 0.5), rtol=1e-5, atol=1e-5)


def _siblings(rows, d_in, widths, r, dtype, bias, adapter_dtype=None):
    """(x, [(W, b, A, B, s)] per sibling): projections of one input, as q / k / v or gate / up."""
    projections = []
    for i, d_out in enumerate(widths):
        x, W, b, A, B = _problem(rows, d_in, d_out, r, dtype, bias, adapter_dtype, seed=i)
        projections.append((W, b, A, B, 0.5 + i))
    return _problem(rows, d_in, 8, r, dtype, False, seed=9)[0], projections


@pytest.mark.parametrize("widths", [(40, 24, 24), (72, 33)], ids=["q-k-v", "gate-up-odd"])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("rows, bias", [(1, True), (17, False)], ids=["1-row-bias", "17-rows-nobias"])
def test_sibling_projections_in_one_kernel_equal_each_alone(widths, split_k, rows, bias):
    """Two or three projections of one x: widths that are not multiples of the 16-column tile (a sibling's last
    tile is part of one), split K summed into each sibling's own contiguous output; fp32 and fp16 activations."""
    cfg = dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k, num_warps=4, num_stages=1)
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
        x, projections = _siblings(rows, 100, widths, 6, dtype, bias, torch.float32 if dtype == torch.float32 else None)
        for order in (projections, projections[::-1]):     # siblings 1 and 2 before and after sibling 0 in memory
            ys = ops.lora_linear_decode_siblings(x, order, config=cfg)
            assert [y.shape for y in ys] == [(rows, W.shape[0]) for W, *_ in order]
            for y, (W, b, A, B, s) in zip(ys, order):
                assert y.dtype == dtype and y.is_contiguous()
                torch.testing.assert_close(y.double().cpu(), _reference(x, W, b, A, B, s), rtol=tol, atol=tol)


def test_siblings_that_cannot_share_a_kernel_are_told_apart():
    from sits_lora.ops.decode import siblings_fuse

    x, (q, k) = _siblings(3, 64, (32, 16), 4, torch.float32, False)
    assert siblings_fuse([q, k])
    other_rank = _siblings(3, 64, (16,), 8, torch.float32, False)[1][0]
    with_bias = _siblings(3, 64, (16,), 4, torch.float32, True)[1][0]
    transposed = (k[0].t().contiguous().t(), *k[1:])           # W of the same shape, column-major
    for odd in (other_rank, with_bias, transposed, (k[0].half(), *k[1:])):
        assert not siblings_fuse([q, odd])
        with pytest.raises(ValueError, match="share dtype, layout and rank"):
            ops.lora_linear_decode_siblings(x, [q, odd])


def test_more_rows_than_the_kernel_takes_are_refused():
    x, W, b, A, B = _problem(65, 32, 16, 4, torch.float32, False)
    with pytest.raises(ValueError, match="at most 64"):
        ops.lora_linear_decode(x, W, b, A, B, 1.0)


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _models(dtype=torch.float32, dropout=0.0):
    kernel = "triton"   # the decode kernel in fp32 on either device ("auto" takes the reference for fp32 on a GPU)
    ours = get_peft_model(tiny_llama(0), SitsLoraConfig(r=8, lora_alpha=16, lora_dropout=dropout,
                                                        target_modules=TARGETS, kernel=kernel))
    peft = get_peft_model(tiny_llama(0), LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        theirs = dict(peft.named_parameters())
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                theirs[n].copy_(p)
    return ours.to(DEVICE, dtype).eval(), peft.to(DEVICE, dtype).eval()


def _counting(monkeypatch):
    """The decode kernel's calls: (rows, how many projections the call computed)."""
    calls = []
    real, real_siblings = ops.lora_linear_decode, ops.lora_linear_decode_siblings
    monkeypatch.setattr(ops, "lora_linear_decode", lambda *a, **k: calls.append((a[0].shape[0], 1)) or real(*a, **k))
    monkeypatch.setattr(ops, "lora_linear_decode_siblings",
                        lambda *a, **k: calls.append((a[0].shape[0], len(a[1]))) or real_siblings(*a, **k))
    return calls


def test_a_decode_step_runs_one_kernel_per_sibling_group_and_equals_peft(monkeypatch):
    """Per layer: q / k / v in one kernel, gate / up in one, o and down alone: 4 launches for 7 projections."""
    calls = _counting(monkeypatch)
    ours, peft = _models()
    ids = torch.randint(0, 97, (3, 1), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, peft(input_ids=ids).logits
    assert calls == [(3, 3), (3, 1), (3, 2), (3, 1)] * 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_siblings_decode_alone_when_one_cannot_take_the_kernel(monkeypatch):
    """k_proj's adapter on another rank than q / v (rank_pattern): the group's kernel cannot take the three, and
    each projection runs its own; a group told apart by its parent (one sibling called with another tensor) too."""
    calls = _counting(monkeypatch)
    ours = get_peft_model(tiny_llama(0), SitsLoraConfig(r=8, target_modules=TARGETS, kernel="triton",
                                                        rank_pattern={"k_proj": 4}, init_lora_weights=False)).eval()
    ours = ours.to(DEVICE)
    ids = torch.randint(0, 97, (2, 1), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        got = ours(input_ids=ids).logits
        assert calls[:5] == [(2, 1)] * 3 + [(2, 1), (2, 2)]
        with ours.disable_adapter():
            base = ours(input_ids=ids).logits
    assert not torch.allclose(got, base)


def test_calls_that_are_not_decode_steps_take_the_other_paths(monkeypatch):
    calls = _counting(monkeypatch)
    ours, _ = _models()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)   # 80 rows: a prefill
    with torch.no_grad():
        ours(input_ids=ids)
    ours(input_ids=ids[:, :1])                               # gradients enabled (a training step's forward)
    ops.set_decode_kernel(False)
    try:
        with torch.no_grad():
            ours(input_ids=ids[:, :1])
    finally:
        ops.set_decode_kernel(True)
    assert calls == []
    ours, _ = _models(dropout=0.1)
    ours.train()                                             # active dropout: the LoRA input is not x
    with torch.no_grad():
        ours(input_ids=ids[:, :1])
    assert calls == []


def test_a_configuration_is_cut_to_the_shared_memory_budget():
    from sits_lora.ops.decode import fitted

    big = dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)
    assert fitted(big, 16, 16, 2, 4) == big                                  # 16 rows, r16, fp32 adapters: fits
    cut = fitted(big, 64, 64, 2, 4)                                           # 64 rows, r64: what failed on the H200
    assert cut["BLOCK_K"] * (64 * 2 + 32 * 2 + 64 * 4) * cut["num_stages"] <= 160 * 1024
    assert cut["BLOCK_N"] == 32 and cut["num_warps"] == 4 and big["BLOCK_K"] == 256


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32, 64])
@pytest.mark.parametrize("shape", [(2048, 512, 16), (2048, 8192, 16), (8192, 2048, 16), (4096, 1024, 64)])
def test_on_a_gpu_bf16_decode_kernel_at_llama_shapes(rows, shape):
    d_in, d_out, r = shape
    x, W, b, A, B = _problem(rows, d_in, d_out, r, torch.bfloat16, False, torch.float32)
    y = ops.lora_linear_decode(x, W, b, A, B, 2.0)
    want = _reference(x, W, b, A, B, 2.0)
    err = (y.double().cpu() - want).norm() / want.norm()
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32])
@pytest.mark.parametrize("widths", [(2048, 512, 512), (8192, 8192), (4096, 1024, 1024)], ids=["1b-qkv", "1b-gate-up",
                                                                                                "8b-qkv"])
def test_on_a_gpu_bf16_sibling_decode_at_llama_shapes(rows, widths):
    """The tuned configuration at each group's total width (split K or not), bf16 adapter copies as the layers pass."""
    x, projections = _siblings(rows, 4096 if widths[0] == 4096 else 2048, widths, 16, torch.bfloat16, False)
    ys = ops.lora_linear_decode_siblings(x, projections)
    for y, (W, b, A, B, s) in zip(ys, projections):
        want = _reference(x, W, b, A, B, s)
        err = (y.double().cpu() - want).norm() / want.norm()
        assert y.shape == (rows, W.shape[0]) and err < 1e-2, err


def test_half_precision_decode_steps_read_adapter_copies_made_again_when_written(monkeypatch):
    """fp32 adapters over an fp16 base (PEFT's default): the kernel gets copies in fp16, made once and made again
    in their memory when a weight is written; the outputs stay PEFT's."""
    from sits_lora.utils.cast_copies import kept_cast_copies

    seen = []
    real, real_siblings = ops.lora_linear_decode, ops.lora_linear_decode_siblings
    monkeypatch.setattr(ops, "lora_linear_decode", lambda *a, **k: seen.append((a[3], a[4])) or real(*a, **k))
    monkeypatch.setattr(ops, "lora_linear_decode_siblings", lambda x, siblings, **k: seen.extend(
        s[2:4] for s in siblings) or real_siblings(x, siblings, **k))
    ours, peft = _models()
    for model in (ours, peft):
        model.half()
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
    ids = torch.randint(0, 97, (3, 1), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, peft(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert len(seen) == 2 * len(TARGETS) and all(A.dtype == B.dtype == torch.float16 for A, B in seen)
    layer = ours.base_model.model.model.layers[0].self_attn.q_proj
    A_first = seen[0][0]
    assert any(copies[0] is A_first for copies in kept_cast_copies([layer]))
    with torch.no_grad():
        for model in (ours, peft):
            model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.mul_(3)
        seen.clear()
        got, want = ours(input_ids=ids).logits, peft(input_ids=ids).logits
    assert seen[0][0] is A_first                                          # the same memory, read again
    torch.testing.assert_close(seen[0][1], layer.lora_B["default"].weight.half())
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_decode_steps_of_weights_cast_under_inference_mode_equal_peft():
    """fp32 adapters over an fp16 base, all made under torch.inference_mode (no version counters): the kernels read
    the adapters as they are, and decoding in inference mode, then under no_grad, equals PEFT."""
    ours, peft = _models()
    ids = torch.randint(0, 97, (3, 1), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.inference_mode():
        for model in (ours, peft):
            model.half()
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.float()
        got, want = ours(input_ids=ids).logits, peft(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        got = ours(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
