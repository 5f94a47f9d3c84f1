"""The Triton LoRA kernels against the reference: outputs and every gradient, odd shapes.

On the CPU these run under the Triton interpreter (fp32 exact, fp16 by relative error; bf16 is
wrong in the interpreter, so bf16 is checked on the GPU, test_kernels_gpu.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from sits_lora import ops
from sits_lora.ops.choice import GEMM_BACKENDS
from sits_lora.ops.fused import lora_dy_pass, lora_shrink, lora_x_pass
from sits_lora.ops.reference import lora_linear_reference

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _problem(T, K, N, r, dtype, lead=(), bias=True, noncontig=False, seed=0, adapter_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, T, K)
    if noncontig:
        x = torch.randn(*lead, K, T, generator=g).transpose(-1, -2)
    else:
        x = torch.randn(*shape, generator=g)
    W = torch.randn(N, K, generator=g) / K**0.5
    b = torch.randn(N, generator=g) if bias else None
    A = torch.randn(r, K, generator=g) / K**0.5
    B = torch.randn(N, r, generator=g) / r**0.5
    to = lambda t, dt: None if t is None else t.to(DEVICE, dt)  # noqa: E731
    return to(x, dtype), to(W, dtype), to(b, dtype), to(A, adapter_dtype), to(B, adapter_dtype)


def _grads(fn, x, W, b, A, B, s, mask=None):
    x = x.detach().clone().requires_grad_(True)
    A = A.detach().clone().requires_grad_(True)
    B = B.detach().clone().requires_grad_(True)
    x_lora = x * mask if mask is not None else x
    y = fn(x, x_lora, W, b, A, B, s)
    gen = torch.Generator().manual_seed(7)
    dy = torch.randn(y.shape, generator=gen).to(y.device, y.dtype)
    y.backward(dy)
    return y, x.grad, A.grad, B.grad


CASES = [
    # T, K, N, r, lead, bias, noncontig
    (37, 96, 80, 5, (), True, False),
    (37, 96, 80, 16, (2,), False, False),
    (19, 48, 40, 17, (2, 3), True, True),
    (64, 64, 128, 64, (), True, False),
]


@pytest.mark.parametrize("gemm", GEMM_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,K,N,r,lead,bias,noncontig", CASES, ids=[f"T{c[0]}K{c[1]}N{c[2]}r{c[3]}" for c in CASES])
def test_fused_matches_reference_every_gradient(gemm, dtype, T, K, N, r, lead, bias, noncontig):
    x, W, b, A, B = _problem(T, K, N, r, dtype, lead, bias, noncontig)
    s = 0.75
    fused = lambda x, xl, W, b, A, B, s: ops.lora_linear_triton(x, None, W, b, A, B, s, gemm)  # noqa: E731
    y, dx, dA, dB = _grads(fused, x, W, b, A, B, s)
    # oracle: the same inputs in fp64
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    y_ref, dx_ref, dA_ref, dB_ref = _grads(lora_linear_reference, f64(x), f64(W), f64(b), f64(A), f64(B), s)
    assert y.dtype == dtype and y.shape == (*lead, T, N)
    assert dA.dtype == torch.float32 and dB.dtype == torch.float32
    for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dA", dA, dA_ref), ("dB", dB, dB_ref)):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < TOL[dtype], (name, rel_err(got, want))


@pytest.mark.parametrize("gemm", GEMM_BACKENDS)
def test_dropout_input_gets_its_own_gradient(gemm):
    x, W, b, A, B = _problem(29, 64, 48, 8, torch.float32, lead=(2,))
    mask = (torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) > 0.25).to(x) / 0.75
    fused = lambda x, xl, W, b, A, B, s: ops.lora_linear_triton(x, xl, W, b, A, B, s, gemm)  # noqa: E731
    got = _grads(fused, x, W, b, A, B, 2.0, mask)
    want = _grads(lora_linear_reference, x.double(), W.double(), b.double(), A.double(), B.double(), 2.0, mask.double())
    for g_, w_ in zip(got, want):
        assert rel_err(g_, w_) < 1e-5


def test_input_without_grad_skips_dx():
    x, W, b, A, B = _problem(33, 64, 40, 4, torch.float32)
    A.requires_grad_(True)
    B.requires_grad_(True)
    y = ops.lora_linear_triton(x, None, W, b, A, B, 1.0)
    y.sum().backward()
    assert A.grad is not None and B.grad is not None and x.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_building_blocks_against_torch(dtype):
    T, K, N, r = 45, 80, 72, 7
    x, W, b, A, B = _problem(T, K, N, r, dtype)
    h = lora_shrink(x, A)
    assert rel_err(h, x.double() @ A.double().t()) < TOL[dtype]
    dy = torch.randn(T, N).to(x.device, dtype)
    g, dB = lora_dy_pass(dy, B, h, 0.5)
    assert rel_err(g, dy.double() @ B.double()) < TOL[dtype]
    assert rel_err(dB, 0.5 * dy.double().t() @ h.double()) < TOL[dtype]
    dA, dx = lora_x_pass(x, A, g, 0.5, write_dx=True)
    assert rel_err(dA, 0.5 * g.double().t() @ x.double()) < TOL[dtype]
    assert rel_err(dx, 0.5 * g.double() @ A.double()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("silu", [False, True], ids=["gate*up", "silu(gate)*up"])
def test_x_pass_reads_a_product_input_as_the_formed_input(dtype, silu):
    """The x pass on x's two factors (formed as it loads them) gives what it gives on x formed in memory."""
    from sits_lora.ops.fused import lora_x_pass_parts
    from sits_lora.ops.reference import ProductInput

    T, K, r = 45, 80, 7
    gen = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(T, K, generator=gen).to(DEVICE, dtype) for _ in range(2))
    A = (torch.randn(r, K, generator=gen) / K**0.5).to(DEVICE)
    g_parts = torch.randn(2, T, r, generator=gen).to(DEVICE)   # g as the dy pass leaves it: two partial sums
    product = ProductInput(gate, up, silu)
    x = product.value()
    da_p, dx_p = lora_x_pass_parts(product, A, g_parts, 0.5, write_dx=True)
    da_x, dx_x = lora_x_pass_parts(x, A, g_parts, 0.5, write_dx=True)
    assert torch.equal(dx_p, dx_x) and dx_p.dtype == dtype
    if silu:   # the kernel's sigmoid and torch's may differ in the last fp32 bit before x is rounded
        torch.testing.assert_close(da_p, da_x, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-5)
    else:
        assert torch.equal(da_p, da_x)
    assert rel_err(da_p.sum(0), 0.5 * g_parts.sum(0).double().t() @ x.double()) < TOL[dtype]
    with pytest.raises(ValueError, match="strides differ"):
        lora_x_pass_parts(ProductInput(gate, up.t().contiguous().t(), silu), A, g_parts, 0.5, write_dx=False)


