"""The fp8 implicit-GEMM convolution (sits_lora.ops.fp8_conv) against plain PyTorch: on the Triton interpreter with
fp32 / fp16 codes (the kernel is dtype-generic; the interpreter has no fp8 dot) on odd shapes, strides, 1x1 and 3x3
kernels, both memory formats; the operator under torch.compile; on a GPU, e4m3 codes against the fp32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sits_lora.ops.fp8_conv import (conv2d_fp8, conv2d_fp8_op, conv2d_fp8_reference, conv_config, conv_k_block,
                                    pack_conv_weight, unpack_conv_weight)

ON_GPU = torch.cuda.is_available()


def _problem(batch, c_in, height, width, c_out, kernel, dtype, channels_last=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c_in, height, width, generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(c_out, c_in, kernel, kernel, generator=g).to(dtype)
    x_inv = torch.tensor([0.25])
    w_inv = torch.rand(c_out, generator=g) + 0.5
    bias = torch.randn(c_out, generator=g)
    return x, w, x_inv, w_inv, bias


@pytest.mark.parametrize("case", [
    # batch, C_in, H, W, C_out, kernel, stride, padding
    (2, 32, 7, 9, 24, 3, 1, 1),      # C_out not a multiple of the tile, H != W
    (1, 48, 8, 6, 20, 3, 2, 1),      # stride 2 (a downsampler), even input
    (1, 16, 7, 5, 40, 3, 2, 1),      # stride 2, odd input: the last row / column taps fall in the padding
    (2, 16, 5, 5, 16, 1, 1, 0),      # 1x1 (a ResNet shortcut)
    (1, 32, 4, 4, 18, 3, 1, 0),      # no padding: a smaller output
], ids=["3x3", "3x3-s2", "3x3-s2-odd", "1x1", "3x3-valid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_kernel_equals_the_reference(case, dtype, bias):
    batch, c_in, height, width, c_out, kernel, stride, padding = case
    x, w, x_inv, w_inv, b = _problem(batch, c_in, height, width, c_out, kernel, dtype)
    b = b if bias else None
    y = conv2d_fp8(x, pack_conv_weight(w), x_inv, w_inv, b, (kernel, kernel), stride, padding, torch.float32)
    reference = conv2d_fp8_reference(x, w, x_inv, w_inv, b, stride, padding, torch.float32)
    # and the reference is F.conv2d on the dequantized operands
    exact = F.conv2d(x.double() * 0.25, w.double() * w_inv.double().reshape(-1, 1, 1, 1),
                     None if b is None else b.double(), stride=stride, padding=padding)
    assert y.shape == reference.shape == exact.shape
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(reference.double(), exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-4)


def test_kernel_reads_a_contiguous_input_too_and_writes_half_precision():
    x, w, x_inv, w_inv, b = _problem(1, 32, 6, 7, 16, 3, torch.float16, channels_last=False)
    y = conv2d_fp8(x, pack_conv_weight(w), x_inv, w_inv, b, (3, 3), 1, 1, torch.float16)
    reference = conv2d_fp8_reference(x, w, x_inv, w_inv, b, 1, 1, torch.float16)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, reference, rtol=2e-3, atol=2e-3)


def test_packing_round_trips_and_blocks_never_straddle_taps():
    w = torch.randn(8, 48, 3, 3)
    packed = pack_conv_weight(w)
    assert packed.shape == (8, 9 * 48) and packed.is_contiguous()
    torch.testing.assert_close(packed[:, 48:96], w[:, :, 0, 1])   # K order (kh, kw, c): tap (0, 1) is the second run
    torch.testing.assert_close(unpack_conv_weight(packed, (3, 3)), w)
    assert [conv_k_block(c) for c in (320, 640, 48, 16, 24, 4)] == [64, 128, 16, 16, 0, 0]
    assert conv_config(8192, 128)["BLOCK_M"] == 64 and conv_config(1 << 20, 128)["BLOCK_M"] == 128


def test_a_channel_count_the_kernel_cannot_take_is_refused_with_the_fix():
    x, w, x_inv, w_inv, b = _problem(1, 24, 4, 4, 16, 3, torch.float32)
    with pytest.raises(ValueError, match="C_in=24 is not a multiple of 16; keep this convolution in bf16"):
        conv2d_fp8(x, pack_conv_weight(w), x_inv, w_inv, b, (3, 3), 1, 1, torch.float32)


def test_the_operator_compiles_as_one_opaque_call():
    x, w, x_inv, w_inv, b = _problem(2, 32, 5, 6, 16, 3, torch.float32)
    packed = pack_conv_weight(w)

    def run(x):
        return conv2d_fp8_op(x * 1.0, packed, x_inv, w_inv, b, 3, 3, 1, 1, torch.float32).relu()

    eager = run(x)
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager)
    torch.library.opcheck(conv2d_fp8_op, (x, packed, x_inv, w_inv, b, 3, 3, 1, 1, torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with fp8 tensor cores")
@pytest.mark.parametrize("case", [(2, 320, 33, 320, 3, 1), (1, 640, 17, 130, 3, 2), (2, 128, 40, 64, 1, 1),
                                  (1, 256, 64, 128, 3, 1)], ids=["320", "640-s2-odd", "1x1", "vae-like"])
def test_on_the_gpu_e4m3_codes_match_the_reference(case):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    batch, c_in, size, c_out, kernel, stride = case
    e4m3 = torch.float8_e4m3fn
    x, w, _, w_inv, b = _problem(batch, c_in, size, size, c_out, kernel, torch.float32)
    x8 = (x * 64).clamp(-448, 448).to(e4m3).cuda().contiguous(memory_format=torch.channels_last)
    w8 = (w * 64).clamp(-448, 448).to(e4m3).cuda()
    x_inv, w_inv = torch.tensor([1 / 64]).cuda(), (w_inv / 64).cuda()
    b = b.cuda().to(torch.bfloat16)
    padding = kernel // 2
    y = conv2d_fp8(x8, pack_conv_weight(w8), x_inv, w_inv, b, (kernel, kernel), stride, padding, torch.bfloat16)
    reference = conv2d_fp8_reference(x8, w8, x_inv, w_inv, b, stride, padding, torch.float32)
    # fp32 accumulation in another order, then one bf16 rounding: within a bf16 ulp or two
    torch.testing.assert_close(y.float(), reference, rtol=1.6e-2, atol=1e-2 * float(reference.abs().max()))


def test_a_tile_too_big_for_the_gpu_falls_back_to_a_smaller_one(monkeypatch):
    """Tiles picked for Hopper ask more shared memory than Ada's SMs have: the launch retries with a small tile."""
    import sits_lora.ops.fp8_conv as module

    x, w, x_inv, w_inv, b = _problem(1, 32, 5, 5, 16, 3, torch.float32)
    launched = []
    kernel = module._conv2d_kernel

    class TooBigOnce:
        def __getitem__(self, grid):
            def run(*args, **cfg):
                launched.append(cfg)
                if len(launched) == 1:
                    raise module.OutOfResources(232448, 101376, "shared memory")
                return kernel[grid](*args, **cfg)
            return run

    monkeypatch.setattr(module, "_conv2d_kernel", TooBigOnce())
    y = conv2d_fp8(x, pack_conv_weight(w), x_inv, w_inv, b, (3, 3), 1, 1, torch.float32)
    assert len(launched) == 2 and launched[1]["num_stages"] == 2 and launched[1]["BLOCK_M"] == 64
    torch.testing.assert_close(y, conv2d_fp8_reference(x, w, x_inv, w_inv, b, 1, 1, torch.float32), rtol=1e-5,
                               atol=1e-4)
    with pytest.raises(module.OutOfResources):   # a configuration asked for explicitly is not second-guessed
        launched.clear()
        conv2d_fp8(x, pack_conv_weight(w), x_inv, w_inv, b, (3, 3), 1, 1, torch.float32,
                   config={"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 1, "num_warps": 1, "num_stages": 1})
