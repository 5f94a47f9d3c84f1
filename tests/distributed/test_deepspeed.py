"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes (gloo) train a sits_lora adapter as one process does with the
whole batch: a smoke test that runs where deepspeed is installed (it is not among the test dependencies: CI skips
it; docs/multi-gpu.md says where it ran)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_data_parallel import _batch, _model, _train

pytest.importorskip("deepspeed")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stage_on_two_processes_trains_as_one_process(stage, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           WORKER, str(stage), str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    # each rank's loss is the mean over its half (equal token counts): their mean is the whole batch's, step by step
    # one process: the same weights, batch and AdamW (lr 1e-2, torch's weight decay 0.01) as the worker's (the
    # worker's layers take the default kernel, the plain PyTorch path on a CPU; this model the Triton one)
    for step, expected in enumerate(_train(_model(), _batch())):
        assert (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2 == pytest.approx(expected, rel=1e-4)
