"""CUDA graphs over a whole training step (sits_lora.training.graph_train_step): refusals, argument handling and the
optimizer's settings on the CPU; on a GPU, replayed steps train a sits_lora model (a tiny Llama, a tiny U-Net) to
the same weights as eager steps, a learning-rate schedule reaches the replays, and a step that syncs with the host
is refused with the fix."""

from __future__ import annotations

import collections
import copy
import math
import warnings

import pytest
import torch
from conftest import randomize_lora_weights, tiny_llama

from sits_lora import SitsLoraConfig
from sits_lora.training.graphs import GraphCaptureError, GraphedTrainStep, graph_train_step
from sits_lora.utils.cuda_graphs import NotGraphable, copy_output, describe_call, substitute

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _noop(*args):
    return None


def test_refusals_name_the_fix(monkeypatch):
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param])
    with pytest.raises(TypeError, match="step_fn must be callable"):
        graph_train_step(None, optimizer)
    with pytest.raises(TypeError, match="optimizer must be the torch.optim.Optimizer"):
        graph_train_step(_noop, [param])
    with pytest.raises(ValueError, match=r"graph_train_step\(warmup=0\) is invalid: it must be a positive integer"):
        graph_train_step(_noop, optimizer, warmup=0)
    with pytest.raises(ValueError, match=r"graph_train_step\(max_graphs=True\) is invalid: it must be a positive integer"):
        graph_train_step(_noop, optimizer, max_graphs=True)
    with pytest.raises(TypeError, match="assume_causal_attention must be True or False, got 'yes'"):
        graph_train_step(_noop, optimizer, assume_causal_attention="yes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU: call the step function directly"):
            graph_train_step(_noop, optimizer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"parameters on cpu; move the model to a GPU \(model.to\('cuda'\)\)"):
        graph_train_step(_noop, optimizer)


def test_arguments_are_described_and_rebuilt_with_the_recorded_buffers(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))   # describe CPU tensors as if on a GPU
    Pair = collections.namedtuple("Pair", "a b")
    args = (torch.zeros(2, 3), 7, None)
    kwargs = {"added": {"text_embeds": torch.ones(2, 4), "ids": [torch.ones(1), 2.5]}, "pair": Pair(torch.ones(5), "x")}
    tensors = []
    key = describe_call((args, kwargs), tensors)
    assert len(tensors) == 4 and hash(key) is not None
    assert describe_call(((torch.ones(2, 3), 7, None), kwargs), []) == key
    assert describe_call(((torch.zeros(2, 4), 7, None), kwargs), []) != key      # a shape changed
    assert describe_call(((torch.zeros(2, 3), 8, None), kwargs), []) != key      # a Python number changed
    assert describe_call(((torch.zeros(2, 3).requires_grad_(), 7, None), kwargs), []) != key
    buffers = [t.clone() + 1 for t in tensors]
    new_args, new_kwargs = substitute((args, kwargs), iter(buffers))
    assert new_args[0] is buffers[0] and new_args[1:] == (7, None)
    assert new_kwargs["added"]["ids"][0] is buffers[2] and new_kwargs["added"]["ids"][1] == 2.5
    assert isinstance(new_kwargs["pair"], Pair) and new_kwargs["pair"].a is buffers[3]
    with pytest.raises(NotGraphable, match="an argument of type object"):
        describe_call((object(),), [])


def test_a_cpu_tensor_is_not_graphable():
    with pytest.raises(NotGraphable, match="a tensor on cpu"):
        describe_call((torch.zeros(1),), [])


def test_outputs_are_copied_leaves_kept():
    loss = torch.tensor(2.0, requires_grad=True) * 1
    copied = copy_output((loss, {"n": 3}, None))
    assert copied[0].data_ptr() != loss.data_ptr() and not copied[0].requires_grad and copied[1:] == ({"n": 3}, None)
    with pytest.raises(NotGraphable, match="an output of type set"):
        copy_output({1})


