"""The diffusion recipe's run files: checkpoints (kept two deep, each written whole or not at all), the metrics,
the exported LoRA and the loss plot."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Optional

# what a run writes into its output_dir: a folder holding any of these is another run's
RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "lora", "base")
STATE_FILE = "training_state.pt"
KEEP_CHECKPOINTS = 2


def run_files(output_dir: str) -> list[str]:
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir) if n in RUN_FILES or n.startswith("checkpoint-"))


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every checkpoint-N in output_dir, oldest first."""
    found = [(int(n.split("-", 1)[1]), os.path.join(output_dir, n)) for n in run_files(output_dir)
             if n.startswith("checkpoint-") and n.split("-", 1)[1].isdigit()
             and os.path.isfile(os.path.join(output_dir, n, STATE_FILE))]
    return sorted(found)


def latest_checkpoint(output_dir: str) -> Optional[str]:
    found = checkpoint_dirs(output_dir)
    return found[-1][1] if found else None


def replace_folder(tmp: str, final: str) -> None:
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(tmp, final)


def read_metrics(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def save_checkpoint(output_dir: str, step: int, params: dict, optimizer, recipe,
                    extra: dict) -> str:
    """checkpoint-<step>/training_state.pt: the adapter's weights, the optimizer, the step; keeps the last two."""
    import torch

    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    torch.save({"step": step, "adapter": {n: p.detach().cpu() for n, p in params.items()},
                "optimizer": optimizer.state_dict(), "recipe": dataclasses.asdict(recipe), **extra},
               os.path.join(tmp, STATE_FILE))
    replace_folder(tmp, final)
    for _, old in checkpoint_dirs(output_dir)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def export_lora(unet, output_dir: str) -> str:
    """lora/pytorch_lora_weights.safetensors, written whole or not at all."""
    from sits_lora import export_diffusers_lora

    final = os.path.join(output_dir, "lora")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_diffusers_lora(unet, tmp)
    replace_folder(tmp, final)
    return final


def plot_losses(metrics: list[dict], path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [m["step"] for m in metrics]
    losses = [m["loss"] for m in metrics]
    window = max(1, len(losses) // 10)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    fig = Figure(figsize=(6, 3.5), tight_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="step loss")
    ax.plot(steps, smooth, lw=1.6, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("noise-prediction MSE")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.savefig(path, dpi=100)
