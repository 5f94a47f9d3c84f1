"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes (gloo) train a sits_lora adapter as one process does with the
whole batch: a smoke test that runs where deepspeed is installed (it is not among the test dependencies: CI skips
it; docs/multi-gpu.md says where it ran)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import randomize_lora_weights, tiny_llama
from peft import get_peft_model

from sits_lora import SitsLoraConfig

pytest.importorskip("deepspeed")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_worker.py")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _one_process_losses() -> list:
    model = get_peft_model(tiny_llama(0), SitsLoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                         init_lora_weights=False))
    randomize_lora_weights(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    ids = torch.randint(0, 97, (4, 8), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


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
    for step, expected in enumerate(_one_process_losses()):
        assert (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2 == pytest.approx(expected, rel=1e-4)