def test_optimizer_made_capturable_and_setting_changes_counted():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01)
    param.grad = torch.ones(3)
    optimizer.step()                                           # stepped before: its step count is on the CPU
    step = GraphedTrainStep(_noop, [optimizer], None, warmup=1, max_graphs=1)
    assert optimizer.param_groups[0]["capturable"] is True
    assert optimizer.state[param]["step"].dtype == torch.float32
    step._check_settings()                                     # nothing changed: no warning, nothing counted
    assert step._setting_changes == 0
    optimizer.param_groups[0]["weight_decay"] = 0.1
    with pytest.warns(UserWarning, match="the optimizer's weight_decay changed after the step was recorded"):
        step._check_settings()
    assert step._setting_changes == 1
    optimizer.param_groups[0]["lr"] = 5e-4                      # a float learning rate (a CPU optimizer keeps one)
    with pytest.warns(UserWarning, match="the optimizer's lr changed"):
        step._check_settings()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for value in (0.2, 0.3):
            optimizer.param_groups[0]["weight_decay"] = value
            step._check_settings()
    assert step._setting_changes == 4                          # past the limit: calls then run eagerly


# ---------------------------------------------------------------------------------------------------- GPU

def _llama_with_adapter(seed=0):
    from peft import get_peft_model

    model = get_peft_model(tiny_llama(seed, dtype=torch.bfloat16),
                           SitsLoraConfig(r=8, lora_alpha=16, target_modules=LLAMA_TARGETS))
    randomize_lora_weights(model)
    return model.to("cuda").train()


def _llama_step(model, optimizer):
    def step(input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _capturing(monkeypatch):
    """transformers told that a stream captures (its mask code asks import_utils.is_cuda_stream_capturing)."""
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    if not hasattr(import_utils, "is_cuda_stream_capturing"):
        pytest.skip("this transformers does not ask whether a stream captures")
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)


def _attention_spy(monkeypatch, key_heads=None):
    """The masks and is_causal flags that reach torch's attention (under what _AttentionDecisions patches in); the
    key's head count of each call appended to ``key_heads`` when given."""
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        if key_heads is not None:
            key_heads.append(key.shape[1])
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_attention_masked_only_while_recording_is_made_as_the_eager_step_made_it(monkeypatch):
    """On the CPU, a stream's capture simulated: transformers builds the causal mask as a tensor, which the
    recording counts and, on request, replaces by is_causal=True as in the eager step; same logits either way."""
    from sits_lora.training.graphs import _AttentionDecisions

    model = tiny_llama(0).eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)   # a collator's all-ones mask: eagerly transformers drops it for is_causal=True
    key_heads = []
    calls = _attention_spy(monkeypatch, key_heads)
    decisions = _AttentionDecisions()
    with torch.no_grad():
        with decisions.watching():
            eager = model(input_ids=ids, attention_mask=mask).logits
        layers = len(decisions.eager)
        assert layers == model.config.num_hidden_layers and calls == [(True, True)] * layers
        eager_heads = key_heads[:]
        _capturing(monkeypatch)
        calls.clear()
        with decisions.recording(rewrite=False):
            masked = model(input_ids=ids, attention_mask=mask).logits
        assert calls == [(False, False)] * layers and (decisions.masked_while_recording, decisions.rewritten) == (
            layers, 0)
        calls.clear()
        key_heads.clear()
        with decisions.recording(rewrite=True):
            causal = model(input_ids=ids, attention_mask=mask).logits
    assert calls == [(True, True)] * layers and decisions.rewritten == layers
    # grouped-query attention read in place, as eagerly: no copy of the key and value heads out to the query's count
    assert eager_heads == [model.config.num_key_value_heads] * layers and key_heads == eager_heads
    torch.testing.assert_close(masked, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal, eager, rtol=1e-5, atol=1e-5)
    assert torch.nn.functional.scaled_dot_product_attention.__name__ == "spy"   # the patch is gone


