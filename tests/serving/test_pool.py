"""AdapterPool: adapters of different ranks and scalings served from two slots give their own outputs, the least
recently used slot is taken, a prefetch never evicts the batch just handed out, and every refusal names the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama
from peft import get_peft_model

from sits_lora import AdapterPool, SitsLoraConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rsLoRA)
SAVED = {"r4": (4, 8, False), "r8": (8, 32, True), "r16": (16, 16, False)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each adapter saved alone, as save_pretrained writes it."""
    base = tiny_llama(0)
    out = {}
    for i, (name, (r, alpha, rslora)) in enumerate(SAVED.items()):
        model = get_peft_model(copy.deepcopy(base), SitsLoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora,
                                                                    target_modules=TARGETS))
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    return out


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _reference(folders, dtype=torch.float32):
    """Every adapter loaded natively (PEFT's load_adapter): what the pool must reproduce."""
    model = None
    for name, folder in folders.items():
        if model is None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(tiny_llama(0), folder, adapter_name=name)
        else:
            model.load_adapter(folder, adapter_name=name)
    return model.to(_device(), dtype).eval()


def _pooled(folders, capacity=2, dtype=torch.float32, kernel="auto"):
    host = get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, target_modules=TARGETS, kernel=kernel))
    host = host.to(_device(), dtype).eval()
    pool = AdapterPool(host, capacity=capacity, max_rank=16)
    for name, folder in folders.items():
        pool.add(name, folder)
    return host, pool


def _logits(model, ids, names):
    with torch.no_grad():
        return model(input_ids=ids, adapter_names=names).logits.float()


def _close(a, b, tol):
    return ((a - b).norm() / b.norm()).item() < tol


