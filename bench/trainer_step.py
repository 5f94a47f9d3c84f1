"""NativeLoraTrainer's whole step, its batches copied to the GPU blocking or not.

    python bench/trainer_step.py --out OUT                      # a GPU: the 1B shape, both arms, 3 repeats
    python bench/trainer_step.py --smoke --out OUT              # a CPU: the tiny shape (checks the script)

What the gate's step arms leave out: the Trainer's own loop around the step (the DataLoader, accelerate's copy of
each batch to the GPU, the callbacks, the loss bookkeeping). Arms: ``non-blocking`` (pinned batches copied with
``TrainingArguments(accelerator_config={"non_blocking": True})``) and ``blocking`` (accelerate's default copy,
which waits for every kernel queued before it, so the host cannot prepare the next step while the GPU runs this
one). The model is bench_model's ``sits+default`` build (Liger's RMSNorm / SwiGLU / RoPE, sits_lora r16 on the
seven projections), bf16, fixed-length batches (the step is recorded as CUDA graphs where it can be). Each arm runs
in its own process; the arms alternate over ``--repeats``. Time per step: the wall time from the end of step
``--warmup`` to the end of the last step, the GPU synchronized at both ends, over the steps between. Writes
OUT/trainer_step.json / .csv / .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_model import MODELS, build  # noqa: E402
from harness import png, print_table, run_worker, write_results  # noqa: E402

ARMS = ("non-blocking", "blocking")


def worker(args) -> None:
    from transformers import TrainerCallback, TrainingArguments

    import sits_lora.training.native as trainer_module
    from sits_lora.training import NativeLoraTrainer

    cuda = torch.cuda.is_available() and not args.smoke
    if args.arm == "blocking" and hasattr(trainer_module, "copies_batches_without_blocking"):
        # a trainer that turns the non-blocking copy on by itself keeps accelerate's default copy here
        trainer_module.copies_batches_without_blocking = lambda training_args: False
    model_name, seq, batch = ("tiny", 32, 2) if args.smoke else (args.model, args.seq, args.batch)
    model, _ = build(model_name, "sits+default" if cuda else "sits", "cuda" if cuda else "cpu",
                     torch.bfloat16 if cuda else torch.float32, args.layers, seq)
    steps = args.warmup + args.steps
    gen = torch.Generator().manual_seed(0)
    vocab = MODELS[model_name]["vocab_size"]
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (steps * batch, seq), generator=gen)]
    marks: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            if state.global_step in (args.warmup, steps):
                if cuda:
                    torch.cuda.synchronize()
                marks[state.global_step] = time.perf_counter()

    training_args = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"), max_steps=steps, per_device_train_batch_size=batch,
        learning_rate=1e-4, bf16=cuda, use_cpu=not cuda, report_to="none", save_strategy="no",
        logging_steps=max(steps, 1), disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=cuda,
        seed=0, accelerator_config={"non_blocking": args.arm == "non-blocking"})
    trainer = NativeLoraTrainer(model=model, args=training_args, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    step_s = (marks[steps] - marks[args.warmup]) / args.steps
    recording = trainer.step_recording
    print("RESULT " + json.dumps({
        "arm": args.arm, "model": model_name, "step_s": step_s, "tokens_per_s": batch * seq / step_s,
        "non_blocking": bool(trainer.accelerator.non_blocking),
        "recorded": bool(recording and recording.on), "recording": recording.reason if recording else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}), flush=True)


def run_arm(args, arm: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--model", args.model,
           "--seq", str(args.seq), "--batch", str(args.batch), "--layers", str(args.layers),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", args.out]
    if args.smoke:
        cmd.append("--smoke")
    return run_worker(cmd, args.arm_timeout, {"arm": arm})


def summarize(runs: list[dict]) -> list[dict]:
    """One row per arm: the median step of its runs (each run a process), and the spread."""
    rows = []
    for arm in ARMS:
        ok = [r for r in runs if r["arm"] == arm and "step_s" in r]
        if not ok:
            rows.append({"arm": arm, "error": next((r["error"] for r in runs if r["arm"] == arm), "not run")})
            continue
        steps = [r["step_s"] for r in ok]
        median = statistics.median(steps)
        rows.append({**ok[0], "step_s": median, "tokens_per_s": ok[0]["tokens_per_s"] * ok[0]["step_s"] / median,
                     "runs": len(ok), "step_min_s": min(steps), "step_max_s": max(steps)})
    blocking = next((r["step_s"] for r in rows if r["arm"] == "blocking" and "step_s" in r), None)
    for row in rows:
        row["vs_blocking"] = row["step_s"] / blocking if blocking and "step_s" in row else None
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own count)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the clock starts (the recording included)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, alternating")
    parser.add_argument("--arm-timeout", type=float, default=300)
    parser.add_argument("--smoke", action="store_true", help="a CPU, the tiny shape, 2 + 3 steps, one repeat")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "trainer_step"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("seq", "batch", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: it must be a positive integer")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: it must be 0 or more")
    if args.smoke:
        args.warmup, args.steps, args.repeats = 2, 3, 1
    elif not args.worker and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the copy it measures is the host's to the GPU); --smoke checks the script on "
                     "a CPU")
    if args.worker:
        worker(args)
        return 0
    runs = []
    for repeat in range(args.repeats):
        for arm in ARMS:
            run = run_arm(args, arm)
            runs.append(run)
            print(f"[{arm} {repeat + 1}/{args.repeats}] " + (f"{run['step_s'] * 1000:.1f} ms a step, recorded: "
                  f"{run['recorded']}" if "step_s" in run else f"failed: {run['error']}"), flush=True)
    rows = summarize(runs)
    write_results("trainer_step", rows, args.out,
                  {"command": "python bench/trainer_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "runs": runs})
    with png(os.path.join(args.out, "trainer_step.png")) as ax:
        if ax is not None:
            ok = [r for r in rows if "step_s" in r]
            ax.bar([r["arm"] for r in ok], [r["step_s"] * 1000 for r in ok], color="#4a7")
            ax.set_ylabel(f"NativeLoraTrainer step, ms ({args.model}, bs {args.batch} x {args.seq})")
    print_table(rows, ["arm", "step_s", "vs_blocking", "tokens_per_s", "recorded", "non_blocking", "runs", "peak_gib"])
    return 0 if all("step_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
