"""TokenEntropySampler: per-token base-model entropy in one cached pass, and the entropy probes it fits."""

from __future__ import annotations

import math

import pytest
import torch
from peft import get_peft_model

from sits_lora import DynamicRankLinear, SitsLoraConfig, TokenEntropySampler
from sits_lora.dynamic_rank.sampler import model_fingerprint, token_entropy

from conftest import randomize_lora_weights, tiny_llama


def _data(n=10, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 97, (seq - i % 3,), generator=g).tolist()} for i in range(n)]


def _gated_model():
    config = SitsLoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dynamic_rank=True,
                            rank_scheduler="entropy-gated", rank_buckets=[2, 4, 8], target_mean_rank=4)
    model = get_peft_model(tiny_llama(), config)
    randomize_lora_weights(model)  # the pass must see the base model, not these adapter weights
    return model


def _count_forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


def test_entropies_are_the_base_models_and_probes_get_fitted(tmp_path):
    model = _gated_model()
    data = _data()
    sampler = TokenEntropySampler(model, batch_size=4, cache_dir=tmp_path, progress=False)
    annotated = sampler.annotate(data)
    assert sampler.last_cache_hit is False
    base = tiny_llama()
    for row in annotated[:3]:
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            expected = token_entropy(base(input_ids=ids).logits[0])
        assert len(row["token_entropy"]) == len(row["input_ids"])
        torch.testing.assert_close(torch.tensor(row["token_entropy"]), expected, rtol=1e-4, atol=1e-5)
        assert all(0 <= h <= math.log(97) + 1e-4 for h in row["token_entropy"])
    probes = [p for m in model.modules() if isinstance(m, DynamicRankLinear) for p in m.lora_entropy_probe.values()]
    assert len(probes) == 4 and all(bool(p.fitted) for p in probes)
    assert all(not p.requires_grad for probe in probes for p in probe.parameters())
    report = sampler.probe_report
    assert set(report["r2_per_layer"]) == {f"model.layers.{i}.{n}:default" for i in (0, 1)
                                           for n in ("self_attn.q_proj", "mlp.down_proj")}
    assert all(math.isfinite(v) for v in report["r2_per_layer"].values())
    assert report["entropy_std"] > 0
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([data[0]["input_ids"]]))  # routes: the probes are fitted


def test_cache_hit_skips_the_pass_and_restores_the_probes(tmp_path):
    data = _data()
    first_model = _gated_model()
    first = TokenEntropySampler(first_model, batch_size=4, cache_dir=tmp_path, progress=False)
    expected = first.entropies(data)
    assert first.last_cache_hit is False and first.cache_path.exists()
    fitted = {n: p.clone() for n, p in first_model.named_parameters() if "lora_entropy_probe" in n}

    second_model = _gated_model()  # fresh, unfitted probes; same base weights
    calls, handle = _count_forwards(second_model)
    second = TokenEntropySampler(second_model, batch_size=4, cache_dir=tmp_path, progress=False)
    again = second.entropies(data)
    handle.remove()
    assert second.last_cache_hit is True and calls == []
    assert second.cache_path == first.cache_path
    for a, b in zip(again, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for n, p in second_model.named_parameters():
        if "lora_entropy_probe" in n:
            torch.testing.assert_close(p, fitted[n], rtol=0, atol=0)
    assert second.probe_report == first.probe_report

    other = TokenEntropySampler(second_model, batch_size=4, cache_dir=tmp_path, progress=False)
    other.entropies(_data(seed=1))  # other data: a miss
    assert other.last_cache_hit is False and other.cache_path != first.cache_path
    plain = TokenEntropySampler(tiny_llama(), batch_size=4, cache_dir=tmp_path, progress=False)
    plain.entropies(data)  # the plain base model has no probes: another key
    assert plain.last_cache_hit is False
    changed = tiny_llama(seed=1)
    assert model_fingerprint(changed) != model_fingerprint(tiny_llama())
    assert model_fingerprint(first_model) == model_fingerprint(tiny_llama())  # adapters are not part of the key


def test_annotate_adds_a_column_to_a_datasets_dataset(tmp_path):
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": [r["input_ids"] for r in _data(n=5)]})
    out = TokenEntropySampler(tiny_llama(), batch_size=2, cache_dir=tmp_path, progress=False).annotate(data)
    assert out.column_names == ["input_ids", "token_entropy"]
    assert [len(e) for e in out["token_entropy"]] == [len(i) for i in out["input_ids"]]


def test_sampler_refuses_bad_input(tmp_path):
    sampler = TokenEntropySampler(tiny_llama(), cache_dir=tmp_path, progress=False, max_length=8)
    with pytest.raises(ValueError, match="pass the tokenizer"):
        sampler.entropies([{"text": "hello"}])
    with pytest.raises(ValueError, match="example 0 has 12 tokens, more than max_length=8"):
        sampler.entropies(_data(n=1))
    with pytest.raises(ValueError, match="example 0 has neither 'input_ids' nor 'text'"):
        sampler.entropies([{"labels": [1, 2]}])
    with pytest.raises(ValueError, match=r"TokenEntropySampler\(batch_size=0\) is invalid: it must be a positive integer"):
        TokenEntropySampler(tiny_llama(), batch_size=0)
