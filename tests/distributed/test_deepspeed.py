"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes (gloo) train a sits_lora adapter as one process does with the
whole batch, save it whole from rank 0 (ZeRO-3's partitions gathered) and plan each rank's memory from its
partitions. Runs where deepspeed is installed (the test extra has it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import without_deepspeed_shm_build
from test_data_parallel import _adapters, _batch, _model, _train

pytest.importorskip("deepspeed")
from sits_lora.training import plan_memory  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("stage, persistence", [(2, None), (3, None), (3, 0)],
                         ids=["zero2", "zero3", "zero3-nothing-persists"])
def test_zero_stage_on_two_processes_trains_as_one_process(stage, persistence, tmp_path):
    extra = [] if persistence is None else [str(persistence)]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           WORKER, str(stage), str(tmp_path), *extra], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600, env=without_deepspeed_shm_build({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    # each rank's loss is the mean over its half (equal token counts): their mean is the whole batch's, step by step
    # one process: the same weights, batch and AdamW (lr 1e-2, torch's weight decay 0.01) as the worker's (the
    # worker's layers take the default kernel, the plain PyTorch path on a CPU; this model the Triton one)
    single = _model()
    for step, expected in enumerate(_train(single, _batch())):
        assert (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2 == pytest.approx(expected, rel=1e-4)
    # the saved adapter is the whole one (ZeRO-3: not the empty placeholders its parameters are between calls)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    expected = {name.replace(".default", ""): value for name, value in _adapters(single).items()}
    assert sorted(saved) == sorted(expected)
    # Adam turns float noise in a near-zero gradient (the reduction order differs) into a step of up to lr = 1e-2: a
    # few values measured 3.6e-5 apart; an adapter left untrained or zero is ~1e-2 off
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], torch.from_numpy(value), rtol=0, atol=5e-4, msg=lambda m: f"{name}: {m}")
    # ZeRO-2 leaves the parameters whole. ZeRO-3 partitions them; by default it keeps those below its persistence
    # threshold (here every one: the largest has 4,656 values) whole on every rank too, from the first forward on:
    # a rank holds whole + its half. With nothing persisting a rank holds its half, and the plan adds the root's
    # parameters and two decoder layers gathered whole at the peak (here: every parameter, two layers in all).
    whole = plan_memory(single, 2, 8, optimizer="adamw")
    total = whole.frozen_weights + whole.adapter_weights
    # every rank plans alike (a layer's probe would gather its partitions: sharded layers are not probed)
    assert ranks[0]["plan"]["activations"] == ranks[1]["plan"]["activations"]
    for rank in ranks:
        plan = rank["plan"]
        assert any("not probed" in note for note in plan["notes"]) == (stage == 3)
        if stage == 2:
            assert plan["frozen_weights"] == whole.frozen_weights and plan["adapter_weights"] == whole.adapter_weights
            continue
        assert 1.45 * total <= plan["frozen_weights"] + plan["adapter_weights"] <= 1.55 * total
        share = 0.5 if persistence == 0 else 1.5
        assert (share - 0.05) * whole.adapter_weights <= plan["adapter_weights"] <= (share + 0.05) * whole.adapter_weights
        assert any(note.startswith("FSDP2 / ZeRO-3") for note in plan["notes"]) == (persistence == 0)
