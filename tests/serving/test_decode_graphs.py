"""graph_decode: decode steps recorded as CUDA graphs. CPU: what a signature is made of (the static cache by address,
PEFT's mixed-batch names, the tokens fed), what the recorder refuses, and the mixed-batch stacks it relies on being
refreshed in place. GPU: greedy generation with replayed steps gives eager generation's tokens and scores for one
adapter, another adapter, a mixed batch, a merged adapter and the base, across requests on one cache."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_llama, tiny_llama_config
from peft import get_peft_model

from sits_lora import SitsLoraConfig, graph_decode
from sits_lora.serving import mixed_batch
from sits_lora.serving.graphs import _CACHE, _batch_adapter_names, _cache_key, _new_tokens, _without_cache
from sits_lora.utils.cuda_graphs import NotGraphable, copy_output

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _two_adapters(dtype=torch.float32, device="cpu", kernel="auto"):
    model = get_peft_model(tiny_llama(0), SitsLoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, kernel=kernel),
                           adapter_name="one")
    model.add_adapter("two", SitsLoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, kernel=kernel))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(device, dtype).eval()


def _static_cache(max_len=40):
    from transformers import StaticCache

    return StaticCache(config=tiny_llama_config(), max_cache_len=max_len)


def test_a_static_cache_is_described_by_its_addresses_and_a_growing_one_is_refused():
    from transformers import DynamicCache

    with pytest.raises(NotGraphable, match='cache_implementation="static"'):
        _cache_key(DynamicCache())
    cache = _static_cache()
    with pytest.raises(NotGraphable, match="not yet filled"):
        _cache_key(cache)
    model = tiny_llama(0)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), **{_cache_kwarg(model): cache}, use_cache=True)
    with pytest.raises(NotGraphable, match="off the GPU"):    # what a CPU model fills; the recorder needs CUDA
        _cache_key(cache)


def _cache_kwarg(model):
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def test_the_tokens_fed_are_read_from_input_ids_or_embeddings():
    assert _new_tokens((torch.zeros(4, 1, dtype=torch.long),), {}) == 1
    assert _new_tokens((), {"input_ids": torch.zeros(2, 7, dtype=torch.long)}) == 7
    assert _new_tokens((), {"input_ids": None, "inputs_embeds": torch.zeros(2, 1, 8)}) == 1
    assert _new_tokens((), {}) is None


def test_peft_mixed_batch_names_are_part_of_the_signature():
    model = _two_adapters()
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert _batch_adapter_names(layers) is None
    with model._enable_peft_forward_hooks(adapter_names=["one", "two", "__base__"]):
        assert _batch_adapter_names(layers) == ("one", "two", "__base__")
    assert _batch_adapter_names(layers) is None


def test_a_returned_cache_is_the_callers_not_the_recorded_one():
    recorded, current = object(), object()
    out = {"logits": torch.ones(2, 3), "cache": recorded}
    copied = copy_output(out, {id(recorded): current})
    assert copied["cache"] is current and copied["logits"] is not out["logits"]
    with pytest.raises(NotGraphable):
        copy_output(out)


def test_a_recorded_output_holds_a_marker_not_the_cache():
    """A recording that held the cache would keep its memory taken: the next request's cache would land elsewhere
    and record again."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    cache, other = _static_cache(), _static_cache()
    out = CausalLMOutputWithPast(logits=torch.ones(1, 1, 4), past_key_values=cache)
    stored = _without_cache(out, cache)
    assert stored.past_key_values is _CACHE and stored.logits is out.logits
    assert copy_output(stored, {id(_CACHE): other}).past_key_values is other
    assert _without_cache((out.logits, cache), cache)[1] is _CACHE


def test_mixed_batch_stacks_are_refreshed_in_place_and_kept_by_a_recording():
    """A weight written in place (as AdapterPool does) gives new stacks in the old memory: a recorded graph that
    reads them sees the new adapter after the next eager call."""
    model = _two_adapters(kernel="triton")
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(1))
    names = ["one", "two", "one"]
    with torch.no_grad():
        model(input_ids=ids, adapter_names=names)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    order = ("one", "two")
    A, B, scalings = mixed_batch._stacks(layer, order)
    A16 = mixed_batch._stacks(layer, order, torch.float16)[0]    # what a half-precision decode step reads
    kept = mixed_batch.buffers_in_use([layer])
    assert any(entry[0] is A for entry in kept if isinstance(entry, tuple))
    assert any(entry[0] is A16 for entry in kept if isinstance(entry, tuple))
    with torch.no_grad():
        layer.lora_A["two"].weight.mul_(2)
        model(input_ids=ids, adapter_names=names)                  # asks for the adapters' dtype only
    assert mixed_batch._stacks(layer, order)[0] is A and mixed_batch._stacks(layer, order, torch.float16)[0] is A16
    two = order.index("two")
    torch.testing.assert_close(A[two, :4], layer.lora_A["two"].weight)   # new values, in the same memory
    torch.testing.assert_close(A16[two, :4], layer.lora_A["two"].weight.half())
    assert A16.dtype == torch.float16 and mixed_batch._stacks(layer, order)[2].dtype == torch.float32


