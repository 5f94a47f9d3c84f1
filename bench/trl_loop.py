"""The loop users run: TRL's SFTTrainer and DPOTrainer with stock LoRA, with sits_lora's layers, with sits_lora's step
(``native_step``), NativeLoraTrainer, the hand loop's recorded step, and Unsloth's FastLanguageModel in TRL.

    python bench/trl_loop.py --out OUT                                  # GPU: 1B, the SFT arms, 3 repeats
    python bench/trl_loop.py --out OUT --shapes 0.5b 1b 8b --arms sft-native native unsloth-sft
    python bench/trl_loop.py --smoke --out OUT                          # CPU: the tiny shape, checks the script

Random bf16 weights in Llama-3 shapes (bench_model.MODELS; 8B at --layers 4 unless given), LoRA r16 alpha 32 on the
seven projections with lora_B drawn N(0, 0.02) in every arm, fused AdamW, bf16, batches of --batch rows x --seq
tokens (DPO: --batch / 2 pairs, each pair a chosen and a rejected row of --seq tokens, prompt half of it).
Liger-Kernel's RMSNorm / RoPE / SwiGLU on every arm but Unsloth's (``use_liger_kernel=True``; TRL keeps its fused linear
cross-entropy off). Arms (ARMS) run each in its own process, alternating over --repeats; each row is the median of
its runs. Per run: --warmup steps, then --steps timed with the GPU synchronized at both ends (tokens/s), then
--host-steps with the GPU synchronized before each step, where the host's time from the step's begin to its end
over the step's wall time is the host share (near 1: the step waits on its host). Peak: the run's maximum
allocated memory. Writes OUT/trl_loop.json / .csv / .png and the one-schema rows (OUT/results.jsonl).
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
from bench_model import LORA, MODELS, llama_config, local_checkpoint, unsloth_lora_kwargs  # noqa: E402
from harness import png, print_table, run_worker, write_results  # noqa: E402

# arm -> (trainer, adapter, settings). trainer: "sft" / "dpo" (TRL's), "native-sft" / "native-dpo" (native_step of
# TRL's), "native" (NativeLoraTrainer), "hand" (bench_model's recorded default step), "unsloth-sft" (Unsloth's model
# in TRL's SFTTrainer). settings: "gc" (gradient checkpointing on, TRL's default), "packed" (SFTConfig(packing=True)).
ARMS = {
    "sft-lora": ("sft", "lora", ()),
    "sft-lora-gc": ("sft", "lora", ("gc",)),
    "sft-sits": ("sft", "sits", ()),
    "sft-native": ("native-sft", "sits", ("gc",)),          # TRL's defaults: checkpointing on, the plan decides
    "sft-native-packed": ("native-sft", "sits", ("gc", "packed")),
    "sft-lora-packed": ("sft", "lora", ("packed",)),
    "native": ("native", "sits", ()),
    "hand": ("hand", "sits", ()),
    "unsloth-sft": ("unsloth-sft", "unsloth", ()),
    "unsloth-sft-gc": ("unsloth-sft", "unsloth", ("gc",)),
    # Unsloth's model in SFTTrainer with TRL's defaults as they are: the Trainer's gradient checkpointing on
    "unsloth-sft-trl-defaults": ("unsloth-sft", "unsloth", ("trl-gc",)),
    "dpo-lora": ("dpo", "lora", ()),
    "dpo-native": ("native-dpo", "sits", ("gc",)),
    # the same step under the TRL that Unsloth's wheel set carries (1.15), in that set's site (--unsloth-wheels)
    "sft-native-trl115": ("native-sft", "sits", ("gc",)),
}
# the arms that run in the site of Unsloth's wheels (its TRL 1.15 and datasets 4.x) instead of this process's
UNSLOTH_SITE_ARMS = ("unsloth-sft", "unsloth-sft-gc", "unsloth-sft-trl-defaults", "sft-native-trl115")
UNSLOTH_SITE = "/tmp/site_unsloth"
DEFAULT_ARMS = ["sft-lora", "sft-sits", "sft-native", "native", "hand"]
SMOKE_ARMS = ["sft-lora", "sft-native", "native", "dpo-lora", "dpo-native"]


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the special tokens' names are no word's prefix: an added token is matched inside words ("t1" in "t120")
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {**{name: i for i, name in enumerate(specials)}, **{f"t{i}": i for i in range(len(specials), vocab_size)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def _sft_data(rows: int, seq: int, vocab: int, packed: bool):
    """``rows`` examples of ``seq`` random tokens; packed: documents of 64 to ``seq`` tokens, as many tokens in all."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    if not packed:
        return Dataset.from_dict({"input_ids": torch.randint(4, vocab, (rows, seq), generator=gen).tolist()})
    docs, total = [], 0
    while total < rows * seq * 1.2:   # enough for every step whatever the packing leaves over
        n = int(torch.randint(64, seq + 1, (1,), generator=gen))
        docs.append(torch.randint(4, vocab, (n,), generator=gen).tolist())
        total += n
    return Dataset.from_dict({"input_ids": docs})