def test_kernel_selection():
    cpu = torch.zeros(2, 3)
    assert ops.resolve_kernel("torch", cpu) == "torch"
    assert ops.resolve_kernel("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="allowed values"):
        ops.resolve_kernel("cuda", cpu)


def test_calls_past_32_bit_offsets_run_the_reference(monkeypatch, caplog):
    """The kernels' offsets are 32-bit: a call whose input or output reaches 2**31 elements runs the reference (here
    the limit is lowered to 64 elements), with one warning that names the way out."""
    import logging

    from sits_lora.ops import choice

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(choice, "INT32_ELEMENTS", 64)
    monkeypatch.setattr(choice, "_warned_large", False)
    x = torch.zeros(4, 8)  # 32 elements
    assert ops.resolve_kernel("triton", x, out_features=8) == "triton"
    with caplog.at_level(logging.WARNING, logger="sits_lora"):
        assert ops.resolve_kernel("triton", x, out_features=16) == "torch"  # the 4 x 16 output
        assert ops.resolve_kernel("triton", torch.zeros(2, 4, 8)) == "torch"  # 8 tokens x 8: the input
    assert len([r for r in caplog.records if "32-bit offsets" in r.getMessage()]) == 1
    assert "tile_mlp" in caplog.records[0].getMessage()

    # a layer on that path gives the reference's output and gradients
    from peft import get_peft_model

    from sits_lora import SitsLoraConfig

    model = torch.nn.Sequential(torch.nn.Linear(8, 16))
    config = dict(r=2, lora_alpha=4, target_modules=["0"], init_lora_weights=False)
    reference = get_peft_model(copy.deepcopy(model), SitsLoraConfig(kernel="torch", **config))
    fused = get_peft_model(model, SitsLoraConfig(kernel="triton", **config))
    reference.load_state_dict(fused.state_dict())
    inp = torch.randn(4, 8)
    torch.testing.assert_close(fused(inp), reference(inp), rtol=0, atol=0)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ops.KernelUnavailableError, match="kernel='triton' needs a CUDA GPU.*TRITON_INTERPRET=1"):
        ops.resolve_kernel("triton", torch.zeros(2, 3))


def test_dropout_is_deterministic_under_a_seed_and_matches_peft():
    from peft import LoraConfig, get_peft_model

    from sits_lora import SitsLoraConfig

    from conftest import randomize_lora_weights, tiny_mlp

    kwargs = dict(r=4, lora_alpha=8, target_modules=["lin0", "lin1"], lora_dropout=0.3)
    sits = get_peft_model(tiny_mlp(), SitsLoraConfig(kernel="triton", **kwargs)).train()
    peft = get_peft_model(tiny_mlp(), LoraConfig(**kwargs)).train()
    randomize_lora_weights(sits)
    peft.load_state_dict(sits.state_dict())
    x = torch.randn(3, 5, 24)
    outs = []
    for model in (sits, sits, peft):
        torch.manual_seed(123)
        outs.append(model(x))
    torch.manual_seed(124)
    other = sits(x)
    assert torch.equal(outs[0], outs[1])                 # same seed, same mask, same output
    assert rel_err(outs[0], outs[2]) < 1e-5              # the mask PEFT draws, too
    assert rel_err(outs[0], other) > 1e-3                # another seed, another mask


