"""ops.bnb4_dequant: bitsandbytes' 4-bit layout (NF4 / FP4, double quantization on and off) dequantized by PyTorch
and by the Triton kernel (the interpreter on a CPU, the GPU where there is one), against bitsandbytes' own
dequantize_4bit, at shapes whose size is not a multiple of the block."""

from __future__ import annotations

import logging
import os

import pytest
import torch

logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
bnb = pytest.importorskip("bitsandbytes")

from sits_lora.bases.bnb4 import dequantized, dequantizer, layout_of  # noqa: E402
from sits_lora.ops.bnb4_dequant import bnb4_dequantize, bnb4_dequantize_reference, bnb4_scales_reference  # noqa: E402

CASES = [(quant, nested, shape) for quant in ("nf4", "fp4") for nested in (True, False)
         for shape in ((7, 96), (48, 64), (3, 5))]


def quantized(shape, quant, nested, device="cpu", dtype=torch.float32, blocksize=64):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(device, dtype)
    return bnb.functional.quantize_4bit(w, quant_type=quant, compress_statistics=nested, blocksize=blocksize)


@pytest.mark.parametrize("quant,nested,shape", CASES)
def test_reference_and_kernel_match_bitsandbytes(quant, nested, shape):
    packed, state = quantized(shape, quant, nested)
    layout = layout_of(state)
    numel = shape[0] * shape[1]
    reference = bnb4_dequantize_reference(packed, layout, numel)
    if numel % layout.blocksize == 0:
        expected = bnb.functional.dequantize_4bit(packed, state).reshape(-1)
        assert torch.allclose(reference, expected, rtol=1e-6, atol=0)
    else:
        # bitsandbytes' CPU dequantize_4bit (0.50.2) gets a last, partial block's neighbours wrong (errors of a
        # third of the scale); its quantization is right: each value lies within half a code step of the weight
        # (the widest NF4 / FP4 step is a third of the scale) plus the double quantization's scale error
        w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).reshape(-1)
        scales = bnb4_scales_reference(layout)[torch.arange(numel) // layout.blocksize]
        assert ((reference - w).abs() <= scales / 6 + 0.02 * w.abs().max()).all()
    if os.environ.get("TRITON_INTERPRET") == "1":
        out = torch.full((numel,), float("nan"))
        assert torch.allclose(bnb4_dequantize(packed, layout, out), reference, rtol=1e-6, atol=0)


def test_kernel_reads_bytes_stored_in_another_dtype_and_refuses_a_short_buffer():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel on a CPU needs TRITON_INTERPRET=1")
    packed, state = quantized((8, 64), "nf4", True)
    expected = bnb.functional.dequantize_4bit(packed, state).reshape(-1)
    as_half = packed.reshape(-1).view(torch.float16)           # quant_storage=torch.float16: same bytes
    assert torch.allclose(bnb4_dequantize(as_half, layout_of(state), torch.empty(512)), expected, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="fewer than out's 1024 values"):
        bnb4_dequantize(packed, layout_of(state), torch.empty(1024))


def test_the_dequantizer_is_chosen_by_its_environment_variable(monkeypatch):
    monkeypatch.delenv("SITS_LORA_BNB4_DEQUANT", raising=False)
    assert dequantizer() == "triton"
    monkeypatch.setenv("SITS_LORA_BNB4_DEQUANT", "bitsandbytes")
    assert dequantizer() == "bitsandbytes"
    monkeypatch.setenv("SITS_LORA_BNB4_DEQUANT", "fast")
    with pytest.raises(ValueError, match=r"SITS_LORA_BNB4_DEQUANT='fast' is invalid: allowed values are "
                                         r"'bitsandbytes', 'triton'"):
        dequantizer()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant,nested", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_kernel_matches_bitsandbytes_on_a_gpu_at_llama_shapes(monkeypatch, quant, nested, dtype):
    for shape in ((4096, 4096), (14336, 4096), (1024, 4096 + 64)):
        packed, state = quantized(shape, quant, nested, "cuda", dtype)
        expected = bnb.functional.dequantize_4bit(packed, state)
        weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, bnb_quantized=True)
        monkeypatch.setenv("SITS_LORA_BNB4_DEQUANT", "triton")
        ours = dequantized(weight, dtype).clone()
        # float32 products rounded to dtype: equal but where the scale's last bit (FMA or not) moves a rounding
        assert (ours.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2**-7
        assert (ours != expected).float().mean() < 1e-3


def test_a_plain_number_offset_reads_as_the_tensor_would():
    packed, state = quantized((8, 64), "nf4", True)
    expected = bnb4_dequantize_reference(packed, layout_of(state), 512)
    state.offset = float(state.offset)
    layout = layout_of(state)
    assert isinstance(layout.offset, torch.Tensor)
    assert torch.equal(bnb4_dequantize_reference(packed, layout, 512), expected)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert torch.equal(bnb4_dequantize(packed, layout, torch.empty(512)), expected)