def _dpo_data(pairs: int, seq: int, vocab: int):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    prompt, completion = seq // 2, seq - seq // 2 - 1    # TRL appends the EOS to each completion

    def words(n):
        return " ".join(f"t{i}" for i in torch.randint(4, vocab, (n,), generator=gen).tolist())

    return Dataset.from_dict({"prompt": [words(prompt) for _ in range(pairs)],
                              "chosen": [" " + words(completion) for _ in range(pairs)],
                              "rejected": [" " + words(completion) for _ in range(pairs)]})


class _Clock:
    """A TrainerCallback's timings: the timed window (GPU synchronized at its ends), then per host step the host's
    time from the step's begin to its end, the GPU synchronized before each step."""

    def __init__(self, warmup: int, steps: int, cuda: bool):
        self.warmup, self.timed_end, self.cuda = warmup, warmup + steps, cuda
        self.marks, self.host, self.walls, self._begin = {}, [], [], None

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step >= clock.timed_end:
                    clock._sync()
                    now = time.perf_counter()
                    if clock._begin is not None:
                        clock.walls.append(now - clock._begin)
                    clock._begin = now

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step in (clock.warmup, clock.timed_end):
                    clock._sync()
                    clock.marks[state.global_step] = time.perf_counter()
                elif state.global_step > clock.timed_end and clock._begin is not None:
                    clock.host.append(time.perf_counter() - clock._begin)

        return Clock()

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def _model(shape: str, layers: int, device: str, dtype):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(shape, layers)).to(dtype)
    model.config.use_cache = False
    return model


def _draw_lora_b(model) -> None:
    with torch.no_grad():  # B = 0 at init; every arm trains with B != 0, as the gate's arms do
        for name, p in model.named_parameters():
            if "lora_B" in name and p.requires_grad:
                p.normal_(0, 0.02)


