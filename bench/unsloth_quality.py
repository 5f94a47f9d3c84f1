"""Does sits_lora train as well as Unsloth? SmolLM2-135M, the same blocks in the same order from the same start.

    python bench/unsloth_quality.py --out DIR                 # a GPU with unsloth (docs/unsloth.md): 2 arms x 3 seeds
    python bench/unsloth_quality.py --size tiny --out DIR     # a CPU: a tiny random model; the unsloth arm stops with
                                                              # one line (Unsloth runs on CUDA GPUs only)

Protocol: the evaluation's data (bench/dynamic_rank_harness.py: the offline standard-library corpus, whole held-out
modules as the test set, the blocks of a seed in the same order for both arms), 50 AdamW steps of 8 x 512 tokens,
one learning rate, warm-up then cosine decay, gradients clipped at 1. Both arms adapt the seven projections at
r 16, alpha 32, dropout 0, and start from the same adapter: after each library builds its adapter, every A is drawn
from a generator seeded by the run's seed (kaiming-uniform's bound) and every B set to 0. Unsloth loads the model from
a local folder (SmolLM2 from the offline GGUF, written once with ``save_pretrained``: no hub). Each run is a process
of its own (unsloth patches transformers when imported).

Target (issue 49): our held-out loss after 50 steps within the spread of Unsloth's three seeds.
Writes unsloth_quality.json (every run, every step's training loss), .csv (one row per run) and .png (the curves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dynamic_rank_harness import evaluate_model, load_blocks, load_eval_model, settings_for, train_model  # noqa: E402
from bench_model import import_unsloth  # noqa: E402
from harness import png, run_worker, write_results  # noqa: E402

ARMS = ("sits", "unsloth")
RANK, ALPHA = 16, 32
SIZES = {
    # SmolLM2-135M on one GPU
    "full": dict(seq_len=512, batch_size=8, steps=50, seeds=(0, 1, 2), test_blocks=64),
    # a tiny random model with a byte tokenizer: the tests, on a CPU, seconds
    "tiny": dict(model="tiny-random", seq_len=32, batch_size=2, steps=4, seeds=(0, 1), val_blocks=2, test_blocks=2,
                 eval_batch_size=2),
}


def same_start(model, seed: int) -> int:
    """Every LoRA A drawn from one generator seeded by ``seed`` in name order, every B zero: both libraries' adapters
    start equal whatever each one's initialization draws. Returns the number of adapted layers."""
    gen = torch.Generator().manual_seed(seed)
    layers = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name:
                bound = 1 / math.sqrt(p.shape[1])       # kaiming_uniform_(a=sqrt(5)) on a (r, in) weight
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
                layers += 1
            elif "lora_B" in name:
                p.zero_()
    return layers


def model_folder(settings, root: str) -> str:
    """The evaluation model written once as a local folder (weights, config, tokenizer) for Unsloth's loader."""
    folder = os.path.join(root, "smollm2-135m")
    if not os.path.exists(os.path.join(folder, "complete")):
        model, tokenizer, _ = load_eval_model(settings.model, settings.seq_len)
        os.makedirs(folder, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        open(os.path.join(folder, "complete"), "w").close()
    return folder


def build_arm(arm: str, settings, seed: int, device: torch.device):
    """(model, tokenizer) of one arm, its adapter at the common start."""
    targets = list(settings.target_modules)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if arm == "unsloth":
        from unsloth import FastLanguageModel

        folder = model_folder(settings, os.environ.get("SITS_BENCH_CHECKPOINTS", "/tmp/sits_bench_ckpt"))
        model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=settings.seq_len,
                                                             dtype=dtype, load_in_4bit=False, local_files_only=True,
                                                             use_gradient_checkpointing=False)
        model = FastLanguageModel.get_peft_model(model, r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                                                 target_modules=targets, use_gradient_checkpointing=False,
                                                 random_state=seed)
    else:
        from peft import get_peft_model

        from sits_lora import SitsLoraConfig

        base, tokenizer, _ = load_eval_model(settings.model, settings.seq_len)
        base = base.to(device, dtype)
        model = get_peft_model(base, SitsLoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                    target_modules=targets, task_type="CAUSAL_LM"))
    model.config.use_cache = False
    same_start(model, seed)
    return model, tokenizer