def test_a_mask_the_eager_step_needed_too_is_recorded_as_it_is(monkeypatch):
    """Left padding: the eager step passed a mask as well, so the recording keeps it even when asked to assume
    causal attention (only calls that were causal without a mask eagerly are changed)."""
    from sits_lora.training.graphs import _AttentionDecisions

    model = tiny_llama(0).eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    calls = _attention_spy(monkeypatch)
    decisions = _AttentionDecisions()
    with torch.no_grad():
        with decisions.watching():
            eager = model(input_ids=ids, attention_mask=mask).logits
        _capturing(monkeypatch)
        calls.clear()
        with decisions.recording(rewrite=True):
            recorded = model(input_ids=ids, attention_mask=mask).logits
    assert all(not masked_none for masked_none, _ in calls) and decisions.rewritten == 0
    torch.testing.assert_close(recorded, eager, rtol=1e-5, atol=1e-5)


def _halving(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.5 ** i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_recorded_attention_is_causal_on_request_and_trains_as_eager(caplog):
    """A collator's all-ones attention_mask: transformers masks attention while a stream captures. By default the
    recording says so once; with assume_causal_attention=True the replays run causal attention without a mask and
    train as the eager steps do."""
    eager_model = _llama_with_adapter()
    models = {"eager": eager_model, "default": copy.deepcopy(eager_model), "causal": copy.deepcopy(eager_model)}
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, fused=True,
                                    capturable=True) for name, m in models.items()}
    opts["eager"].param_groups[0]["lr"] = torch.tensor(1e-2, device="cuda")

    def make(name):
        model, optimizer = models[name], opts[name]

        def step(input_ids, attention_mask):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    steps = {"eager": make("eager"),
             "default": graph_train_step(make("default"), opts["default"], model=models["default"]),
             "causal": graph_train_step(make("causal"), opts["causal"], model=models["causal"],
                                        assume_causal_attention=True)}
    gen = torch.Generator().manual_seed(3)
    losses = collections.defaultdict(list)
    with caplog.at_level("INFO", logger="sits_lora"):
        for _ in range(5):
            ids = torch.randint(0, 97, (2, 24), generator=gen).cuda()
            for name, step in steps.items():
                losses[name].append(step(ids, torch.ones_like(ids)).item())
    layers = models["eager"].config.num_hidden_layers
    # five steps: two warm-up steps, the recording (which replays too), two replays
    assert steps["causal"]._attention.rewritten == layers and steps["causal"].replays == 3
    masked = steps["default"]._attention.masked_while_recording
    assert ("assume_causal_attention=True to graph_train_step" in caplog.text) == (masked > 0)
    for name in ("default", "causal"):
        assert losses[name] == pytest.approx(losses["eager"], rel=2e-2), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [True, False])
