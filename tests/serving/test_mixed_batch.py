"""Several adapters in one batch (PEFT's ``adapter_names``) on sits_lora's segmented kernels: the kernels against
the reference on odd shapes and ranks, and a model's logits and greedy generation against PEFT's mixed batch (on the
CPU under the Triton interpreter, kernel="triton"; on a GPU in bf16 with kernel="auto")."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama
from peft import LoraConfig, get_peft_model

from sits_lora import SitsLoraConfig
from sits_lora.ops import mixed_batch as mb

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, rank, alpha): ranks differ, so the stacks are zero-padded to the largest
ADAPTERS = [("cats", 4, 8), ("dogs", 8, 32), ("owls", 16, 16)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3), pytest.param(
    torch.bfloat16, 2e-2, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's bf16 is "
                                                   "wrong on the CPU (shared/TESTING.md)"))])
@pytest.mark.parametrize("rows_per_sample", [1, 7])
def test_kernels_equal_the_reference(dtype, tol, rows_per_sample):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    K, N = 48, 80
    As = [torch.randn(r, K, generator=gen) * 0.2 for _, r, _ in ADAPTERS]
    Bs = [torch.randn(N, r, generator=gen) * 0.2 for _, r, _ in ADAPTERS]
    scalings = [alpha / r for _, r, alpha in ADAPTERS]
    # sample adapters: none, repeats (adapter 2 gets 3 samples: 21 rows, two blocks at 7 rows a sample)
    samples = [2, -1, 0, 2, 1, 2]
    rows = len(samples) * rows_per_sample
    x = torch.randn(rows, K, generator=gen).to(device, dtype)
    y = torch.randn(rows, N, generator=gen).to(device, dtype)
    As, Bs = [a.to(device) for a in As], [b.to(device) for b in Bs]
    plan = mb.mixed_batch_plan(samples, rows_per_sample, device)
    A, B, s = mb.stack_adapters(As, Bs, scalings)
    got = mb.lora_mixed_batch_triton(x, y.clone(), A, B, s, plan)
    want = mb.lora_mixed_batch_reference(x.float(), y.float(), As, Bs, scalings, plan.row_adapter)
    assert ((got.float() - want).norm() / want.norm()).item() < tol
    untouched = plan.row_adapter < 0
    assert torch.equal(got[untouched], y[untouched])          # "__base__" rows keep the base output exactly


def test_plan_groups_rows_by_adapter_in_blocks_of_one_adapter():
    plan = mb.mixed_batch_plan([1, 0, -1, 1], 10, "cpu")
    assert plan.order.tolist() == list(range(10, 20)) + list(range(0, 10)) + list(range(30, 40))
    assert plan.blocks.tolist() == [[0, 10, 0], [10, 26, 1], [26, 30, 1]]
    assert plan.row_adapter.tolist() == [1] * 10 + [0] * 10 + [-1] * 10 + [1] * 10


def _models(kernel: str, dtype, device):
    """(sits model, PEFT model) over one tiny Llama, with the same three adapters."""
    base = tiny_llama(0)
    models = []
    for config_cls, extra in ((SitsLoraConfig, {"kernel": kernel}), (LoraConfig, {})):
        model = None
        for name, r, alpha in ADAPTERS:
            config = config_cls(r=r, lora_alpha=alpha, target_modules=TARGETS, **extra)
            if model is None:
                model = get_peft_model(copy.deepcopy(base), config, adapter_name=name)
            else:
                model.add_adapter(name, config)
        models.append(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        sits_params = dict(models[0].named_parameters())
        for n, p in models[1].named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
                sits_params[n].copy_(p)
    return [m.to(device, dtype).eval() for m in models]


def _count_kernel_calls(monkeypatch, launches: list | None = None) -> dict:
    """Projections computed by the segmented kernels (base GEMM, shrink, expand) and by the one-kernel decode path
    (one projection a call, or a sibling group's), by name; ``launches`` gets each decode kernel's projection count."""
    from sits_lora import ops

    calls = {"segmented": 0, "decode": 0}
    paths = (("segmented", mb, "lora_mixed_batch_triton", lambda args: 1),
             ("decode", ops, "lora_linear_decode_mixed", lambda args: 1),
             ("decode", ops, "lora_linear_decode_mixed_siblings", lambda args: len(args[1])))
    for name, module, attr, projections in paths:
        real = getattr(module, attr)

        def counting(*args, _real=real, _name=name, _projections=projections, **kwargs):
            calls[_name] += _projections(args)
            if _name == "decode" and launches is not None:
                launches.append(_projections(args))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, attr, counting)
    return calls


def _case():
    """fp32 on the kernels (exact products: generation compares token for token); bf16: the test below."""
    return "triton", torch.float32, "cuda" if torch.cuda.is_available() else "cpu", 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_mixed_batch_on_the_gpu_is_within_rounding_of_peft(monkeypatch):
    sits, peft_model = _models("auto", torch.bfloat16, "cuda")
    calls = _count_kernel_calls(monkeypatch)
    ids = torch.randint(0, 97, (6, 17), generator=torch.Generator().manual_seed(5)).cuda()
    names = ["owls", "dogs", "__base__", "cats", "owls", "owls"]
    with torch.no_grad():
        got = sits(input_ids=ids, adapter_names=names).logits.float()
        want = peft_model(input_ids=ids, adapter_names=names).logits.float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    assert calls == {"segmented": 2 * len(TARGETS), "decode": 0}   # 102 rows: above the decode path's 64


@pytest.mark.parametrize("tokens, path", [(9, "decode"), (13, "segmented")], ids=["45-rows", "65-rows"])
def test_a_mixed_batch_equals_peft_and_runs_one_kernel_pass_per_layer(monkeypatch, tokens, path):
    """At most 64 rows (a decode step's batch) run the one-kernel decode path, more the segmented kernels."""
    kernel, dtype, device, tol = _case()
    sits, peft_model = _models(kernel, dtype, device)
    launches = []
    calls = _count_kernel_calls(monkeypatch, launches)
    ids = torch.randint(0, 97, (5, tokens), generator=torch.Generator().manual_seed(2)).to(device)
    names = ["dogs", "__base__", "cats", "owls", "dogs"]
    with torch.no_grad():
        got = sits(input_ids=ids, adapter_names=names).logits.float()
        want = peft_model(input_ids=ids, adapter_names=names).logits.float()
    assert ((got - want).norm() / want.norm()).item() < tol
    # every adapted layer of both decoder layers, once, on one path
    assert calls == {"segmented": 0, "decode": 0, path: 2 * len(TARGETS)}
    if path == "decode":   # q / k / v in one kernel, o, gate / up in one, down: 4 launches a layer
        assert launches == [3, 1, 2, 1] * 2
    # each sample alone with its adapter, as set_adapter gives it
    with torch.no_grad():
        for i, name in enumerate(names):
            if name == "__base__":
                with sits.disable_adapter():
                    alone = sits(input_ids=ids[i:i + 1]).logits.float()
            else:
                sits.set_adapter(name)
                alone = sits(input_ids=ids[i:i + 1]).logits.float()
            assert ((got[i:i + 1] - alone).norm() / alone.norm()).item() < tol


def test_generation_with_adapter_names_equals_peft():
    kernel, dtype, device, _ = _case()
    sits, peft_model = _models(kernel, dtype, device)
    ids = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(3)).to(device)
    names = ["owls", "cats", "__base__"]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = sits.generate(input_ids=ids, adapter_names=names, **kwargs)
        want = peft_model.generate(input_ids=ids, adapter_names=names, **kwargs)
    assert torch.equal(got, want)


def test_adapter_weights_written_in_place_are_seen():
    kernel, dtype, device, tol = _case()
    sits, peft_model = _models(kernel, dtype, device)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4)).to(device)
    names = ["cats", "dogs"]
    with torch.no_grad():
        sits(input_ids=ids, adapter_names=names)                   # stacks made
        for model in (sits, peft_model):
            for n, p in model.named_parameters():
                if "lora_B.dogs" in n:
                    p.mul_(-3.0)
        got = sits(input_ids=ids, adapter_names=names).logits.float()
        want = peft_model(input_ids=ids, adapter_names=names).logits.float()
    assert ((got - want).norm() / want.norm()).item() < tol