def test_refusals_name_the_fix():
    model = _two_adapters()
    with pytest.raises(ValueError, match=r"model.to\('cuda'\)"):
        graph_decode(model)
    with pytest.raises(ValueError, match=r"graph_decode\(max_tokens=.*\) is invalid: it must be a positive integer"):
        graph_decode(model, max_tokens=0)
    with pytest.raises(TypeError, match="not a transformers causal LM"):
        graph_decode(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------------- the GPU
def _generate(model, ids, cache=None, **kwargs):
    extra = {_cache_kwarg(model.get_base_model() if hasattr(model, "get_base_model") else model): cache} \
        if cache is not None else {"cache_implementation": "static"}
    if cache is not None:
        cache.reset()
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True, **extra, **kwargs)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.gpu
def test_on_a_gpu_replayed_decoding_gives_eager_tokens_and_scores(caplog):
    model = _two_adapters(torch.bfloat16, "cuda")
    ids = torch.randint(3, 97, (4, 6), generator=torch.Generator().manual_seed(5)).cuda()
    cache = _static_cache(max_len=16)
    graphs = graph_decode(model)
    cases = [("one", None), ("two", None), ("one", ["one", "two", "__base__", "two"])]
    for adapter, names in cases:
        model.set_adapter(adapter)
        kwargs = {"adapter_names": names} if names else {}
        graphs.active = False
        eager = _generate(model, ids, cache, **kwargs)
        graphs.active = True
        recordings = graphs.recordings
        for _ in range(2):                                     # the first request records, the second replays
            replays = graphs.replays
            replayed = _generate(model, ids, cache, **kwargs)
            assert torch.equal(replayed[0], eager[0]), (adapter, names)
            torch.testing.assert_close(replayed[1], eager[1], rtol=0, atol=0)
            assert graphs.replays > replays
        assert graphs.recordings == recordings + 1, (adapter, names)
    model.set_adapter("one")
    model.merge_adapter(["one"])                               # merged: a new adapter state, a new recording
    try:
        merged = _generate(model, ids, cache)
        assert torch.equal(merged[0], _generate(model, ids, cache)[0])
    finally:
        model.unmerge_adapter()
    with model.disable_adapter():
        base = _generate(model, ids, cache)
        graphs.active = False
        assert torch.equal(base[0], _generate(model, ids, cache)[0])
        graphs.active = True
    with caplog.at_level(logging.WARNING, logger="sits_lora"):       # the default dynamic cache: eager, one line
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert 'cache_implementation="static"' in caplog.text
    import gc
    import weakref

    own = _static_cache(max_len=16)
    _generate(model, ids, own)
    gone = weakref.ref(own)
    del own
    gc.collect()
    assert gone() is None                                    # no recording keeps a request's cache alive
    graphs.release()
    assert "forward" not in model.get_base_model().__dict__


@pytest.mark.gpu
def test_on_a_gpu_a_pool_slot_filled_between_requests_is_seen_by_the_replays(tmp_path):
    from sits_lora import AdapterPool

    source = _two_adapters(torch.float32)
    source.save_pretrained(tmp_path)                 # PEFT writes each named adapter in its own folder
    reference = _two_adapters(torch.bfloat16, "cuda")
    host = get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, target_modules=TARGETS)).to("cuda", torch.bfloat16)
    pool = AdapterPool(host.eval(), capacity=1, max_rank=8)
    pool.add("one", tmp_path / "one")
    pool.add("two", tmp_path / "two")
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(6)).cuda()
    cache = _static_cache(max_len=16)
    graphs = graph_decode(host)
    for name in ("one", "two", "one", "two"):                # one slot: each request copies its adapter into it
        slot = pool.slots_for([name])[0]
        host.set_adapter(slot)
        reference.set_adapter(name)
        assert torch.equal(_generate(host, ids, cache)[0], _generate(reference, ids, cache)[0]), name
    # the two adapters' scalings differ (16 / 8, 16 / 4): a scaling is a Python number baked into a recording, so
    # each has its own, and the alternating requests replay both
    assert graphs.replays > 0 and graphs.recordings == 2
    graphs.release()
