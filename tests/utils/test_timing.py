"""The one timer (sits_lora.utils.timing) and the device probe built on it (sits_lora.utils.device_probe)."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch
from conftest import bench_module

from sits_lora.utils import device_probe, timing
from sits_lora.utils.units import MIB


# a warm-up call, then three timed calls whose median is the 0.04 s one
SLEEPS = [0.4, 0.01, 0.15, 0.04]


def _sleeper(durations: list[float]):
    """fn() sleeping durations[0], durations[1], ... on successive calls (the last one repeated); counts calls."""
    calls = []

    def fn():
        time.sleep(durations[min(len(calls), len(durations) - 1)])
        calls.append(1)

    return fn, calls


# ----------------------------------------------------------------------------- host_seconds


def test_host_seconds_is_the_median_of_the_timed_calls_after_one_warm_up():
    # warm-up 0.4 s (left out), then 0.01, 0.15, 0.04: the median of the three is 0.04
    fn, calls = _sleeper(SLEEPS)
    seconds = timing.host_seconds(fn, reps=3, budget_s=10.0)
    assert len(calls) == 4
    assert 0.04 <= seconds < 0.15  # sleep never returns early; neither the fastest nor the slowest call


def test_host_seconds_times_at_least_three_calls_and_at_most_reps():
    fn, calls = _sleeper([0.0])
    timing.host_seconds(fn, reps=7, budget_s=10.0)
    assert len(calls) == 1 + 7  # budget left, stopped by reps
    fn, calls = _sleeper([0.01])
    timing.host_seconds(fn, reps=100, budget_s=0.0)
    assert len(calls) == 1 + 3  # budget spent at once: the minimum
    fn, calls = _sleeper([0.01])
    timing.host_seconds(fn, reps=None, budget_s=0.2)
    assert 1 + 3 < len(calls) <= 1 + 21  # no cap: as many as the budget allows


def test_host_seconds_with_sync_synchronizes_around_every_call(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    fn, calls = _sleeper([0.0])
    timing.host_seconds(fn, reps=3, budget_s=10.0, sync=True)
    assert len(calls) == 4 and len(syncs) == 2 * 4
    syncs.clear()
    timing.host_seconds(fn, reps=3, budget_s=10.0)
    assert syncs == []


# ----------------------------------------------------------------------------- gpu_seconds and median_seconds


def _fake_triton(monkeypatch, milliseconds: float) -> list:
    """A stand-in ``triton.testing`` whose do_bench records its arguments and answers ``milliseconds``."""
    seen = []

    def do_bench(fn, **kwargs):
        fn()
        seen.append(kwargs)
        return milliseconds

    testing = types.ModuleType("triton.testing")
    testing.do_bench = do_bench
    triton = types.ModuleType("triton")
    triton.testing = testing
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.testing", testing)
    return seen


def test_gpu_seconds_is_do_bench_median_in_seconds(monkeypatch):
    seen = _fake_triton(monkeypatch, 2.5)
    assert timing.gpu_seconds(lambda: None) == pytest.approx(2.5e-3)
    assert seen == [{"warmup": 25, "rep": 100, "return_mode": "median"}]
    timing.gpu_seconds(lambda: None, warmup_ms=5, rep_ms=40)
    assert seen[-1] == {"warmup": 5, "rep": 40, "return_mode": "median"}


def test_median_seconds_uses_the_host_timer_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(timing, "gpu_seconds", lambda *a, **k: pytest.fail("the GPU timer ran without CUDA"))
    fn, calls = _sleeper(SLEEPS)
    seconds = timing.median_seconds(fn, rep_ms=0, reps=None)
    assert len(calls) == 4 and 0.04 <= seconds < 0.15
    fn, calls = _sleeper([0.0])
    timing.median_seconds(fn, rep_ms=10_000, reps=6)
    assert len(calls) == 1 + 6


def test_median_seconds_uses_the_gpu_timer_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen = _fake_triton(monkeypatch, 4.0)
    assert timing.median_seconds(lambda: None, warmup_ms=1, rep_ms=2) == pytest.approx(4e-3)
    assert seen == [{"warmup": 1, "rep": 2, "return_mode": "median"}]


def test_harness_median_ms_is_the_timer_in_milliseconds(monkeypatch):
    harness = bench_module("harness")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fn, calls = _sleeper(SLEEPS)
    ms = harness.median_ms(fn, rep_ms=0)
    assert len(calls) == 4 and 40 <= ms < 150


# ----------------------------------------------------------------------------- device_probe on the CPU


def test_cpu_copy_bandwidth_counts_read_and_write():
    nbytes = 16 * MIB
    bandwidth, seconds = device_probe.copy_bandwidth("cpu", nbytes, reps=3)
    assert seconds > 0 and bandwidth > 0
    assert bandwidth == pytest.approx(2 * nbytes / seconds)


def test_cpu_matmul_rate_counts_2_n_cubed():
    n = 256
    for dtype in (torch.float32, torch.bfloat16):
        rate, seconds = device_probe.matmul_rate("cpu", n, dtype, reps=3)
        assert seconds > 0 and rate == pytest.approx(2 * n**3 / seconds)


def test_fp8_matmul_rate_measures_the_first_format_that_runs():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no fp8 types")
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    try:
        rate, seconds, name = device_probe.fp8_matmul_rate(a, b, reps=3)
    except device_probe.Fp8MatmulError as error:
        pytest.skip(f"torch._scaled_mm does not run on this CPU: {error}")
    assert name == device_probe.FP8_FORMATS[0] and seconds > 0
    assert rate == pytest.approx(2 * 64 * 32 * 48 / seconds)


def test_fp8_matmul_rate_reports_every_format_that_failed():
    a, b = torch.randn(4, 8), torch.randn(4, 8)  # k disagrees: _scaled_mm fails in every format
    with pytest.raises(device_probe.Fp8MatmulError) as failed:
        device_probe.fp8_matmul_rate(a, b)
    tried = [f for f in device_probe.FP8_FORMATS if hasattr(torch, f)]
    assert [name for name, _ in failed.value.errors] == tried
    assert all(isinstance(error, (RuntimeError, TypeError)) for _, error in failed.value.errors)
    if tried:
        assert str(failed.value).startswith(f"{tried[0]}: RuntimeError: ")
    with pytest.raises(device_probe.Fp8MatmulError) as none:
        device_probe.fp8_matmul_rate(a, b, formats=("float8_no_such_format",))
    assert none.value.errors == [] and str(none.value) == ""


def test_pinned_bandwidth_needs_cuda_and_a_direction():
    with pytest.raises(ValueError, match="need a CUDA device"):
        device_probe.pinned_bandwidth("cpu", MIB, "host->device")
    with pytest.raises(ValueError, match="use one of 'host->device', 'device->host'"):
        device_probe.pinned_bandwidth("cuda", MIB, "h2d")


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_gpu_timer_agrees_with_a_synchronized_host_timer():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    gpu = timing.gpu_seconds(lambda: a @ a)
    host = timing.host_seconds(lambda: a @ a, reps=20, sync=True)
    assert 0 < gpu <= host * 1.5  # host time adds launch and synchronization, never less GPU work
    assert timing.median_seconds(lambda: a @ a) == pytest.approx(gpu, rel=0.5)


@pytest.mark.gpu
def test_gpu_device_probe_measures_every_number():
    bandwidth, seconds = device_probe.copy_bandwidth("cuda", 256 * MIB)
    assert bandwidth > 1e11 and bandwidth == pytest.approx(2 * 256 * MIB / seconds)
    for direction in device_probe.DIRECTIONS:
        rate, seconds = device_probe.pinned_bandwidth(torch.device("cuda", 0), 64 * MIB, direction)
        assert rate > 1e9 and rate == pytest.approx(64 * MIB / seconds), direction
    flops, seconds = device_probe.matmul_rate("cuda", 4096, torch.bfloat16)
    assert flops > 1e13 and flops == pytest.approx(2 * 4096**3 / seconds)
    if torch.cuda.get_device_capability() >= (8, 9) and not torch.version.hip:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        flops8, seconds, name = device_probe.fp8_matmul_rate(a, a)
        assert name == "float8_e4m3fn" and flops8 > flops