@pytest.mark.parametrize("kernel", ["auto", "triton"])   # on the CPU: PEFT's loop, and the mixed-batch kernels
def test_pooled_adapters_give_their_own_outputs(folders, kernel, monkeypatch):
    from sits_lora import ops
    from sits_lora.ops import mixed_batch as mb

    calls = []
    real = mb.lora_mixed_batch_triton
    monkeypatch.setattr(mb, "lora_mixed_batch_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_decode = ops.lora_linear_decode_mixed   # 21 rows: the one-kernel decode path takes them
    monkeypatch.setattr(ops, "lora_linear_decode_mixed", lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    reference = _reference(folders)
    model, pool = _pooled(folders, kernel=kernel)
    ids = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(1)).to(_device())
    for names in (["r4", "__base__", "r16"], ["r8", "r8", "r4"], ["r16", "r8", "__base__"]):
        assert _close(_logits(model, ids, pool.slots_for(names)), _logits(reference, ids, names), 1e-5), names
    assert pool.stats["evictions"] >= 2 and pool.stats["bytes_copied"] > 0
    assert bool(calls) == (kernel == "triton")      # fp32 with kernel="auto" is the reference path anywhere


def test_the_least_recently_used_slot_is_taken_and_a_prefetch_keeps_the_batch_handed_out(folders):
    _, pool = _pooled(folders)
    pool.slots_for(["r4"])
    pool.slots_for(["r8"])
    assert list(pool.resident) == ["r4", "r8"]
    pool.slots_for(["r16", "__base__"])                          # r4 was the least recently used
    assert list(pool.resident) == ["r8", "r16"] and pool.stats["evictions"] == 1
    assert pool.prefetch("r4") is not None                       # takes r8's slot, not r16's (the last batch)
    assert list(pool.resident) == ["r16", "r4"]
    assert pool.slots_for(["r4", "r16"]) == [pool.resident["r4"], pool.resident["r16"]]
    assert pool.stats["hits"] == 2
    assert pool.prefetch("r8") is None and pool.stats["prefetch_skipped"] == 1   # both slots hold the last batch
    assert pool.prefetch("r16") == pool.resident["r16"]          # resident: only marked as used
    assert pool.stats == {"hits": 3, "loads": 4, "evictions": 2, "bytes_copied": pool.stats["bytes_copied"],
                          "prefetch_skipped": 1}


def test_refusals_name_the_fix(folders):
    model, pool = _pooled(folders, capacity=2)
    with pytest.raises(KeyError, match=r"no adapter named 'nope' in the pool .*pool.add\('nope', folder\)"):
        pool.slots_for(["r4", "nope"])
    with pytest.raises(ValueError, match="names 3 adapters and the pool has 2 slots"):
        pool.slots_for(["r4", "r8", "r16"])
    with pytest.raises(ValueError, match="'r4' is in the pool already"):
        pool.add("r4", folders["r4"])
    with pytest.raises(ValueError, match="cannot name an adapter"):
        pool.add("__base__", folders["r4"])
    with pytest.raises(ValueError, match="a state dict needs its config"):
        pool.add("x", {})
    with pytest.raises(FileNotFoundError, match="is not a folder that save_pretrained wrote"):
        pool.add("x", "/nonexistent/adapter")
    small = AdapterPool(get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, target_modules=TARGETS)), max_rank=8)
    with pytest.raises(ValueError, match=r"rank 16 at .* above the pool's max_rank=8; build the pool with max_rank=16"):
        small.add("r16", folders["r16"])
    with pytest.raises(ValueError, match=r"AdapterPool\(capacity=0\) is invalid: it must be a positive integer \(GPU slots\)"):
        AdapterPool(model, capacity=0)
    with pytest.raises(ValueError, match="already has adapters named"):
        AdapterPool(model)
    with pytest.raises(TypeError, match="needs a PeftModel"):
        AdapterPool(tiny_llama(0))
    narrow = AdapterPool(get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, target_modules=["q_proj"])))
    with pytest.raises(ValueError, match="adapts 12 layer\\(s\\) the pool's slots do not cover"):
        narrow.add("r4", folders["r4"])
    pool.remove("r8")
    assert pool.names == ["r4", "r16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_pooled_bf16_batches_run_the_mixed_kernels_and_match(folders, monkeypatch):
    from sits_lora import ops
    from sits_lora.ops import mixed_batch as mb

    calls = []
    real = mb.lora_mixed_batch_triton
    monkeypatch.setattr(mb, "lora_mixed_batch_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_decode = ops.lora_linear_decode_mixed   # 21 rows: the one-kernel decode path takes them
    monkeypatch.setattr(ops, "lora_linear_decode_mixed", lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    reference = _reference(folders, torch.bfloat16)
    model, pool = _pooled(folders, capacity=3, dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (4, 9), generator=torch.Generator().manual_seed(2)).cuda()
    pool.slots_for(["r4", "r8"])
    assert pool.prefetch("r16") is not None                      # into the free slot, on the side stream
    for names in (["r16", "r4", "__base__", "r16"], ["r8", "r16", "r8", "__base__"]):
        assert _close(_logits(model, ids, pool.slots_for(names)), _logits(reference, ids, names), 2e-2), names
    assert calls


def test_a_swaps_stall_is_predicted_from_its_bytes_and_measured_as_zero_on_the_cpu(folders):
    model, pool = _pooled(folders)
    r, K_N = SAVED["r8"][0], 0
    for layer in pool.layers.values():
        K_N += layer.in_features + layer.out_features
    assert pool.adapter_bytes("r8") == r * K_N * 4                       # fp32 A (r, K) and B (N, r) on every layer
    copy_ms = pool.adapter_bytes("r8") / 1e9 * 1e3                        # at 1 GB/s
    assert pool.predicted_stall_ms("r8", bandwidth=1e9) == pytest.approx(copy_ms)
    assert pool.predicted_stall_ms("r8", overlap_ms=copy_ms / 2, bandwidth=1e9) == pytest.approx(copy_ms / 2)
    assert pool.predicted_stall_ms("r8", overlap_ms=10 * copy_ms, bandwidth=1e9) == 0.0
    with pytest.raises(ValueError, match="pass bandwidth="):
        pool.predicted_stall_ms("r8")
    pool.slots_for(["r8", "r4"])
    assert pool.measured_stall_ms() == 0.0 and pool.stats["stall_ms"] == 0.0


@pytest.mark.gpu
def test_on_a_gpu_an_unprefetched_swap_is_measured_and_predicted(folders):
    model, pool = _pooled(folders, capacity=1, dtype=torch.bfloat16)
    pool.slots_for(["r4"])
    pool.slots_for(["r16"])                       # not prefetched: the current stream waits for the copy
    assert pool.measured_stall_ms() >= 0.0 and "stall_ms" in pool.stats
    assert pool.predicted_stall_ms("r16") > 0.0   # the measured pinned bandwidth
