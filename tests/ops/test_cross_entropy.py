"""The chunked linear cross-entropy (sits_lora.ops.cross_entropy) against the fp32 reference: loss and both
gradients on odd shapes (V = 97 and 1000 across several blocks of V, rows across several chunks), ignored rows (some,
a whole chunk, the whole batch), num_items as a tensor, a number or None, an upstream gradient of 3; on the Triton
kernel (the interpreter on the CPU) and on the PyTorch path. Then: no host sync in forward or backward, the input
errors, and on a GPU bf16 at a Llama-3 vocabulary, recorded in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from sits_lora import ops
from sits_lora.ops import cross_entropy as ce

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}

# id: (leading shape, H, V, dtype, chunk_rows, W trains, which labels are ignored, num_items, MAX_BLOCK_V)
CASES = {
    "fp32-V97-chunks-of-8": ((37,), 24, 97, torch.float32, 8, True, "some", None, 32),
    "fp32-V1000-frozen-W-num-items": ((37,), 24, 1000, torch.float32, 16, False, "some", "tensor", 128),
    "fp32-a-chunk-all-ignored": ((37,), 24, 97, torch.float32, 8, True, "chunk", 50, 64),
    "fp32-leading-dims-non-contiguous": ((3, 13), 24, 97, torch.float32, 10, True, "some", None, None),
    "fp32-all-ignored": ((37,), 24, 97, torch.float32, 8, True, "all", None, 32),
    "fp32-all-ignored-num-items": ((37,), 24, 97, torch.float32, 8, False, "all", "tensor", 32),
    "fp16-V97-chunk-ignored": ((37,), 24, 97, torch.float16, 8, True, "chunk", "tensor", 32),
    "fp16-V1000-frozen-W-one-chunk": ((37,), 24, 1000, torch.float16, None, False, "some", None, 128),
}


def _problem(lead, H, V, dtype, ignored, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    if len(lead) > 1:   # (B, T, H) as the transpose of a (T, B, H) tensor: not contiguous
        hidden = torch.randn(*reversed(lead), H, generator=gen).transpose(0, 1)
    else:
        hidden = torch.randn(*lead, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    labels = torch.randint(0, V, lead, generator=gen)
    flat = labels.view(-1)
    if ignored == "some":
        flat[::3] = -100
    elif ignored == "chunk":   # rows 8..15: the second chunk of 8 has no label
        flat[8:16] = -100
        flat[::5] = -100
    elif ignored == "all":
        flat[:] = -100
    labels = flat.view(lead)
    return hidden.to(device, dtype), weight.to(device, dtype), labels.to(device)


def _run(fn, hidden, weight, labels, train_weight, num_items):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(train_weight)
    loss = fn(h, w, labels, num_items=num_items)
    (loss * 3).backward()
    return loss.detach(), h.grad, w.grad


def _check_case(case, device=DEVICE):
    lead, H, V, dtype, chunk_rows, train_weight, ignored, num_items, _ = CASES[case]
    hidden, weight, labels = _problem(lead, H, V, dtype, ignored, device=device)
    if num_items == "tensor":
        num_items = torch.tensor(23.0, device=hidden.device)
    got = _run(lambda *a, **k: ops.linear_cross_entropy(*a, chunk_rows=chunk_rows, **k),
               hidden, weight, labels, train_weight, num_items)
    want = _run(ce.linear_cross_entropy_reference, hidden, weight, labels, train_weight, num_items)
    loss, dh, dw = got
    assert loss.shape == () and loss.dtype == torch.float32
    assert dh.shape == hidden.shape and dh.dtype == dtype
    assert (dw is not None) == train_weight
    if ignored == "all":
        assert loss.item() == 0.0
        assert torch.isfinite(dh).all() and not dh.any()
        assert dw is None or (torch.isfinite(dw).all() and not dw.any())
        return
    assert abs(loss.item() - want[0].item()) <= TOL[dtype] * abs(want[0].item())
    assert rel_err(dh, want[1]) < TOL[dtype]
    if train_weight:
        assert dw.dtype == dtype and rel_err(dw, want[2]) < TOL[dtype]


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_reference(case, monkeypatch):
    """The Triton path (the interpreter on the CPU); MAX_BLOCK_V lowered so that V spans blocks at these sizes."""
    block = CASES[case][-1]
    if block is not None:
        monkeypatch.setattr(ce, "MAX_BLOCK_V", block)
    assert ce._use_kernel(torch.empty(0, device=DEVICE))
    _check_case(case)


@pytest.mark.parametrize("case", CASES)
def test_torch_path_equals_the_reference(case, monkeypatch):
    """The PyTorch path: CPU tensors with the interpreter off."""
    device = _on_path("torch", monkeypatch)
    assert not ce._use_kernel(torch.empty(0, device=device))
    _check_case(case, device=device)


def _on_path(path, monkeypatch) -> str:
    """The device a test of ``path`` runs on: the kernel's (CUDA, or the CPU under the interpreter), or the CPU with
    the interpreter off for the PyTorch path."""
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return "cpu"
    return DEVICE


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_no_host_sync_in_forward_or_backward(path, monkeypatch):
    """Every way a tensor's value reaches the host raises; forward and backward still run (on a GPU the GPU test
    below checks the same with torch.cuda.set_sync_debug_mode)."""
    device = _on_path(path, monkeypatch)
    hidden, weight, labels = _problem((37,), 24, 97, torch.float32, "chunk", device=device)
    ce.linear_cross_entropy(hidden, weight, labels, chunk_rows=8)   # the kernel compiles (interprets) once first
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync: a tensor's value was read on the host")

    losses = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, refuse)
        with pytest.raises(AssertionError, match="a host sync"):
            bool(labels.sum())
        for num_items in (None, torch.tensor(23.0, device=device), 23):
            loss = ce.linear_cross_entropy(h, w, labels, num_items=num_items, chunk_rows=8)
            (loss * 3).backward()
            losses.append(loss.detach())
    assert all(torch.isfinite(loss) for loss in losses) and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_out_of_range_label_gives_a_nan_loss(path, monkeypatch):
    """A label outside [0, V) cannot be refused without a sync: its loss is NaN (memory stays in bounds); rows
    without one keep their loss."""
    hidden, weight, labels = _problem((6,), 16, 40, torch.float32, "none", device=_on_path(path, monkeypatch))
    bad = labels.clone()
    bad[2] = 40
    assert torch.isnan(ce.linear_cross_entropy(hidden, weight, bad))
    bad[2] = -100
    torch.testing.assert_close(ce.linear_cross_entropy(hidden, weight, bad),
                               ce.linear_cross_entropy_reference(hidden, weight, bad), rtol=1e-5, atol=1e-6)


def test_loss_without_gradients():
    """Under no_grad, and with nothing to differentiate: the loss alone, equal to the reference's."""
    hidden, weight, labels = _problem((37,), 24, 97, torch.float32, "some")
    want = ce.linear_cross_entropy_reference(hidden, weight, labels)
    torch.testing.assert_close(ce.linear_cross_entropy(hidden, weight, labels), want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        loss = ce.linear_cross_entropy(hidden.requires_grad_(True), weight, labels)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_no_rows_give_a_zero_loss_and_an_empty_gradient():
    hidden = torch.randn(0, 8, requires_grad=True)
    loss = ops.linear_cross_entropy(hidden, torch.randn(11, 8), torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.shape == (0, 8)


def test_chunk_rows_come_from_the_shapes():
    """Chunks under max(hidden's bytes, LOGITS_CHUNK_BYTES) of logits, cut even."""
    assert ce.chunk_rows_for(37, 97, 24, 4) == 37
    assert ce.chunk_rows_for(4096, 128256, 2048, 2) == 1024          # 4 chunks of 256 MiB
    assert ce.chunk_rows_for(32768, 128256, 4096, 2) == 1024         # 32 chunks
    rows = ce.chunk_rows_for(262144, 151936, 8192, 2)                 # hidden 4 GiB: chunks of about as much
    assert rows == 13798 and rows * 151936 * 2 <= 262144 * 8192 * 2   # 19 chunks
    assert ce.chunk_rows_for(1, 10**6, 8, 4) == 1


def test_bad_inputs_are_refused_with_the_fix():
    hidden, weight, labels = _problem((2, 5), 16, 40, torch.float32, "none", device="cpu")
    bad = [
        ((hidden, weight, labels[:, :4]), {}, ValueError, r"labels has shape \(2, 4\) but hidden \(2, 5, 16\)"),
        ((hidden, weight.t(), labels), {}, ValueError, r"weight \(16, 40\).*hidden_size \(40\).*not transposed"),
        ((hidden, weight, labels.float()), {}, TypeError, r"labels has dtype torch.float32.*torch.long"),
        ((hidden, weight.half(), labels), {}, TypeError, r"hidden is torch.float32 but weight is torch.float16"),
        ((hidden, weight[0], labels), {}, ValueError, r"weight has shape \(16,\).*\(vocab, hidden_size\)"),
        ((hidden.long(), weight, labels), {}, TypeError, r"hidden has dtype torch.int64.*floating-point"),
        ((hidden, weight, labels), {"num_items": 0}, ValueError, r"num_items=0.*positive count"),
        ((hidden, weight, labels), {"num_items": torch.ones(2)}, ValueError, r"num_items has shape \(2,\)"),
        ((hidden, weight, labels), {"chunk_rows": 0}, ValueError, r"chunk_rows=0.*positive int"),
    ]
    for args, kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            ce.linear_cross_entropy(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_bf16_at_a_llama3_vocabulary_and_in_a_cuda_graph():
    """N = 4096, H = 2048, V = 128,256 in bf16 against the fp32 reference; no sync under sync_debug_mode "error";
    then forward + backward recorded in a CUDA graph and replayed on new hidden states, labels (another count of
    ignored rows) and num_items, equal to eager."""
    free = torch.cuda.mem_get_info()[0]
    N, H = 4096, 2048
    V = 128256 if free > 24 * 2**30 else 32000
    gen = torch.Generator(device="cuda").manual_seed(0)

    def problem(ignore_every):
        h = torch.randn(N, H, device="cuda", generator=gen).bfloat16()
        y = torch.randint(0, V, (N,), device="cuda", generator=gen)
        y[::ignore_every] = -100
        return h, y

    hidden, labels = problem(3)
    weight = (torch.randn(V, H, device="cuda", generator=gen) / H**0.5).bfloat16().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    loss = ops.linear_cross_entropy(h, weight, labels)
    (loss * 3).backward()
    h_ref = hidden.clone().requires_grad_(True)
    w_ref = weight.detach().clone().requires_grad_(True)
    ref = ce.linear_cross_entropy_reference(h_ref, w_ref, labels)
    (ref * 3).backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    assert rel_err(h.grad, h_ref.grad) < 2e-2 and rel_err(weight.grad, w_ref.grad) < 2e-2
    del h_ref, w_ref, ref
    weight.grad = None

    frozen = weight.detach()
    static_h = hidden.clone().requires_grad_(True)
    static_y = labels.clone()
    static_n = torch.tensor(1000.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                static_h.grad = None
                ops.linear_cross_entropy(static_h, frozen, static_y, num_items=static_n).backward()
        torch.cuda.current_stream().wait_stream(side)
        static_h.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = ops.linear_cross_entropy(static_h, frozen, static_y, num_items=static_n)
            static_loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    new_h, new_y = problem(2)
    with torch.no_grad():
        static_h.copy_(new_h)
    static_y.copy_(new_y)
    static_n.fill_(1500.0)
    graph.replay()
    eager_h = new_h.clone().requires_grad_(True)
    eager = ops.linear_cross_entropy(eager_h, frozen, new_y, num_items=torch.tensor(1500.0, device="cuda"))
    eager.backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_loss, eager, rtol=1e-6, atol=0)
    torch.testing.assert_close(static_h.grad, eager_h.grad, rtol=1e-3, atol=1e-6)