def test_peft_refusals_stay():
    kernel, dtype, device, _ = _case()
    sits, _ = _models(kernel, dtype, device)
    ids = torch.zeros(2, 4, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="non-existing adapter"):
        sits(input_ids=ids, adapter_names=["cats", "nope"])
    sits.train()
    with pytest.raises(ValueError, match="training mode"):
        sits(input_ids=ids, adapter_names=["cats", "dogs"])


def test_generation_with_an_unmerged_adapter_equals_the_merged_model():
    kernel, dtype, device, _ = _case()
    sits, _ = _models(kernel, dtype, device)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(6)).to(device)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for name, _, _ in ADAPTERS:
            sits.set_adapter(name)
            unmerged = sits.generate(input_ids=ids, **kwargs)
            sits.merge_adapter([name])
            merged = sits.generate(input_ids=ids, **kwargs)
            sits.unmerge_adapter()
            assert torch.equal(unmerged, merged), name
            # and the same adapter named for every sample of a mixed batch
            assert torch.equal(sits.generate(input_ids=ids, adapter_names=[name, name], **kwargs), merged), name


def test_mixed_decode_of_sibling_groups_follows_each_projections_own_adapters(monkeypatch):
    """Per-projection alphas (alpha_pattern: each sibling its own scalings) share the group's kernel and equal PEFT;
    a k_proj whose largest rank differs (rank_pattern) cannot share the stacks' layout, and q / k / v then run one
    kernel each."""
    kernel, dtype, device, tol = _case()
    for pattern, groups in (({"alpha_pattern": {"k_proj": 64}}, [3, 1, 2, 1]),
                            ({"rank_pattern": {"k_proj": 32}}, [1, 1, 1, 1, 2, 1])):
        base = tiny_llama(0)
        models = []
        for config_cls, extra in ((SitsLoraConfig, {"kernel": kernel}), (LoraConfig, {})):
            model = None
            for name, r, alpha in ADAPTERS:
                config = config_cls(r=r, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False,
                                    **pattern, **extra)
                if model is None:
                    model = get_peft_model(copy.deepcopy(base), config, adapter_name=name)
                else:
                    model.add_adapter(name, config)
            models.append(model)
        models[1].load_state_dict(models[0].state_dict())
        sits, peft_model = (m.to(device, dtype).eval() for m in models)
        launches = []
        _count_kernel_calls(monkeypatch, launches)
        ids = torch.randint(0, 97, (3, 1), generator=torch.Generator().manual_seed(2)).to(device)
        names = ["owls", "cats", "owls"]
        with torch.no_grad():
            got = sits(input_ids=ids, adapter_names=names).logits.float()
            want = peft_model(input_ids=ids, adapter_names=names).logits.float()
        assert ((got - want).norm() / want.norm()).item() < tol, pattern
        assert launches == groups * 2, pattern
        monkeypatch.undo()