def worker(args) -> None:
    kind, adapter, settings = ARMS[args.arm]
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if kind == "unsloth-sft":
        from bench_model import import_unsloth

        import_unsloth(args.arm, device)
    import trl
    from peft import LoraConfig

    import sits_lora
    from sits_lora import SitsLoraConfig

    shape, layers = args.shape, args.layers
    vocab = MODELS[shape]["vocab_size"]
    total = args.warmup + args.steps + args.host_steps
    gc = "gc" in settings
    common = dict(output_dir=os.path.join(args.out, "trainer", args.arm), max_steps=total, learning_rate=1e-4,
                  bf16=cuda, use_cpu=not cuda, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
                  dataloader_num_workers=0, gradient_checkpointing=gc, use_liger_kernel=cuda and adapter != "unsloth")
    clock = _Clock(args.warmup, args.steps, cuda)
    tokenizer = _tokenizer(vocab)
    peft_config = (LoraConfig if adapter == "lora" else SitsLoraConfig)(**LORA) if adapter != "unsloth" else None
    if kind == "unsloth-sft":
        from unsloth import FastLanguageModel

        root = os.environ.get("SITS_BENCH_CHECKPOINTS", "/tmp/sits_bench_ckpt")
        folder = local_checkpoint(shape, layers, dtype, root, device="cuda")
        model, tokenizer = FastLanguageModel.from_pretrained(model_name=folder, max_seq_length=args.seq, dtype=dtype,
                                                             load_in_4bit=False, local_files_only=True)
        model = FastLanguageModel.get_peft_model(model, **unsloth_lora_kwargs("unsloth+gc" if gc else "unsloth"))
        # Unsloth's own checkpointing ("unsloth") is set on the model above; the Trainer's only under "trl-gc"
        common["gradient_checkpointing"] = "trl-gc" in settings
    elif kind == "hand":
        raise SystemExit("the hand arm runs bench_model's worker (run_arm)")
    else:
        model = _model(shape, layers, device, dtype)
    if kind in ("sft", "native-sft", "unsloth-sft"):
        config = trl.SFTConfig(per_device_train_batch_size=args.batch, max_length=args.seq,
                               packing="packed" in settings, **common)
        data = _sft_data(args.batch * total, args.seq, vocab, "packed" in settings)
        cls = sits_lora.native_step(trl.SFTTrainer) if kind == "native-sft" else trl.SFTTrainer
        rows_per_step = args.batch
    elif kind in ("dpo", "native-dpo"):
        config = trl.DPOConfig(per_device_train_batch_size=max(1, args.batch // 2), max_length=args.seq, **common)
        data = _dpo_data(max(1, args.batch // 2) * total, args.seq, vocab)
        cls = sits_lora.native_step(trl.DPOTrainer) if kind == "native-dpo" else trl.DPOTrainer
        rows_per_step = 2 * max(1, args.batch // 2)
    else:   # NativeLoraTrainer on the same rows, labels = inputs
        from transformers import TrainingArguments

        from sits_lora import NativeLoraTrainer

        common.pop("gradient_checkpointing")
        config = TrainingArguments(per_device_train_batch_size=args.batch, dataloader_pin_memory=cuda,
                                   liger_kernel_config={"fused_linear_cross_entropy": False}, **common)
        ids = torch.randint(4, vocab, (args.batch * total, args.seq), generator=torch.Generator().manual_seed(0))
        data = [{"input_ids": row, "labels": row} for row in ids]
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)    # the TRL arms get theirs from peft_config
        cls, rows_per_step = NativeLoraTrainer, args.batch
    kwargs = dict(model=model, args=config, train_dataset=data, callbacks=[clock.callback()])
    if cls is not sits_lora.NativeLoraTrainer:
        kwargs.update(processing_class=tokenizer, peft_config=peft_config)
    trainer = cls(**kwargs)
    _draw_lora_b(trainer.model)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    step_s = (clock.marks[args.warmup + args.steps] - clock.marks[args.warmup]) / args.steps
    tokens = rows_per_step * args.seq
    recording = getattr(trainer, "step_recording", None)
    losses = [e.get("loss", e.get("train_loss")) for e in trainer.state.log_history if "loss" in e or "train_loss" in e]
    host = statistics.median(clock.host) if clock.host else None
    host_wall = statistics.median(clock.walls) if clock.walls else None
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print("RESULT " + json.dumps({
        "arm": args.arm, "model": shape, "layers": layers or MODELS[shape]["num_hidden_layers"], "batch": args.batch,
        "seq": args.seq, "step_s": step_s, "tokens_per_s": tokens / step_s, "host_s": host,
        "host_share": host / host_wall if host and host_wall else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "recorded": bool(recording and recording.on), "recording": recording.reason if recording else None,
        "loss": losses[-1] if losses else None, "train_wall_s": wall, "trainable_params": trainable,
        "trl": trl.__version__,
        "unsloth": _version("unsloth") if kind == "unsloth-sft" else None}), flush=True)


def _version(name: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run_arm(args, shape: str, arm: str) -> dict:
    if ARMS[arm][0] == "hand":
        import bench_model

        row = bench_model.run_arm(shape, "sits+default", batch=args.batch, seq=args.seq, warmup=args.warmup,
                                  steps=args.steps, smoke=args.smoke, layers=args.layers,
                                  timeout_s=args.arm_timeout)
        row["arm"] = arm
        if row.get("host_s") and row.get("step_s"):
            row["host_share"] = row["host_s"] / row["step_s"]
        return row
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm", arm, "--shape", shape,
           "--seq", str(args.seq), "--batch", str(args.batch), "--layers", str(args.layers),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--host-steps", str(args.host_steps),
           "--out", args.out]
    if args.smoke:
        cmd.append("--smoke")
    env = None
    if arm in UNSLOTH_SITE_ARMS:
        if not args.unsloth_site:
            return {"arm": arm, "model": shape, "error": "no Unsloth wheels (--unsloth-wheels: bench/carry_unsloth.py "
                                                         "makes them)"}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.unsloth_site, os.environ.get("PYTHONPATH", "")]),
                   HF_HUB_OFFLINE="1")
    return run_worker(cmd, args.arm_timeout, {"arm": arm, "model": shape}, env=env)


def install_unsloth_site(wheels: str) -> str:
    """Unsloth's wheel set (bench/carry_unsloth.py) installed into UNSLOTH_SITE; "" where there are none."""
    import glob
    import subprocess

    found = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not found:
        return ""
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", UNSLOTH_SITE, *found])
    return UNSLOTH_SITE if done.returncode == 0 else ""


def summarize(runs: list[dict], arms: list[str], shapes: list[str]) -> list[dict]:
    """One row per (shape, arm): the median step of its runs, the spread, and the ratios to NativeLoraTrainer's
    and to the faster of the Unsloth arms of the same shape."""
    rows = []
    for shape in shapes:
        for arm in arms:
            ok = [r for r in runs if r.get("model") == shape and r["arm"] == arm and "step_s" in r]
            if not ok:
                rows.append({"model": shape, "arm": arm, "error": next(
                    (r["error"] for r in runs if r.get("model") == shape and r["arm"] == arm), "not run")})
                continue
            steps = [r["step_s"] for r in ok]
            median = statistics.median(steps)
            shares = [r["host_share"] for r in ok if r.get("host_share")]
            rows.append({**ok[0], "step_s": median, "tokens_per_s": ok[0]["tokens_per_s"] * ok[0]["step_s"] / median,
                         "runs": len(ok), "step_min_s": min(steps), "step_max_s": max(steps),
                         "host_share": statistics.median(shares) if shares else None,
                         "peak_gib": max((r.get("peak_gib") or 0) for r in ok) or None})
        by_arm = {r["arm"]: r for r in rows if r["model"] == shape and "step_s" in r}
        unsloth = max((by_arm[a]["tokens_per_s"] for a in by_arm if a.startswith("unsloth")), default=None)
        for row in (r for r in rows if r["model"] == shape and "step_s" in r):
            native = by_arm.get("native")
            row["x_native"] = row["tokens_per_s"] / native["tokens_per_s"] if native else None
            row["x_unsloth"] = row["tokens_per_s"] / unsloth if unsloth else None
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(MODELS), default=["1b"])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=None)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4 for 8b, else all)")
    parser.add_argument("--warmup", type=int, default=4, help="steps before the clock starts (the recording included)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--host-steps", type=int, default=3, help="steps after, synchronized, for the host share")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm, alternating")
    parser.add_argument("--arm-timeout", type=float, default=300)
    parser.add_argument("--smoke", action="store_true", help="a CPU, the tiny shape, 2 + 2 + 1 steps, one repeat")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "trl_loop"))
    parser.add_argument("--unsloth-wheels", default=os.path.join(os.path.dirname(HERE), ".whl_unsloth"),
                        help="Unsloth's wheel set for the arms that need it (UNSLOTH_SITE_ARMS)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(MODELS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("seq", "batch", "steps", "repeats", "host_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: it must be a positive integer")
    if args.warmup < 3:
        parser.error(f"--warmup {args.warmup}: the step records at its third call; give at least 3")
    if args.smoke:
        args.shapes, args.seq, args.batch, args.repeats = ["tiny"], 32, 2, 1
        args.warmup, args.steps, args.host_steps = 3, 2, 1
        args.arms = args.arms or SMOKE_ARMS
    elif not args.worker and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; --smoke checks the script on a CPU")
    if args.worker:
        if args.layers is None:
            args.layers = 4 if args.shape == "8b" else 0
        worker(args)
        return 0
    arms = args.arms or DEFAULT_ARMS
    args.unsloth_site = install_unsloth_site(args.unsloth_wheels) if set(arms) & set(UNSLOTH_SITE_ARMS) else ""
    runs = []
    for repeat in range(args.repeats):
        for shape in args.shapes:
            layers = args.layers if args.layers is not None else (4 if shape == "8b" else 0)
            shape_args = argparse.Namespace(**{**vars(args), "layers": layers})
            for arm in arms:
                run = run_arm(shape_args, shape, arm)
                runs.append(run)
                print(f"[{shape} {arm} {repeat + 1}/{args.repeats}] " + (
                    f"{run['tokens_per_s']:,.0f} tokens/s, host share {run.get('host_share') or 0:.2f}, peak "
                    f"{run.get('peak_gib') or 0:.2f} GiB, recorded {run.get('recorded')}" if "step_s" in run
                    else f"failed: {run['error']}"), flush=True)
    rows = summarize(runs, arms, args.shapes)
    write_results("trl_loop", rows, args.out,
                  {"command": "python bench/trl_loop.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "runs": runs})
    with png(os.path.join(args.out, "trl_loop.png"), figsize=(8, 3.5)) as ax:
        if ax is not None:
            ok = [r for r in rows if "step_s" in r]
            ax.barh([f"{r['model']} {r['arm']}" for r in ok], [r["tokens_per_s"] for r in ok], color="#4a7")
            ax.set_xlabel(f"tokens/s (bs {args.batch} x {args.seq}, median of {args.repeats})")
    print_table(rows, ["model", "arm", "tokens_per_s", "x_native", "x_unsloth", "host_share", "peak_gib", "recorded",
                       "runs", "loss"])
    for row in rows:
        if row.get("recording"):
            print(f"{row['model']} {row['arm']}: {row['recording']}")
    return 0 if all("step_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