def test_replayed_steps_train_a_llama_as_eager_steps_do(fused):
    eager_model = _llama_with_adapter()
    graphed_model = copy.deepcopy(eager_model)
    opts = {}
    for name, model in (("eager", eager_model), ("graphed", graphed_model)):
        params = [p for p in model.parameters() if p.requires_grad]
        opts[name] = torch.optim.AdamW(params, lr=1e-2, fused=fused, capturable=True)
    # the eager side gets the same optimizer settings the graphed one is given (tensor lr, capturable)
    opts["eager"].param_groups[0]["lr"] = torch.tensor(1e-2, device="cuda")
    schedules = {name: _halving(o) for name, o in opts.items()}
    eager_step = _llama_step(eager_model, opts["eager"])
    graphed = graph_train_step(_llama_step(graphed_model, opts["graphed"]), opts["graphed"], model=graphed_model)
    assert torch.is_tensor(opts["graphed"].param_groups[0]["lr"])
    gen = torch.Generator().manual_seed(3)
    losses = {"eager": [], "graphed": []}
    for _ in range(6):
        ids = torch.randint(0, 97, (2, 24), generator=gen).cuda()
        losses["eager"].append(eager_step(ids).item())
        losses["graphed"].append(graphed(ids).item())
        for schedule in schedules.values():
            schedule.step()
    assert (graphed.eager_calls, graphed.recordings, graphed.replays) == (2, 1, 4)
    assert losses["graphed"] == pytest.approx(losses["eager"], rel=2e-2)
    for (name, a), (_, b) in zip(eager_model.named_parameters(), graphed_model.named_parameters()):
        if a.requires_grad:
            assert (a.float() - b.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item() + 1e-3, name
    # the schedule reached the replays: the adapters moved less in the later steps than a constant rate moves them
    assert float(opts["graphed"].param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.5 ** 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_new_shape_warms_up_and_records_again_and_the_limit_runs_eagerly():
    model = _llama_with_adapter()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    graphed = graph_train_step(_llama_step(model, optimizer), optimizer, model=model, warmup=1, max_graphs=1)
    for length in (16, 16, 16):
        graphed(torch.randint(0, 97, (2, length), device="cuda"))
    assert (graphed.eager_calls, graphed.recordings, graphed.replays) == (1, 1, 2)
    graphed(torch.randint(0, 97, (2, 12), device="cuda"))        # another shape: its warm-up call
    with pytest.warns(UserWarning, match=r"1 recordings already \(max_graphs=1\)"):
        graphed(torch.randint(0, 97, (2, 12), device="cuda"))
    assert (graphed.eager_calls, graphed.recordings) == (3, 1)
    model.eval()                                                  # the mode is part of the signature
    graphed(torch.randint(0, 97, (2, 16), device="cuda"))
    assert graphed.replays == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_that_waits_for_the_gpu_is_refused_with_the_fix():
    model = _llama_with_adapter()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    inner = _llama_step(model, optimizer)

    def step(ids):
        loss = inner(ids)
        return loss.item()           # a host sync

    graphed = graph_train_step(step, optimizer, warmup=1)
    ids = torch.randint(0, 97, (2, 16), device="cuda")
    graphed(ids)
    reserved = _reserved_by_tensors()
    steps = [optimizer.state[p]["step"].item() for p in optimizer.param_groups[0]["params"]]
    with pytest.raises(GraphCaptureError, match=r"could not be recorded as a CUDA graph \(.*\), at \S+:\d+ in \w+\. "
                                                r"Nothing .*remove .item\(\)"):
        graphed(ids)
    assert isinstance(inner(ids), torch.Tensor)                  # the model still trains eagerly
    _assert_left_usable(optimizer, steps, reserved)


def _reserved_by_tensors() -> int:
    """The allocator's reserved bytes with its cache and cuBLAS's workspaces released: cuBLAS keeps one workspace per
    stream it ran on (the recording's side stream gets its own at the process's first capture, whatever the order
    of the tests), held until cleared and not the recording's to give back."""
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def _assert_left_usable(optimizer, steps_before, reserved_before):
    """What a refused recording must leave as it found it: the stream, the random generator (random draws and
    dropout work and follow the seed), the allocator's pool (its memory returns), and the optimizer's state."""
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.manual_seed(5)
    first = torch.randn(64, device="cuda")
    torch.manual_seed(5)
    assert torch.equal(first, torch.randn(64, device="cuda"))
    kept = torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5, training=True)
    assert 0.4 < (kept > 0).float().mean().item() < 0.6
    # one more eager step counted, none from the recording
    assert [optimizer.state[p]["step"].item() for p in optimizer.param_groups[0]["params"]] == [
        s + 1 for s in steps_before]
    assert _reserved_by_tensors() <= reserved_before + 64 * 2**20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_refused_recording_leaves_dropout_training_and_unwritten_grads_behind():
    """A step with LoRA dropout whose recording is refused: the eager steps that follow draw their dropout masks,
    and the backward inside the failed capture left no unwritten gradient behind (a next step would add to it)."""
    from peft import get_peft_model

    model = get_peft_model(tiny_llama(0, dtype=torch.bfloat16),
                           SitsLoraConfig(r=8, lora_alpha=16, lora_dropout=0.2, target_modules=LLAMA_TARGETS))
    model = model.to("cuda").train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if loss.item() > 1e9:        # a host sync between backward and the optimizer step
            raise AssertionError("unreachable")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    graphed = graph_train_step(step, optimizer, model=model, warmup=1)
    ids = torch.randint(0, 97, (2, 16), device="cuda")
    graphed(ids)
    reserved = _reserved_by_tensors()
    steps = [optimizer.state[p]["step"].item() for p in params]
    with pytest.raises(GraphCaptureError):
        graphed(ids)
    assert all(p.grad is None for p in params)
    losses = [step(ids).item() for _ in range(2)]                 # dropout draws a new mask each step
    assert all(math.isfinite(v) for v in losses)
    assert [optimizer.state[p]["step"].item() for p in params] == [s + 2 for s in steps]
    _assert_left_usable(optimizer, [s + 1 for s in steps], reserved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_unet_steps_match_eager_steps():
    pytest.importorskip("diffusers")
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "diffusion"))
    from test_diffusers_models import ATTENTION, tiny_unet

    torch.manual_seed(0)
    unet = tiny_unet()
    unet.add_adapter(SitsLoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    unet = unet.to("cuda", torch.bfloat16).train()
    twin = copy.deepcopy(unet)
    steps, optimizers = {}, {}
    for name, model in (("eager", unet), ("graphed", twin)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True,
                                      capturable=True)
        optimizer.param_groups[0]["lr"] = torch.tensor(1e-3, device="cuda")

        def step(sample, t, text, noise, model=model, optimizer=optimizer):
            pred = model(sample, t, encoder_hidden_states=text).sample
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        steps[name], optimizers[name] = step, optimizer
    graphed = graph_train_step(steps["graphed"], optimizers["graphed"], model=twin)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        batch = [torch.randn(2, 4, 16, 16, generator=gen), torch.randint(0, 1000, (2,), generator=gen),
                 torch.randn(2, 7, 24, generator=gen), torch.randn(2, 4, 16, 16, generator=gen)]
        batch = [b.cuda() if b.dtype == torch.int64 else b.to("cuda", torch.bfloat16) for b in batch]
        eager_loss = steps["eager"](*batch)
        graphed_loss = graphed(*batch)
        assert graphed_loss.item() == pytest.approx(eager_loss.item(), rel=2e-2)
    assert graphed.replays == 3
    for (name, a), (_, b) in zip(unet.named_parameters(), twin.named_parameters()):
        if a.requires_grad:
            assert (a.float() - b.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item() + 1e-3, name


def test_a_failed_recording_names_where_it_stopped_and_a_known_sync():
    from sits_lora.training.graphs import _failure_site, _known_sync_hint

    # a sync inside a library: its file and line; Liger's cross-entropy gets its own fix
    namespace = {}
    exec(compile("def count(t):\n    return t.sum().item() + undefined_name\n",
                 "/site-packages/liger_kernel/ops/fused_linear_cross_entropy.py", "exec"), namespace)
    try:
        namespace["count"](torch.ones(2))
    except NameError as error:
        site = _failure_site(error)
    assert site == "liger_kernel/ops/fused_linear_cross_entropy.py:2 in count"
    assert "fused_linear_cross_entropy=False" in _known_sync_hint(site)
    # a sync inside torch's own Python names the caller
    try:
        torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.ones(1))], 1.0, norm_type="not a norm")
    except Exception as error:   # noqa: BLE001
        site = _failure_site(error)
    assert site.startswith("tests/training/test_graph_train_step.py:")
    assert site.endswith(" in test_a_failed_recording_names_where_it_stopped_and_a_known_sync")
    assert _known_sync_hint(site) == ""