@pytest.mark.parametrize("kernel,dtype", [("torch", torch.bfloat16), ("triton", torch.float16)])
def test_autocast_trains_like_peft(kernel, dtype):
    """An fp32 model under autocast: the fused path casts like autocast does, forward and backward."""
    from peft import LoraConfig, get_peft_model

    from sits_lora import SitsLoraConfig

    from conftest import assert_autocast_step_like_peft, randomize_lora_weights, tiny_llama

    kwargs = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    sits = get_peft_model(tiny_llama(), SitsLoraConfig(kernel=kernel, **kwargs)).train()
    peft = get_peft_model(tiny_llama(), LoraConfig(**kwargs)).train()
    randomize_lora_weights(sits)
    peft.load_state_dict(sits.state_dict())
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_autocast_step_like_peft(sits, peft, ids, "cpu", dtype)


def test_config_for_remembers_its_answer_until_a_tuning_result_replaces_it(monkeypatch):
    # every launcher asks config_for on every call: the answer comes from memory (host time per launch),
    # and a new tuning result must still reach the next launch
    import triton.testing

    from sits_lora.ops import tuning

    monkeypatch.setattr(tuning, "_device_name", lambda device: "FakeGPU")
    monkeypatch.setattr(tuning, "_capability", lambda device: [9, 0])
    monkeypatch.setattr(tuning, "_cache", {})
    monkeypatch.setattr(tuning, "_answers", {})
    gpu = torch.device("cuda", 0)
    default = tuning.CONFIG_SPACE["shrink"][0]
    assert tuning.config_for("shrink", gpu, (4096, 16), torch.bfloat16) == default
    lookups, config_key = [], tuning.config_key
    monkeypatch.setattr(tuning, "config_key", lambda *a: lookups.append(a) or config_key(*a))
    assert tuning.config_for("shrink", gpu, (4096, 16), torch.bfloat16) == default and lookups == []
    faster = tuning.CONFIG_SPACE["shrink"][5]
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn())
    best, _ = tuning.tune("shrink", gpu, (4096, 16), torch.bfloat16, lambda cfg: 1.0 if cfg == faster else 2.0,
                          save=False)
    assert best == faster and tuning.config_for("shrink", gpu, (4096, 16), torch.bfloat16) == faster
    assert tuning.config_for("shrink", gpu, (2048, 16), torch.bfloat16) == default  # other dims: untouched
    assert tuning._load()["capabilities"] == {"FakeGPU": [9, 0]}   # what a GPU of the same kind may borrow


def _fake_gpu_tuning(monkeypatch, tmp_path, gpu_name: str, packaged_table: dict, capability=lambda: [9, 0]):
    """A GPU named ``gpu_name`` (compute capability ``capability()``) over a packaged tuning table and an empty user
    cache: (the user cache's path, ``fresh``), where ``fresh(kernel, dims)`` is config_for's bf16 answer with both
    tables read again."""
    import json

    from sits_lora.ops import tuning

    packaged = tmp_path / "packaged.json"
    packaged.write_text(json.dumps(packaged_table))
    user = tmp_path / "user.json"
    monkeypatch.setattr(tuning, "_packaged_path", lambda: str(packaged))
    monkeypatch.setenv("SITS_LORA_TUNING_CACHE", str(user))
    monkeypatch.setattr(tuning, "_device_name", lambda device: gpu_name)
    monkeypatch.setattr(tuning, "_capability", lambda device: capability())
    gpu = torch.device("cuda", 0)

    def fresh(kernel: str, dims: tuple) -> dict:
        monkeypatch.setattr(tuning, "_cache", None)
        monkeypatch.setattr(tuning, "_answers", {})
        return tuning.config_for(kernel, gpu, dims, torch.bfloat16)

    return user, fresh


