"""bench/decode_kernels.py on the CPU: how many copies of W keep its timed calls reading W from memory, and its
refusal without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import bench_module

MB = 2**20


def test_copies_fill_twice_the_l2_between_two_reads_of_one_copy():
    bench = bench_module("decode_kernels")
    l2 = 50 * MB
    for nbytes in (2 * MB, 8 * MB, 32 * MB, 117 * MB):
        n = bench.copies_for_cold_l2(nbytes, l2, most=1000)
        assert (n - 1) * nbytes >= 2 * l2 and (n - 2) * nbytes < 2 * l2   # the fewest that do
    assert bench.copies_for_cold_l2(117 * MB, l2) == 2           # a W larger than twice the L2: itself and one more
    assert bench.copies_for_cold_l2(MB // 4, l2) == 64           # bounded
    assert bench.copies_for_cold_l2(0, l2) == 64


def test_a_configuration_that_cannot_run_is_skipped_and_named(capsys, monkeypatch):
    bench = bench_module("decode_kernels")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    small, big = dict(BLOCK_N=16), dict(BLOCK_N=512)

    def time_us(cfg):
        if cfg is big:
            raise RuntimeError("out of resource: shared memory")
        return 3.0

    assert bench.timed_configs([small, big], time_us, "one-row ") == [(3.0, small)]
    assert "skipped one-row {'BLOCK_N': 512}: RuntimeError: out of resource" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    bench = bench_module("decode_kernels")
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--warm-l2"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_sibling_groups_are_timed_at_each_projection_width():
    bench = bench_module("decode_kernels")
    shapes = bench.projection_shapes("8b")
    assert shapes["q+k+v"] == (4096, (4096, 1024, 1024)) and shapes["gate+up"] == (4096, (14336, 14336))
    assert shapes["down"] == (14336, (4096,)) and set(shapes) == set(bench.PROJECTIONS)
