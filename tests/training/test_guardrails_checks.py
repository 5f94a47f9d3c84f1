"""The checks behind SitsHardwareCallback: hardware report and its cache, the memory plan against measured
peaks, the rank ceiling, the PCIe accounting and the INT4 alignment of bitsandbytes layers."""

from __future__ import annotations

import importlib.util
import json
import types

import pytest
import torch
from torch import nn

import sits_lora
from sits_lora.training import HardwareReport, MemoryPlan, PeakMemoryMeter, UnsupportedModelError, plan_memory
from sits_lora.training import hardware as hw
from sits_lora.training.constraints import (
    check_int4,
    check_pcie,
    check_rank,
    pcie_bytes_per_step,
    rank_ceiling,
)

from conftest import tiny_mlp

LLAMA_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# ANCHORS.md, measured on the H200: bf16 matmul 788 TFLOP/s, device copy 4.25 TB/s.
H200 = dict(matmul_flops=788e12, hbm_bandwidth=4.25e12, h2d_bandwidth=55e9, d2h_bandwidth=55e9)
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (the test extra)")


def llama(kind: str, gc: bool, *, hidden=128, inter=384, layers=2, vocab=2048, heads=4, kv=2, attn="sdpa",
          dropout=0.0, dtype=torch.bfloat16):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
                         tie_word_embeddings=False, attn_implementation=attn)
    model = LlamaForCausalLM(config).to(dtype)
    if kind == "frozen":
        model.requires_grad_(False)
        return model
    cls = LoraConfig if kind == "peft" else sits_lora.SitsLoraConfig
    model = get_peft_model(model, cls(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=LLAMA_PROJ))
    if gc:
        inner = model.base_model.model
        if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
            inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def measured_peak(model, batch: int, seq: int, steps: int = 2, autocast=None) -> int:
    """Peak live tensor bytes of `steps` AdamW steps (the second has optimizer states), on the CPU."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with PeakMemoryMeter("cpu") as meter:
        meter.track(*model.parameters(), *model.buffers())
        for _ in range(steps):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return meter.peak


# ----------------------------------------------------------------------------- memory plan


@pytest.mark.parametrize(
    "kind,gc,shape",
    [
        ("sits", False, {}),
        ("sits", True, {}),
        ("peft", False, {}),
        ("peft", True, {}),
        ("sits", False, {"vocab": 256, "inter": 768}),  # activations, not the loss, dominate
        ("peft", True, {"vocab": 256, "inter": 768}),
        ("sits", False, {"attn": "eager"}),
        ("peft", False, {"dropout": 0.1}),
        ("sits", False, {"kv": 4}),
    ],
    ids=["sits", "sits-gc", "peft", "peft-gc", "sits-small-vocab", "peft-gc-small-vocab", "sits-eager", "peft-dropout",
         "sits-no-gqa"],
)
def test_plan_within_tolerance_of_measured_peak(kind, gc, shape):
    """plan_memory against the peak live-tensor bytes of real steps (bf16 weights, fp32 adapters, CPU)."""
    model = llama(kind, gc, **shape)
    batch, seq = 2, 64
    plan = plan_memory(model, batch, seq)
    peak = measured_peak(model, batch, seq)
    # Seen here (torch 2.13 CPU): every case within 3 %; the GPU target is 15 % (bench/memory_plan.py).
    assert abs(plan.total / peak - 1) < 0.06, (plan.table(), peak)


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "gc"])
def test_plan_with_the_mlp_in_tiles_within_tolerance_of_measured_peak(gc):
    """sits_lora.activations.tile_mlp: the MLP keeps its input alone (seen here: -1.4 % untiled, +4.0 % tiled
    without checkpointing, -2.9 % tiled under it, 512 tokens in tiles of 64)."""
    from sits_lora.activations import tile_mlp

    model = llama("sits", gc, vocab=256, inter=768)
    tile_mlp(model, 64)
    plan = plan_memory(model, 2, 256)
    assert "MLP in tiles of 64 tokens" in plan.gradient_checkpointing
    peak = measured_peak(model, 2, 256)
    assert abs(plan.total / peak - 1) < 0.06, (plan.table(), peak)
    untiled = plan_memory(model, 2, 256, mlp_tile_tokens=0)
    assert untiled.total > 1.3 * plan.total  # what tiling is for: here the MLP dominates


def test_plan_with_selective_checkpointing_within_tolerance_of_measured_peak():
    """sits_lora.activations.selective_checkpointing_kwargs: each layer keeps its input and attention's output (seen
    here: +0.2 %)."""
    from sits_lora.activations import selective_checkpointing_kwargs

    model = llama("sits", False)
    inner = model.base_model.model
    if hasattr(inner, "activation_checkpointing_enable"):
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=selective_checkpointing_kwargs())
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=selective_checkpointing_kwargs())
    model.enable_input_require_grads()
    plan = plan_memory(model, 2, 256)
    assert "attention kept" in plan.gradient_checkpointing
    peak = measured_peak(model, 2, 256)
    assert abs(plan.total / peak - 1) < 0.06, (plan.table(), peak)


def test_plan_with_offloaded_checkpoints_drops_the_kept_inputs():
    """enable_offloaded_checkpointing: the checkpointed layers' inputs leave the device, the next layer's comes back
    while a layer runs backward (on the CPU nothing moves, so this is the plan's arithmetic)."""
    from sits_lora.activations import enable_offloaded_checkpointing

    model = llama("sits", False, layers=4, vocab=256)
    enable_offloaded_checkpointing(model)
    offloaded = plan_memory(model, 2, 1024)  # long enough that activations, not gradients, make the peak
    kept = plan_memory(model, 2, 1024, activation_offload=False)
    T, h = 2 * 1024, 128
    assert not offloaded.grads_at_peak
    assert "offloaded to host" in offloaded.gradient_checkpointing
    # three bf16 inputs off (the first block's is the embeddings' output, which needs a gradient and stays), one
    # fetched back ahead of its layer
    assert kept.total - offloaded.total == 2 * T * h * (3 - 1)
    assert offloaded.host_offload == 3 * 2 * T * h
    enable_offloaded_checkpointing(model, keep_on_device=1)
    partly = plan_memory(model, 2, 1024)
    assert partly.total - offloaded.total == 2 * T * h and partly.host_offload == 2 * 2 * T * h


def test_plan_with_layers_offloaded_keeps_the_others_and_two_layers_in_backward():
    """enable_activation_offload (no checkpointing): the offloaded layers' saved tensors leave the device; backward
    brings one back while the next arrives (the plan's arithmetic: on the CPU nothing moves)."""
    from sits_lora.activations import enable_activation_offload

    model = llama("sits", False, layers=6, vocab=256)
    plain = plan_memory(model, 2, 1024)
    enable_activation_offload(model, [0, 1, 2, 3])
    offloaded = plan_memory(model, 2, 1024)
    per_layer = plain.activations_per_layer
    assert "4 layers' saved tensors offloaded" in offloaded.gradient_checkpointing
    assert offloaded.host_offload >= 4 * per_layer * 0.9
    # six layers' saves become the larger of the two kept layers' and two layers' worth: a third of them stays
    assert plain.total - offloaded.total == pytest.approx(4 * per_layer, rel=0.2)


def test_plan_with_fp32_weights_under_bf16_autocast():
    """fp32 weights under bf16 autocast (TrainingArguments(bf16=True) on an fp32 model): the layers get fp32 inputs
    and each makes its own bf16 copy; the probe sees that only when fed the dtype the model feeds (seen here: sits
    -3.7 %, PEFT -3.5 %; a probe fed bf16 made the sits plan -6.1 %)."""
    for kind in ("sits", "peft"):
        model = llama(kind, False, dtype=torch.float32)
        plan = plan_memory(model, 2, 64, autocast_dtype=torch.bfloat16)
        peak = measured_peak(model, 2, 64, autocast=torch.bfloat16)
        assert abs(plan.total / peak - 1) < 0.05, (kind, plan.table(), peak)


def test_plan_parts_and_options():
    model = llama("sits", False)
    plan = plan_memory(model, 2, 128)
    assert plan.total == (plan.frozen_weights + plan.adapter_weights + plan.optimizer_states + plan.activations
                          + plan.logits_and_loss)
    assert plan.logits_and_loss == 12 * 2 * 128 * 2048  # three fp32 T x V buffers at the start of backward
    assert plan.optimizer_states == 2 * plan.adapter_weights and not plan.grads_at_peak
    assert plan.gradient_checkpointing == "off"
    checkpointed = plan_memory(model, 2, 128, gradient_checkpointing=True)
    assert checkpointed.activations < plan.activations and checkpointed.gradient_checkpointing == "every layer"
    accumulated = plan_memory(model, 2, 128, gradient_accumulation_steps=4)
    assert accumulated.grads_at_peak and accumulated.total == plan.total + plan.adapter_grads
    assert plan_memory(model, 2, 128, padded=True).activations > plan.activations  # K/V repeated to every head
    assert plan_memory(model, 2, 128, optimizer="sgd").optimizer_states == 0
    assert plan_memory(model, 2, 128, optimizer="adamw_8bit").optimizer_states == plan.adapter_weights // 2
    assert plan_memory(model, 4, 128).total > plan.total
    table = plan.table()
    for label in ("frozen weights", "adapters", "optimizer states", "activations", "logits and loss", "total at peak"):
        assert label in table
    assert json.loads(json.dumps(plan.to_dict()))["total"] == plan.total


def test_plan_of_the_fused_loss_holds_one_chunk_of_logits_and_the_input_gradient():
    from sits_lora.ops.cross_entropy import chunk_rows_for

    model = llama("sits", False)
    plan = plan_memory(model, 2, 128)
    fused = plan_memory(model, 2, 128, fused_loss=True)
    T, h, V = 2 * 128, model.config.hidden_size, model.config.vocab_size
    a = 2   # bf16 activations
    assert fused.logits_and_loss == a * T * h + a * chunk_rows_for(T, V, h, a) * V + 4 * T
    assert fused.loss == "fused" and plan.loss == "model"
    assert fused.total < plan.total and fused.frozen_weights == plan.frozen_weights
    assert "sits_lora's fused linear cross-entropy" in fused.table()
    assert "fp32 cross-entropy buffers" in plan.table()


def test_plan_of_a_recorded_step_adds_its_two_streams_cublas_workspaces(monkeypatch):
    """A recording warms up on one side stream and captures on another; each gets a cuBLAS workspace at its first
    GEMM. A model off CUDA has no workspaces: no term. With one (its size faked: this machine has no GPU) the term is
    two workspaces, in the total and the table."""
    from sits_lora.training import memory

    model = llama("sits", False)
    eager = plan_memory(model, 2, 128, fused_loss=True)
    on_cpu = plan_memory(model, 2, 128, fused_loss=True, recorded=True)
    assert on_cpu.recording == 0 and on_cpu.total == eager.total and "recording" not in on_cpu.table()

    monkeypatch.setattr(memory, "cublas_workspace_bytes", lambda device: 32 * 2**20)
    recorded = plan_memory(model, 2, 128, fused_loss=True, recorded=True)
    assert recorded.recording == 2 * 32 * 2**20
    assert recorded.total == eager.total + recorded.recording
    assert "recording" in recorded.table() and "cuBLAS workspaces" in recorded.table()


@pytest.mark.parametrize("config, capability, expected", [
    ("", (9, 0), 32 * 2**20),                            # Hopper: cuBLAS's recommended 32 MiB, which torch uses
    ("", (8, 0), 4096 * 1024 * 2 + 16 * 1024 * 8),       # before Hopper: torch's own default
    (":4096:8", (8, 0), 4096 * 1024 * 8),                # the environment's sizes win
    (":16:8", (9, 0), 16 * 1024 * 8),
    ("nonsense", (9, 0), 32 * 2**20),                    # unreadable: the default
])
def test_cublas_workspace_bytes_reads_the_environment_else_the_capability(monkeypatch, config, capability, expected):
    from sits_lora.utils import cuda_graphs

    assert cuda_graphs.cublas_workspace_bytes(torch.device("cpu")) == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert cuda_graphs.cublas_workspace_bytes(torch.device("cuda", 0)) == expected


def test_plan_on_meta_device_for_full_size_shapes():
    """A plan needs no memory: Llama-3-8B shapes on the meta device (the probes run on meta tensors too)."""
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = get_peft_model(model, sits_lora.SitsLoraConfig(r=16, lora_alpha=32, target_modules=LLAMA_PROJ))
    plan = plan_memory(model, 4, 2048)
    assert not plan.notes, plan.notes  # every layer was probed
    assert plan.frozen_weights == 2 * 8_030_261_248 + 4 * 64  # Llama-3-8B's parameters in bf16, the RoPE buffer
    assert plan.adapter_weights == 4 * 16 * 32 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    # Each layer saves its two fp32 norm inputs, q/k/v/output, 3 MLP tensors, and the LoRA inputs that are not
    # rebuilt in backward (sits_lora.activations): the q/k/v and gate/up inputs (transformers' bf16 RMSNorm keeps
    # an fp32 copy, not its input), not o_proj's (sdpa keeps it) nor down_proj's (the multiply keeps its factors).
    T, h, kv, inter = 8192, 4096, 1024, 14336
    frozen_layer = 2 * 4 * T * h + 2 * (2 * T * h + 2 * T * kv) + 3 * 2 * T * inter + 4 * 4 * 32 * 2048
    lora_layer = 2 * T * h + 2 * T * h + 7 * 4 * 16 * T
    assert plan.activations_per_layer == pytest.approx(frozen_layer + lora_layer, rel=1e-3)


def test_plan_bad_inputs_are_named():
    model = llama("sits", False)
    with pytest.raises(ValueError, match=r"plan_memory\(batch_size=0\) is invalid: it must be a positive integer"):
        plan_memory(model, 0, 128)
    with pytest.raises(ValueError, match=r"plan_memory\(seq_len=1.5\) is invalid"):
        plan_memory(model, 1, 1.5)
    with pytest.raises(ValueError, match=r"optimizer='adam9'\) is invalid: allowed values are 'adamw'"):
        plan_memory(model, 1, 16, optimizer="adam9")
    with pytest.raises(UnsupportedModelError, match="has no list of decoder layers"):
        plan_memory(tiny_mlp(), 1, 16)


# ----------------------------------------------------------------------------- hardware report and cache


def test_cpu_report_measures_nothing():
    report = hw.probe_hardware("cpu")
    assert report.device == "cpu" and report.total_memory > 0 and report.free_memory > 0 and report.cpu_cores >= 1
    assert report.hbm_bandwidth is None and report.matmul_flops is None and not report.is_cuda
    assert "skipped" in report.table() and report.name in report.table()


def _fake_cuda(monkeypatch, measured: list):
    props = types.SimpleNamespace(name="Fake H200", uuid="GPU-1234", total_memory=140 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)

    def fake_measure(device, free):
        measured.append(device)
        return {"hbm_bandwidth": 4.25e12, "h2d_bandwidth": 55e9, "d2h_bandwidth": 53e9, "matmul_flops": 788e12,
                "fp8_matmul_flops": 1436e12, "fp8_supported": True}

    monkeypatch.setattr(hw, "_measure_cuda", fake_measure)
    return props


def test_measurements_are_cached_per_device(monkeypatch, tmp_path):
    """Measured once, read back after a restart; refresh=True or another device measures again."""
    measured: list = []
    props = _fake_cuda(monkeypatch, measured)
    monkeypatch.setenv("SITS_LORA_CACHE", str(tmp_path))
    first = hw.probe_hardware("cuda:0")
    assert len(measured) == 1 and not first.from_cache and first.cache_file.startswith(str(tmp_path / "hardware"))
    second = hw.probe_hardware("cuda:0")
    assert len(measured) == 1 and second.from_cache and second.hbm_bandwidth == 4.25e12
    assert second.pinned_bandwidth == 53e9 and second.compute_capability == "9.0" and second.fp8_supported
    assert "4.25 TB/s" in second.table() and "(cached)" in second.table()
    hw.probe_hardware("cuda:0", refresh=True)
    assert len(measured) == 2
    props.uuid = "GPU-5678"  # another GPU of the same model
    hw.probe_hardware("cuda:0")
    assert len(measured) == 3
    cache = json.loads(open(second.cache_file).read())
    assert cache["key"]["name"] == "Fake H200" and cache["measured"]["matmul_flops"] == 788e12


def test_damaged_cache_is_measured_again(monkeypatch, tmp_path):
    measured: list = []
    _fake_cuda(monkeypatch, measured)
    report = hw.probe_hardware("cuda:0", cache_dir=tmp_path)
    with open(report.cache_file, "w") as f:
        f.write("{not json")
    again = hw.probe_hardware("cuda:0", cache_dir=tmp_path)
    assert len(measured) == 2 and not again.from_cache and json.loads(open(report.cache_file).read())


# ----------------------------------------------------------------------------- rank ceiling, PCIe


def _gpu_report(**overrides) -> HardwareReport:
    fields = dict(device="cuda:0", name="H200", total_memory=140 * 2**30, free_memory=130 * 2**30, **H200)
    fields.update(overrides)
    return HardwareReport(**fields)


def test_rank_ceiling_roofline():
    # 4096 x 4096 at 8192 tokens: base time 2 x 2·T·K·N / F = 0.70 ms; 10 % is 70 us; the fused branch's
    # 6·T·r·(K+N) FLOPs take 0.51 us per rank, so the ceiling is 136.
    assert rank_ceiling(4096, 4096, 8192, 2, 788e12, 4.25e12, 0.10, fused=True) == 136
    # Unfused, the extra passes over x and y (11 x 64 MiB at 4.25 TB/s = 174 us) already exceed 70 us.
    assert rank_ceiling(4096, 4096, 8192, 2, 788e12, 4.25e12, 0.10, fused=False) == 0
    assert rank_ceiling(4096, 4096, 8192, 2, 788e12, 4.25e12, 0.50, fused=False) > 0
    wider = rank_ceiling(4096, 4096, 8192, 2, 788e12, 4.25e12, 0.20, fused=True)
    assert wider == pytest.approx(2 * 136, abs=1)


def test_rank_check_names_layers_above_the_ceiling():
    model = llama("sits", False)
    result = check_rank(model, _gpu_report(), tokens=256, act_bytes=2, share=0.10)
    assert result.status == "violated"  # a CPU model runs the unfused reference: no rank fits 10 %
    assert any("self_attn.q_proj" in s and "ceiling 0" in s and "fused kernel" in s for s in result.suggestions)
    fused = check_rank(model, _gpu_report(), tokens=8192, act_bytes=2, share=0.10, is_fused=lambda layer: True)
    assert all(row["fused"] and row["ceiling"] > 0 for row in fused.details["layers"])
    assert check_rank(model, hw.probe_hardware("cpu"), 256, 2, 0.1).status == "skipped"
    assert check_rank(model, _gpu_report(), None, 2, 0.1).summary.startswith("sequence length unknown")


def test_which_layers_run_fused():
    """resolve_kernel's rule on the dtype the layer receives (its weights'), and routed dynamic-rank layers never."""
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_llama
    from sits_lora.training.constraints import layer_runs_fused

    def q_proj(model):
        return model.base_model.model.model.layers[0].self_attn.q_proj

    def sits(dtype=torch.bfloat16, **kwargs):
        return q_proj(get_peft_model(tiny_llama(dtype=dtype), sits_lora.SitsLoraConfig(
            r=8, target_modules=["q_proj"], **kwargs)))

    assert layer_runs_fused(sits(), cuda=True) and layer_runs_fused(sits(torch.float16), cuda=True)
    assert not layer_runs_fused(sits(), cuda=False)
    assert not layer_runs_fused(sits(torch.float32), cuda=True)  # fp32 input: "auto" runs the reference
    assert layer_runs_fused(sits(torch.float32), cuda=True, autocast_dtype=torch.bfloat16)  # computed in bf16
    assert layer_runs_fused(sits(torch.float32, kernel="triton"), cuda=True)
    assert not layer_runs_fused(sits(kernel="torch"), cuda=True)
    assert not layer_runs_fused(q_proj(get_peft_model(tiny_llama(dtype=torch.bfloat16), LoraConfig(
        r=8, target_modules=["q_proj"]))), cuda=True)
    routed = sits(use_dynamic_rank=True, rank_scheduler="learned", rank_buckets=[2, 4, 6, 8], target_mean_rank=4)
    assert not layer_runs_fused(routed, cuda=True)
    routed.eval()  # a model from from_pretrained, at train begin (the Trainer calls model.train() later)
    assert not layer_runs_fused(routed, cuda=True) and not routed.training
    static = sits(use_dynamic_rank=True, rank_scheduler="static", rank_buckets=[2, 4, 6, 8]).eval()
    assert not static.routing_on("default")  # full rank at inference, but nested per-token masks in training
    assert not layer_runs_fused(static, cuda=True)


def test_pcie_accounting_and_check():
    model = llama("sits", False)
    parts = pcie_bytes_per_step(model, batch_bytes=3 * 4 * 2048 * 8, activation_offload_bytes=0,
                                gradient_checkpointing=False, accumulation=2)
    assert parts == {"batch": 2 * 3 * 4 * 2048 * 8}  # a CPU model has nothing offloaded from a GPU
    offload = pcie_bytes_per_step(model, batch_bytes=0, activation_offload_bytes=10 * 2**20,
                                  gradient_checkpointing=True, accumulation=1)
    assert offload["offloaded_activations"] == 2 * 10 * 2**20  # to the host in forward, back in backward

    class Streamer(nn.Module):
        def sits_pcie_bytes_per_step(self):
            return 5 * 2**30

    model.base_model.model.streamer = Streamer()
    streamed = pcie_bytes_per_step(model, batch_bytes=0, activation_offload_bytes=0, gradient_checkpointing=False,
                                   accumulation=1)
    assert streamed["reported_by_modules"] == 5 * 2**30
    ok = check_pcie(parts, _gpu_report(), step_seconds=0.5, step_source="roofline estimate")
    assert ok.status == "ok" and "MiB per step" in ok.summary
    over = check_pcie(streamed, _gpu_report(), step_seconds=0.05, step_source="measured")
    assert over.status == "violated" and "cannot hide behind compute" in over.summary
    assert "reported_by_modules" in over.suggestions[0]
    assert check_pcie(parts, hw.probe_hardware("cpu"), 0.5, "x").status == "skipped"


# ----------------------------------------------------------------------------- INT4 alignment


def _linear4bit(in_features: int, out_features: int):
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    return layer.to("cpu")  # quantizes on the CPU backend


@needs_bnb
def test_int4_aligned_layers_pass():
    model = nn.Sequential(_linear4bit(128, 64), _linear4bit(64, 32))
    result = check_int4(model)
    assert result.status == "ok" and result.details["layers_checked"] == 2


@needs_bnb
def test_int4_misaligned_layer_is_named_with_its_fix():
    model = nn.Sequential(_linear4bit(128, 64), _linear4bit(64, 32))
    weight = model[1].weight
    packed = weight.data
    buffer = torch.empty(packed.numel() + 1, dtype=torch.uint8)
    view = buffer[1:].view(packed.shape)  # one byte into a shared buffer: what a flat loader can produce
    view.copy_(packed)
    weight.data = view
    result = check_int4(model)
    assert result.status == "violated" and len(result.suggestions) == 1
    assert result.suggestions[0].startswith("1 (32 x 64): packed weight at byte offset 1 mod 32")
    assert "module.weight.data = module.weight.data.clone()" in result.suggestions[0]
    weight.data = weight.data.clone()  # the fix the message names
    assert check_int4(model).status == "ok"


@needs_bnb
def test_int4_odd_shaped_layer_is_named_with_its_fix():
    model = nn.Sequential(_linear4bit(100, 48), _linear4bit(128, 30))
    result = check_int4(model)
    assert result.status == "violated"
    assert result.suggestions == [
        "0 (48 x 100): in_features=100 is not a multiple of the 4-bit block size 64, so blocks straddle rows; fix: "
        "exclude it from 4-bit quantization (BitsAndBytesConfig(llm_int8_skip_modules=['0'])) or pad in_features "
        "to 128"
    ]


@needs_bnb
def test_int4_strict_stops_training_before_the_first_step(tmp_path):
    from peft import get_peft_model
    from transformers import TrainingArguments

    from conftest import tiny_llama
    from test_guardrails_faults import make_dataset

    model = tiny_llama()
    model.model.layers[1].mlp.down_proj = _linear4bit(80, 48)  # intermediate size 80: not whole 64-blocks
    model = get_peft_model(model, sits_lora.SitsLoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to="none")
    trainer = sits_lora.NativeLoraTrainer(model=model, args=args, train_dataset=make_dataset(8),
                                          callbacks=[sits_lora.SitsHardwareCallback(policy={"int4": "strict"})])
    with pytest.raises(sits_lora.training.HardwareConstraintError) as info:
        trainer.train()
    assert "base_model.model.model.layers.1.mlp.down_proj (48 x 80): in_features=80" in str(info.value)
    assert trainer.state.global_step == 0


def test_int4_without_bitsandbytes_layers_is_skipped():
    assert check_int4(tiny_mlp()).status in ("skipped",)


def test_memory_plan_dataclass_roundtrip():
    plan = plan_memory(llama("sits", False), 1, 32)
    restored = MemoryPlan(**{k: v for k, v in plan.to_dict().items() if k != "total_gib"})
    assert restored == plan


# ----------------------------------------------------------------------------- bench/memory_plan.py


def _bench_module():
    import os

    from conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("memory_plan_bench", os.path.join(REPO_ROOT, "bench", "memory_plan.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_memory_plan_bench_smoke(tmp_path):
    """The GPU script's CPU mode, in this process: one configuration end to end (bf16 autocast, as on the GPU),
    JSON / CSV / PNG written."""
    assert _bench_module().main(["--smoke", "--modes", "sits", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "memory_plan.json").read_text())
    (row,) = result["rows"]
    assert row["status"] == "ok" and row["within_tolerance"] and row["measured_peak_gib"] > 0, row
    assert result["environment"]["torch"] == torch.__version__ and "git_revision" in result["environment"]
    assert (tmp_path / "memory_plan.csv").exists() and (tmp_path / "memory_plan.png").exists()


def test_memory_plan_bench_bad_arguments(tmp_path, capsys):
    bench = _bench_module()
    assert bench.main(["--models", "70b", "--out", str(tmp_path)]) == 2
    assert "error: --models 70b: unknown; allowed: 1b, 8b, tiny" in capsys.readouterr().err
    assert bench.main(["--modes", "sits,qlora", "--out", str(tmp_path)]) == 2
    assert "error: --modes qlora: unknown; allowed: sits, sits+gc, peft, peft+gc" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--out", str(tmp_path)]) == 2
        assert "error: no CUDA device; use --smoke" in capsys.readouterr().err


def test_probe_calls_sibling_layers_together_and_leaves_their_group_as_it_was():
    """Under sibling fusion q / k / v run as one operation fed one tensor: the probe calls them that way, and
    restores the group's state, so that probing never disables the fusion for the run that follows."""
    model = llama("sits", False)
    attn = model.base_model.model.model.layers[0].self_attn
    calls = []

    class RecordingGroup:
        def __init__(self, layers):
            self.layers, self.enabled, self._pending = layers, True, {}

        def holds_output(self, layer, x):
            return False  # every call reaches forward below

        def forward(self, layer, x):
            calls.append((layer, x))
            self._pending[id(layer)] = x  # what a real group keeps for the siblings not called yet
            self.enabled = False
            return None  # run the layer on its own

    group = RecordingGroup([attn.q_proj, attn.k_proj, attn.v_proj])
    for layer in group.layers:
        layer.sibling_group = group
    plan_memory(model, 2, 64)
    assert group.enabled is True and group._pending == {}
    probe_calls = [c for c in calls if c[1].shape[1] in (16, 32)]
    assert [layer for layer, _ in probe_calls[:3]] == group.layers
    assert probe_calls[0][1] is probe_calls[1][1] is probe_calls[2][1]


def test_activation_watch_keeps_the_fused_path():
    """A hook on a base layer would send sits_lora layers down PEFT's path; the watch hooks the layer itself."""
    from sits_lora.activations.recompute import remember_norm_io
    from sits_lora.training.guards import ActivationWatch

    model = llama("sits", False)
    watch = ActivationWatch()
    watch.attach(model)
    layers = [m for m in model.modules() if isinstance(m, sits_lora.SitsLoraLinear)]
    assert layers and all(not m.base_layer._forward_hooks and m._forward_hooks for m in layers)
    assert all(m.fused_adapter((), {}) is not None for m in layers)
    watch.detach()
    # what stays is the model's own: the norms' hooks of sits_lora.activations (recompute_lora_inputs)
    assert all(h is remember_norm_io for m in model.modules() for h in m._forward_hooks.values())