def test_a_gpu_without_entries_takes_those_of_a_gpu_of_its_compute_capability(monkeypatch, tmp_path):
    """An H100 has no packaged entry; the H200's (same SMs, same compute capability) fit it better than the space's
    first configuration. Another capability's entries are not borrowed, and the GPU's own entry (a user's tuning,
    merged over the packaged table with its capabilities) wins."""
    import json

    from sits_lora.ops import tuning

    h200 = dict(BLOCK_T=256, BLOCK_N=128, num_warps=8, num_stages=3)
    capability = {"now": [9, 0]}
    user, fresh = _fake_gpu_tuning(monkeypatch, tmp_path, "NVIDIA H100 80GB HBM3",
                                   {"NVIDIA H200|dy_pass|8192x16|bfloat16": h200,
                                    "capabilities": {"NVIDIA H200": [9, 0]}}, lambda: capability["now"])

    assert fresh("dy_pass", (8192, 16)) == h200
    assert fresh("dy_pass", (2048, 16)) == tuning.CONFIG_SPACE["dy_pass"][0]   # no entry anywhere
    capability["now"] = [8, 0]                                                  # an A100
    assert fresh("dy_pass", (8192, 16)) == tuning.CONFIG_SPACE["dy_pass"][0]
    capability["now"] = [9, 0]
    own = dict(BLOCK_T=64, BLOCK_N=32, num_warps=4, num_stages=3)
    user.write_text(json.dumps({"NVIDIA H100 80GB HBM3|dy_pass|8192x16|bfloat16": own,
                                "capabilities": {"NVIDIA H100 80GB HBM3": [9, 0]}}))
    assert fresh("dy_pass", (8192, 16)) == own
    assert tuning._load()["capabilities"] == {"NVIDIA H200": [9, 0], "NVIDIA H100 80GB HBM3": [9, 0]}


def test_the_factored_x_pass_runs_the_plain_pass_configuration_until_its_own_is_measured(monkeypatch, tmp_path):
    """The x pass over down_proj's SwiGLU factors has a tuning key of its own ("x_pass_product"); where nothing was
    measured for it, it launches with the plain x pass's configuration at the same dims, not the space's first."""
    import json

    from sits_lora.ops import tuning

    plain = dict(BLOCK_T=128, BLOCK_K=128, num_warps=8, num_stages=3)
    own = dict(BLOCK_T=32, BLOCK_K=256, num_warps=4, num_stages=2)
    user, fresh = _fake_gpu_tuning(monkeypatch, tmp_path, "NVIDIA H200",
                                   {"NVIDIA H200|x_pass|8192x16|bfloat16": plain,
                                    "capabilities": {"NVIDIA H200": [9, 0]}})

    assert fresh("x_pass_product", (8192, 16)) == plain
    assert fresh("x_pass_product", (4096, 16)) == tuning.CONFIG_SPACE["x_pass"][0]   # neither measured
    user.write_text(json.dumps({"NVIDIA H200|x_pass_product|8192x16|bfloat16": own}))
    assert fresh("x_pass_product", (8192, 16)) == own and fresh("x_pass", (8192, 16)) == plain
    assert tuning.config_for("x_pass_product", torch.device("cpu"), (8192, 16), torch.bfloat16) == \
        tuning.INTERPRETER_CONFIG["x_pass_product"]


def test_fp32_on_a_gpu_keeps_the_small_blocks_and_the_interpreter_takes_its_own():
    """fp32 on a GPU (the tests against the fp32 reference) runs the small blocks whatever the interpreter uses; the
    interpreter's own blocks apply to CPU tensors only (here the kernel tests' fixture has set them small too)."""
    from sits_lora.ops import tuning

    for kernel in tuning.SMALL_BLOCKS_CONFIG:
        assert tuning.config_for(kernel, torch.device("cuda"), (64, 16), torch.float32) == \
            tuning.SMALL_BLOCKS_CONFIG[kernel]
        assert tuning.config_for(kernel, torch.device("cpu"), (64, 16), torch.float32) == \
            tuning.INTERPRETER_CONFIG[kernel]
    assert set(tuning.SMALL_BLOCKS_CONFIG) == set(tuning.INTERPRETER_CONFIG)


def test_an_fp8_layer_past_32_bit_offsets_names_the_way_out(monkeypatch):
    """The fp8 kernels have no unquantized reference to fall back to: a call past 2**31 elements (here the limit is
    lowered to 64) is an error that says what to do, before any kernel runs."""
    from peft import get_peft_model

    from sits_lora import SitsLoraConfig
    from sits_lora.ops import choice

    monkeypatch.setattr(choice, "INT32_ELEMENTS", 64)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    model = get_peft_model(model, SitsLoraConfig(r=2, target_modules=["0"], fp8="hybrid", fp8_emulate=True,
                                                 fp8_layers="all"))
    layer = model.base_model.model[0]
    layer.frozen_base.state.emulate = False  # as on a GPU: the kernels would run
    monkeypatch.setattr("sits_lora.bases.fp8.check_fp8_device", lambda x, emulate: None)
    from sits_lora.layers.forward_plan import ForwardPlan

    with pytest.raises(ValueError, match="2\\*\\*31 elements.*tile_mlp"):
        layer.frozen_base.fused_forward(layer, ForwardPlan("fused", "default"), torch.randn(4, 32))