def worker(arm: str, size: str, seed: int, lr: float) -> dict:
    """One run: train, then the held-out loss. Stops with one line where the arm cannot run here."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if arm == "unsloth":
        import_unsloth(arm, device.type)   # before transformers (its patches need that), or one line and out
    settings = settings_for("tiny" if size == "tiny" else "budget", **SIZES[size], progress=False)
    model, tokenizer = build_arm(arm, settings, seed, device)
    train, _, test = load_blocks(tokenizer, settings)
    timing = train_model(model, train, settings, lr, seed)
    result = evaluate_model(model, test, settings)
    return {"arm": arm, "seed": seed, "lr": lr, "steps": settings.steps, "test_loss": result["loss"],
            "train_losses": timing["train_losses"], "final_train_loss": timing["train_losses"][-1],
            "train_seconds": timing["train_seconds"]}


def run_one(arm: str, size: str, seed: int, lr: float, timeout_s: float) -> dict:
    if arm == "unsloth" and not torch.cuda.is_available():   # the worker's own refusal, without starting it
        return {"arm": arm, "seed": seed, "error": f"arm {arm}: skipped: Unsloth runs on a CUDA GPU only"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", arm, "--size", size, "--seed", str(seed),
           "--lr", str(lr)]
    return run_worker(cmd, timeout_s, {"arm": arm, "seed": seed})


def verdict(runs: list[dict]) -> dict:
    """Our mean held-out loss against the spread (min to max) of Unsloth's seeds."""
    ours = [r["test_loss"] for r in runs if r["arm"] == "sits" and "test_loss" in r]
    theirs = [r["test_loss"] for r in runs if r["arm"] == "unsloth" and "test_loss" in r]
    if not ours or len(theirs) < 2:
        return {"ok": None, "detail": "not measured (needs our runs and at least two of Unsloth's seeds)"}
    mean = sum(ours) / len(ours)
    low, high = min(theirs), max(theirs)
    return {"ok": low <= mean <= high or mean < low, "sits_mean": mean, "unsloth_min": low, "unsloth_max": high,
            "detail": f"sits {mean:.4f} (mean of {len(ours)}), Unsloth {low:.4f}-{high:.4f} over {len(theirs)} seeds"}


def _plot(runs: list[dict], path: str) -> None:
    with png(path, figsize=(6.5, 3.8)) as ax:
        if ax is None:
            return
        for arm, color in (("sits", "#4a7"), ("unsloth", "#c66")):
            for i, run in enumerate(r for r in runs if r["arm"] == arm and "train_losses" in r):
                ax.plot(range(1, len(run["train_losses"]) + 1), run["train_losses"], color=color, alpha=0.8,
                        label=arm if i == 0 else None)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (one batch)")
        ax.legend()
        ax.set_title("LoRA r16 on 7 projections: same data, same start")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "unsloth_quality"))
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.lr <= 0:
        parser.error(f"--lr {args.lr} is invalid: it must be positive")
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.size, args.seed, args.lr)), flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    runs = []
    command = "python bench/unsloth_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    seeds = SIZES[args.size]["seeds"]
    for i, (seed, arm) in enumerate([(s, a) for s in seeds for a in args.arms], 1):
        run = run_one(arm, args.size, seed, args.lr, args.timeout)
        runs.append(run)
        said = run.get("error") or f"held-out loss {run['test_loss']:.4f}, {run['train_seconds']:.1f} s"
        print(f"[{i}/{len(seeds) * len(args.arms)}] {arm} seed {seed}: {said}", flush=True)
        # every finished run is on disk, whatever stops the next one
        write_results("unsloth_quality", [{k: v for k, v in r.items() if k != "train_losses"} for r in runs],
                      args.out, {"command": command, "runs": runs, "partial": True})
    check = verdict(runs)
    write_results("unsloth_quality", [{k: v for k, v in r.items() if k != "train_losses"} for r in runs], args.out,
                  {"command": command, "runs": runs, "verdict": check})
    if any("train_losses" in r for r in runs):
        _plot(runs, os.path.join(args.out, "unsloth_quality.png"))
    print(f"{'ok' if check['ok'] else 'FAIL' if check['ok'] is False else '--'} quality: {check['detail']}")
    return 1 if check["ok"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
