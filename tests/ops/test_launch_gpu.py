"""The direct Triton launch (sits_lora.ops.launch) on a CUDA GPU: same results as Triton's own launch.

The launcher reuses a compiled kernel for every call whose arguments fall in the same specialization
class (dtype, 16-byte alignment, integers 1 / multiple of 16 / other). If the class missed a fact
Triton specializes on, a call would run a kernel compiled for other inputs: misaligned or strided
inputs would then read wrong memory. Each case runs the same kernels through the direct path and
through JITFunction.run and asks for identical bits.
"""

from __future__ import annotations

import pytest
import torch

from sits_lora.ops import fused, fused_backward

pytestmark = pytest.mark.gpu


def _passes(x, A, B, dy, scale=2.0):
    h = fused.lora_shrink(x, A)
    y = fused.lora_expand(h, B, scale, None, x.dtype)
    g_part, db_part = fused.lora_dy_pass_parts(dy, B, h, scale)
    da_part, dx = fused.lora_x_pass_parts(x, A, g_part, scale, write_dx=True)
    dA, dB = fused.sum_partials(da_part, db_part)
    return [h, y, dx, dA, dB]


def _inputs(T, K, N, R, misaligned: bool, strided: bool):
    gen = torch.Generator(device="cuda").manual_seed(T * 7 + K)
    pad = 3 if strided else 0
    off = 1 if misaligned else 0
    wide = torch.randn(T, K + pad + off, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = wide[:, off:off + K]
    A = torch.randn(R, K, device="cuda", generator=gen) * 0.05
    B = torch.randn(N, R, device="cuda", generator=gen) * 0.05
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, A, B, dy


@pytest.mark.parametrize("misaligned,strided", [(False, False), (True, False), (False, True), (True, True)])
def test_direct_launch_matches_jit_launch(misaligned, strided):
    launchers = [fused._SHRINK, fused._EXPAND, fused_backward._DY_PASS, fused_backward._X_PASS, fused_backward._SUM_PARTIALS]
    assert all(launcher.direct for launcher in launchers), "the direct path is off on this Triton"
    before = [launcher.direct_launches for launcher in launchers]
    # token counts of every class, run in an order that puts a new class after a cached one
    for T in (1, 256, 37, 4096, 16, 333, 8192):
        for K, N, R in ((2048, 8192, 16), (96, 80, 5)):
            x, A, B, dy = _inputs(T, K, N, R, misaligned, strided)
            for launcher in launchers:
                launcher.direct = False
            try:
                expected = _passes(x, A, B, dy)
            finally:
                for launcher in launchers:
                    launcher.direct = True
            for _ in range(2):  # the first call may compile and fill the cache, the second launches directly
                got = _passes(x, A, B, dy)
            torch.cuda.synchronize()
            for name, e, g in zip(("h", "y", "dx", "dA", "dB"), expected, got):
                assert torch.equal(e, g), f"{name} differs at T={T}, {K}x{N} r{R}, misaligned={misaligned}"
    launched = [launcher.direct_launches - b for launcher, b in zip(launchers, before)]
    assert all(n > 0 for n in launched), f"a launcher never took the direct path: {launched}"
